"""JAX adapter suite: the shared adapter checks of ``kit``, run in JAX's own environment (envs/jax: JAX needs
numpy >= 2, the development environment has numpy < 2 for MXNet). Not collected by the main suite (its name does not
match test_*.py): tests/adapters/test_jax.py runs it there with ``python -m pytest tests/adapters/jax_suite.py`` and
requires every test to pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adapters.jax import JaxAdapter
from tests.adapters import kit


def test_learns_digits_on_cpu():
    kit.check_learns_digits(JaxAdapter)


def test_holds_canonical_weights_and_matches_reference_forward():
    kit.check_same_initial_weights_and_logits(JaxAdapter)


def test_parameter_count_matches_model():
    kit.check_parameter_count(JaxAdapter)


def test_inference_after_training_is_the_reference_on_the_reported_state():
    kit.check_inference_after_training(JaxAdapter)


def test_set_train_images_replaces_the_images_without_a_retrace():
    kit.check_set_train_images(JaxAdapter)


def test_allocator_options_on_cpu():
    kit.check_allocator_options_on_cpu(JaxAdapter)


def test_the_train_step_compiles_once_per_shape():
    """Warm-up must hold the compilation: a second call with the step's own outputs as its state must not compile
    again (an uncommitted PRNG key once made it, and the first timed step then cost a compilation)."""
    adapter, data, _ = kit.make(JaxAdapter)
    for batch in kit.batches(len(data.y_train), 32, 5):
        adapter.train_step(batch)
    adapter.train_step(np.arange(64), micro_batches=2)
    adapter.sync()
    assert adapter.settings()["train_step_compilations"] == {"32x1": 1, "64x2": 1}


def test_oom_is_classified_by_status_and_type():
    adapter = JaxAdapter()
    try:
        jnp.zeros((2**50,), jnp.float32).block_until_ready()  # 4 PiB: XLA's CPU allocator refuses it
    except Exception as exc:  # noqa: BLE001
        assert adapter.is_oom(exc), repr(exc)
        assert "RESOURCE_EXHAUSTED" in str(exc)
    else:
        pytest.fail("an allocation of 4 PiB succeeded")
    assert not adapter.is_oom(ValueError("RESOURCE_EXHAUSTED"))  # a message alone does not make an OOM
    assert not adapter.is_oom(RuntimeError("out of memory"))


def test_memory_settings_are_recorded():
    adapter, _, _ = kit.make(JaxAdapter)
    settings = adapter.settings()
    assert settings["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and settings["matmul_precision"] == "highest"
    assert adapter.memory_stats() == {}  # the CPU backend keeps no allocator statistics
    assert jax.config.jax_default_matmul_precision == "highest"


def test_a_gpu_is_unavailable_here():
    with pytest.raises(kit_device_unavailable()):
        JaxAdapter().prepare("cuda:0", 1, 0)


def kit_device_unavailable():
    from adapters.base import DeviceUnavailable

    return DeviceUnavailable

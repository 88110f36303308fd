"""MXNet adapter: the conformance suite (tests/adapters/conformance.py), and what is MXNet's own: the optimizers'
update rules, evaluation across batch shapes, a step that queues its work, the epoch staged once by ``batches``, the
batchnorm kernel's biased variance, the settings, the GPU memory limit, OOM classification, and what ``build``
takes (a model of your own: test_mxnet_native.py)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from adapters.base import DeviceUnavailable
from adapters.mxnet import inputs as inputs_module
from adapters.mxnet.adapter import MXNetAdapter
from adapters.mxnet.batchnorm import running_var_is_biased

# mx through the adapter's runtime, which makes it importable on numpy >= 1.24
from adapters.mxnet.runtime import mx
from harness.neutral import datasets
from harness.spec import OptimizerSpec
from tests.adapters import kit
from tests.adapters.conformance import *  # noqa: F403 (the conformance tests, collected here)
from tests.helpers import run_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapter_cls():
    return MXNetAdapter


def _grads(adapter, batch_size):
    """The mean gradient of the last train_step: Gluon's grad arrays hold the gradient of the summed loss."""
    return {name: param.grad().asnumpy().astype(np.float64) / batch_size
            for name, (param, trained) in adapter._neutral.tensors.items() if trained}


def _mean_cross_entropy(info, weights, images, labels):
    logits = kit.numpy_forward(info, weights, images)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].mean())


def _two_steps(optimizer):
    adapter, data, info = kit.make(MXNetAdapter, optimizer=optimizer)
    order = datasets.epoch_order(len(data.y_train), 0, 0)
    batches = [order[:32], order[32:64]]
    weights = [{k: v.astype(np.float64) for k, v in adapter.get_weights().items()}]
    grads = []
    for batch in batches:
        kit.step(adapter, batch)
        assert np.isfinite(adapter.read_loss()[0])
        grads.append(_grads(adapter, len(batch)))
        weights.append({k: v.astype(np.float64) for k, v in adapter.get_weights().items()})
    return adapter, data, info, batches, weights, grads


def test_sgd_uses_mean_gradient_coupled_weight_decay_and_torch_momentum():
    lr, momentum, wd = 0.05, 0.9, 1e-2
    _, data, info, batches, w, g = _two_steps(
        OptimizerSpec(name="sgd", learning_rate=lr, momentum=momentum, weight_decay=wd))
    # The gradient MXNet computed is the gradient of the batch's MEAN cross-entropy: a float64 central difference of
    # the numpy reference loss along a random direction (at the weights of step 2, whose biases are non-zero, so that
    # no ReLU sits exactly on its kink).
    rng = np.random.default_rng(0)
    direction = {k: rng.standard_normal(v.shape) for k, v in w[1].items()}
    h = 1e-6
    images, labels = data.x_train[batches[1]], data.y_train[batches[1]]
    plus = _mean_cross_entropy(info, {k: v + h * direction[k] for k, v in w[1].items()}, images, labels)
    minus = _mean_cross_entropy(info, {k: v - h * direction[k] for k, v in w[1].items()}, images, labels)
    numeric = (plus - minus) / (2 * h)
    analytic = sum(float((g[1][k] * direction[k]).sum()) for k in direction)
    assert numeric == pytest.approx(analytic, rel=1e-3), (numeric, analytic)
    # PyTorch's SGD: v <- momentum * v + (g + wd * p); p <- p - lr * v.
    for name in w[0]:
        v1 = g[0][name] + wd * w[0][name]
        np.testing.assert_allclose(w[1][name], w[0][name] - lr * v1, rtol=1e-5, atol=1e-6, err_msg=name)
        v2 = momentum * v1 + g[1][name] + wd * w[1][name]
        np.testing.assert_allclose(w[2][name], w[1][name] - lr * v2, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("epsilon", [1e-3, 1e-8])
def test_adam_is_pytorchs_coupled_weight_decay_and_epsilon_after_the_bias_correction(epsilon):
    # PyTorch's rule (harness.spec.OptimizerSpec): p <- p - lr * m_hat / (sqrt(v_hat) + epsilon). MXNet's own rule,
    # epsilon added to sqrt(v) before the bias correction, lands up to ~7e-3 away from it after two steps, with either
    # epsilon (parameters whose gradient is of the order of epsilon move by a good fraction of lr either way; checked
    # below), while the adapter matches PyTorch's rule within ~1.3e-7.
    lr, b1, b2, wd = 1e-2, 0.9, 0.999, 1e-2
    _, _, _, _, w, g = _two_steps(OptimizerSpec(name="adam", learning_rate=lr, beta1=b1, beta2=b2, epsilon=epsilon,
                                                weight_decay=wd))
    keras_gap = 0.0
    for name in w[0]:
        m = v = 0.0
        for t in (1, 2):
            grad = g[t - 1][name] + wd * w[t - 1][name]
            m = b1 * m + (1 - b1) * grad
            v = b2 * v + (1 - b2) * grad**2
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            expected = w[t - 1][name] - lr * m_hat / (np.sqrt(v_hat) + epsilon)
            np.testing.assert_allclose(w[t][name], expected, rtol=1e-5, atol=1e-7, err_msg=f"{name} step {t}")
            keras = w[t - 1][name] - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + epsilon)
            keras_gap = max(keras_gap, float(np.abs(keras - expected).max()))
    assert keras_gap > 1e-4, keras_gap  # the two placements really differ here, so the check above can fail


def test_evaluation_is_independent_of_batch_shape_and_interleaves_with_training():
    adapter, data, info = kit.make(MXNetAdapter)
    assert np.isnan(adapter.read_loss()[0])  # no step yet
    kit.train_epochs(adapter, data, epochs=1, batch_size=32)
    weights = adapter.get_weights()
    logits = kit.numpy_forward(info, weights, data.x_test)
    shifted = logits - logits.max(axis=1, keepdims=True)
    ref_loss = float(-(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))[
        np.arange(len(data.y_test)), data.y_test].mean())
    ref_acc = float((logits.argmax(axis=1) == data.y_test).mean())
    n = len(data.y_test)
    for batch_size in (256, n, 100, 7, 256):  # the static-shape graph re-planned for each shape, and back
        loss, acc = adapter.evaluate(batch_size)
        assert loss == pytest.approx(ref_loss, rel=1e-5), batch_size
        assert acc == pytest.approx(ref_acc, abs=0.5 / n), batch_size
        # training between evaluations still works on its own shape
        kit.step(adapter, datasets.epoch_order(len(data.y_train), 1, batch_size)[:32])
        assert np.isfinite(adapter.read_loss()[0])
        weights = adapter.get_weights()
        logits = kit.numpy_forward(info, weights, data.x_test)
        shifted = logits - logits.max(axis=1, keepdims=True)
        ref_loss = float(-(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))[
            np.arange(n), data.y_test].mean())
        ref_acc = float((logits.argmax(axis=1) == data.y_test).mean())
    np.testing.assert_allclose(adapter.predict(data.x_test[:5]), logits[:5], rtol=1e-4, atol=1e-5)


def test_train_step_queues_its_work_without_waiting_for_the_device():
    """Neither ``batches`` (the epoch's indices wrapped by ``nd.from_numpy``) nor ``train_step`` waits for the work
    already queued on the CPU."""
    adapter, data, _ = kit.make(MXNetAdapter)
    batch = datasets.epoch_order(len(data.y_train), 0, 0)[:32]
    kit.step(adapter, batch)
    adapter.read_loss()[0]  # the first step builds and plans the graph
    a = mx.nd.ones((1500, 1500))
    mx.nd.waitall()
    start = time.perf_counter()
    busy = [mx.nd.dot(a, a) for _ in range(6)]  # queued CPU work: tens to hundreds of milliseconds
    kit.step(adapter, batch)
    queued = time.perf_counter() - start
    loss = adapter.read_loss()[0]
    total = time.perf_counter() - start
    assert np.isfinite(loss) and busy[-1].shape == (1500, 1500)
    # A train_step that synchronised (mx.nd.array's copy does, on the CPU) would take about as long as the whole.
    assert queued < 0.25 * total, (queued, total)
    assert batch.flags.writeable  # the caller's indices are not handed to MXNet (from_numpy would freeze them)


def test_cuda_index_out_of_range_is_device_unavailable():
    adapter = MXNetAdapter()
    with pytest.raises(DeviceUnavailable):
        adapter.prepare(f"cuda:{mx.context.num_gpus()}", None, 0)  # one past the last GPU (cuda:0 on a CPU build)


def test_versions_and_settings_are_recorded():
    adapter, _, _ = kit.make(MXNetAdapter)
    assert adapter.versions()["mxnet"] == mx.__version__
    settings = adapter.settings().record()
    assert settings["hybridize"] == {"static_alloc": True, "static_shape": True}
    assert settings["threads_requested"] == 2
    assert settings["intra_op_threads"] >= 1
    assert settings["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "")
    assert adapter.memory_stats() == {}


def test_oom_is_classified_by_exception_type():
    adapter = MXNetAdapter()
    MXNetError = mx.base.MXNetError
    assert adapter.is_oom(MXNetError("src/storage/./pooled_storage_manager.h:161: cudaMalloc retry failed: "
                                     "out of memory"))
    assert adapter.is_oom(MXNetError("src/storage/./cpu_device_storage.h:74: Failed to allocate CPU Memory"))
    assert not adapter.is_oom(MXNetError("Check failed: (dshape[1]) == (512): incompatible input shape"))
    assert not adapter.is_oom(ValueError("out of memory"))  # a message alone does not make an OOM
    assert not adapter.is_oom(RuntimeError("CUDA: out of memory"))  # nor does another framework's RuntimeError


def test_tensor_over_the_size_limit_is_not_oom():
    adapter = MXNetAdapter()
    try:
        mx.nd.zeros((2**42,)).wait_to_read()  # 16 TiB: refused by a shape check (2^31 elements), before allocating
    except BaseException as exc:  # noqa: BLE001 - the point is to classify whatever it raised
        assert isinstance(exc, mx.base.MXNetError), repr(exc)
        assert not adapter.is_oom(exc), str(exc)
    else:
        raise AssertionError("a 2^42-element tensor was created")


_CPU_ALLOCATION_FAILURE = textwrap.dedent("""
    import json, re, resource
    from adapters.mxnet.adapter import MXNetAdapter
    from adapters.mxnet.runtime import mx
    mx.nd.ones((1,)).asnumpy()  # start the engine's threads before limiting the address space
    vm = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))
    try:
        mx.nd.zeros((2**30,)).wait_to_read()  # 4 GiB, 3 GiB over the limit
    except BaseException as exc:
        print(json.dumps({"type": type(exc).__module__ + "." + type(exc).__qualname__, "message": str(exc),
                          "is_oom": MXNetAdapter().is_oom(exc)}))
    else:
        print(json.dumps(None))
""")


def test_real_cpu_allocation_failure_is_oom():
    # In a child process whose address space is capped 1 GiB above its current size, so that a 4 GiB tensor fails in
    # MXNet's CPU allocator on any machine (a capped child does not disturb this process's other threads).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _CPU_ALLOCATION_FAILURE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result is not None, "a 4 GiB allocation succeeded under a 1 GiB headroom"
    assert result["type"] == "mxnet.base.MXNetError", result
    assert "Failed to allocate CPU Memory" in result["message"], result
    assert result["is_oom"], result


def test_memory_limit_on_a_gpu_is_recorded_as_unsupported(monkeypatch):
    """No GPU here: the GPU count is faked (mx.gpu(0) is only a Context until an operator runs on it). MXNet 1.9.1 has
    no per-process GPU memory cap, so the adapter applies nothing and says so."""
    monkeypatch.setattr(mx.context, "num_gpus", lambda: 1)
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # prepare sets it by setdefault; keep this process clean
    adapter = MXNetAdapter(run_options({"tensorflow_memory_growth": True, "memory_limit_bytes": 4 * 10**9}))
    adapter.prepare("cuda:0", None, 0)
    settings = adapter.settings().record()
    assert settings["memory_limit"] == "not supported by MXNet on GPU"
    assert settings["memory_limit_bytes"] is None and settings["memory_limit_requested_bytes"] == 4 * 10**9
    unlimited = MXNetAdapter(run_options({"memory_limit_bytes": None}))
    unlimited.prepare("cuda:0", None, 0)
    assert "memory_limit" not in unlimited.settings().record()


def test_cpu_batchnorm_kernel_updates_with_the_biased_variance():
    """The fact the adapter corrects (``adapters.mxnet.batchnorm.RunningVariance``): MXNet 1.9.1's CPU BatchNorm, on a
    (C, H, W) input hybridized and on a flat one imperatively, updates its running variance with the biased batch
    variance, where the canonical update (and cuDNN's) uses the unbiased one. The probe measures it; should a build do
    otherwise, the adapter follows."""
    assert running_var_is_biased(mx.cpu(), (3, 5, 5), {"static_alloc": True, "static_shape": True})
    assert running_var_is_biased(mx.cpu(), (7,))


def test_switching_between_plain_and_accumulated_steps():
    """grad_req switches between write (plain steps) and add (accumulation) as the steps ask; gradients are zeroed
    before each accumulated step. The same mixed sequence gives PyTorch's parameters."""
    from adapters.pytorch.adapter import PyTorchAdapter

    mx_adapter, data, _ = kit.make(MXNetAdapter)
    torch_adapter = kit.make(PyTorchAdapter)[0]
    for batch, k in zip(kit.batches(len(data.y_train), 32, 5), (4, 1, 2, 2, 1)):
        for adapter in (mx_adapter, torch_adapter):
            kit.step(adapter, batch, micro_batches=k)
        np.testing.assert_allclose(mx_adapter.read_loss()[0], torch_adapter.read_loss()[0], rtol=1e-5)
    expected = torch_adapter.get_weights()
    for name, value in mx_adapter.get_weights().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_batches_stage_the_epoch_once_when_called_and_steps_are_its_slices(monkeypatch):
    """``batches`` wraps the epoch's order once (``nd.from_numpy``), when it is called (before the first ``next``: the
    first epoch's staging stays outside the timed windows), and each batch is its step's slice of that one array.
    Training through staged epochs, the next staged while the last steps of the one before may still be queued, gives
    exactly the weights of training on each step's indices wrapped on their own (one ``batches`` call a step)."""
    wrapped = []
    real = inputs_module.nd.from_numpy
    monkeypatch.setattr(inputs_module.nd, "from_numpy", lambda *a, **k: wrapped.append(1) or real(*a, **k))
    states = []
    for staged in (False, True):
        adapter, data, _ = kit.make(MXNetAdapter)
        wrapped.clear()
        for epoch in range(2):
            order = datasets.epoch_order(len(data.y_train), 0, epoch)[:100]
            if staged:
                batches = adapter.batches(order, 32, epoch)
                assert len(wrapped) == epoch + 1  # staged when called, not at the first next()
                batches = list(batches)
                assert len(batches) == 3  # whole steps only
                for position, batch in enumerate(batches):
                    (indices,) = batch
                    np.testing.assert_array_equal(indices.asnumpy(), order[position * 32:(position + 1) * 32])
                    adapter.train_step(batch)
            else:
                for step in range(3):
                    kit.step(adapter, order[step * 32:(step + 1) * 32], epoch=epoch)
        adapter.read_loss()
        assert len(wrapped) == (2 if staged else 6)  # once an epoch, or once a step
        states.append(adapter.get_weights())
    assert order.flags.writeable  # the caller's order is not handed to MXNet (from_numpy would freeze it)
    for name, value in states[0].items():
        np.testing.assert_array_equal(states[1][name], value, err_msg=name)


def test_build_trains_any_gluon_block_and_refuses_anything_else():
    """``build`` trains any Gluon block, batchnorm included (corrected only in the neutral builder's model; another
    model's trains as MXNet's own: tests/adapters/test_mxnet_native.py), and refuses what is not a block."""
    adapter = MXNetAdapter()
    adapter.prepare("cpu", 2, 0)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(4, in_units=3), mx.gluon.nn.BatchNorm(in_channels=4))
    net.initialize(ctx=adapter.contexts)
    adapter.build(net, "image_classification", kit.SGD)
    assert adapter.training.variance.corrected == []
    assert set(adapter.get_buffers()) == {"1.running_mean", "1.running_var"}
    with pytest.raises(TypeError, match="gluon.Block"):
        adapter.build(object(), "image_classification", kit.SGD)

"""MXNet data parallelism (Gluon over N = 2 CPU contexts, ``mx.cpu(0)`` and ``mx.cpu(1)``, one process, a
``gluon.Trainer`` on a "device" kvstore): the driver ``tests.adapters.data_parallel_run`` trains its runs in one fresh
interpreter as the worker would set it up (MXNet needs no environment for several CPU contexts: a one-device run there
is bit for bit the same run alone; starting an interpreter and importing MXNet is most of a run's cost); the rest
builds adapters in this process and compares.

Equivalence with one device (fp32, 10 steps of batch 32): parameters within |a - b| <= 1e-6 + 1e-5 |b| (the comparison
of tests/adapters/test_equivalence.py's accumulation test), losses within 1e-5 relative, the same evaluation, with SGD
with momentum and with Adam, in the compiled (default) mode and the eager one; N = 2 equals 2 micro-batches of 16 on
one device. Observed: at most 3.0e-7 apart (SGD), 4.1e-7 (Adam), losses 1e-7 relative; N = 2 and the 2 micro-batches
are bit for bit the same. Batchnorm: each context normalises its own shard (the first step's loss is the mean of two
one-device runs on the two shards, and each context's running statistics are that shard's run's); the plan refuses
synchronised batchnorm on the CPU (MXNet's SyncBatchNorm deadlocks over CPU contexts: the declaration's note); its
arithmetic, the GPU path, is checked on the CPU where it can be made to run (``test_the_synchronised_path_...``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adapters.base import DataParallel, DeviceUnavailable, RunOptions, shard
from adapters.mxnet import DECLARATION
from adapters.mxnet.adapter import MXNetAdapter
from harness.neutral import datasets, models
from harness.plan.support import Conditions, data_parallel_gap, unsupported
from harness.spec import OptimizerSpec
from tests.adapters import kit
from tests.adapters.data_parallel_run import RUNS as DRIVER_RUNS
from tests.adapters.data_parallel_run import _model, runs_argument

ROOT = Path(__file__).resolve().parents[2]

#: the driver runs (data_parallel_run.RUNS) this file compares (MXNet refuses synchronised batchnorm on the CPU)
RUNS = {name: run for name, run in DRIVER_RUNS.items() if name not in ("bn-1", "bn-sync-2")}

#: Parameters of two runs that should train alike: |a - b| <= ATOL + RTOL |b|; with synchronised batchnorm the
#: cross-framework batchnorm tolerance of tests/adapters/test_equivalence.py (NORM_ATOL = NORM_RTOL = 1e-5).
RTOL, ATOL, SYNC_ATOL = 1e-5, 1e-6, 1e-5

#: The synchronised-batchnorm driver run on the CPU, which the plan refuses (the adapter does not re-check: see
#: test_the_synchronised_path_normalises_over_the_global_batch for why it runs here at all), and the one-device run it
#: is compared with, in one interpreter, in the eager mode (the declaration's default mode changed in that interpreter
#: only).
FORCED_SYNC = r'''
import dataclasses, sys
from adapters.mxnet.adapter import MXNetAdapter
MXNetAdapter.declaration = dataclasses.replace(MXNetAdapter.declaration, capabilities=dataclasses.replace(
    MXNetAdapter.declaration.capabilities, default_compile="eager"))
from tests.adapters import data_parallel_run
sys.exit(data_parallel_run.main(sys.argv[1:]))
'''


def _environment(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", **extra}


def _drive(argv: list[str], outs: dict[str, Path], env: dict[str, str]) -> dict[str, dict[str, np.ndarray]]:
    """Runs ``argv`` (the driver's runs); name -> what the run saved to ``outs[name]``."""
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = {}
    for name, out in outs.items():
        with np.load(out) as saved:
            loaded[name] = {key: saved[key] for key in saved.files}
    return loaded


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """Every driver run of ``RUNS``, in one fresh interpreter: name -> what it saved ("w:<name>" parameters and
    buffers, "losses" per step, "test" = (loss, accuracy))."""
    folder = tmp_path_factory.mktemp("mxnet_data_parallel")
    outs = {name: folder / f"{name}.npz" for name in RUNS}
    argv = [sys.executable, "-m", "tests.adapters.data_parallel_run", "mxnet",
            *runs_argument((devices, outs[name], *extra) for name, (devices, extra) in RUNS.items())]
    return _drive(argv, outs, _environment())


def _weights(saved: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key[2:]: value for key, value in saved.items() if key.startswith("w:")}


def _assert_same_training(mine: dict[str, np.ndarray], reference: dict[str, np.ndarray], atol: float = ATOL) -> None:
    """Parameters (and buffers) within ``atol`` + 1e-5 |b|, losses within 1e-5 relative, the same evaluation."""
    a, b = _weights(mine), _weights(reference)
    assert sorted(a) == sorted(b)
    largest = kit.max_differences(a, b)
    for name, value in b.items():
        np.testing.assert_allclose(a[name], value, rtol=RTOL, atol=atol,
                                   err_msg=f"{name}; over all: max |a - b| {largest[0]:.2g}, relative {largest[1]:.2g}")
    np.testing.assert_allclose(mine["losses"], reference["losses"], rtol=1e-5, err_msg="losses")
    np.testing.assert_allclose(mine["test"][0], reference["test"][0], rtol=1e-5, err_msg="test loss")
    assert mine["test"][1] == reference["test"][1], "test accuracy"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_devices_train_like_one_device_at_the_same_global_batch(runs, optimizer):
    """Batch 32 over two contexts (16 each, the kvstore summing the gradients, the update rescaled by 1 / 32) gives
    one context's parameters, losses and evaluation after 10 steps."""
    one, two = runs[f"{optimizer}-1"], runs[f"{optimizer}-2"]
    initial = models.initial_weights(kit.digits()[1], 0)
    for name, value in initial.items():
        assert np.abs(_weights(one)[name] - value).max() > 1e-3, f"{name} did not train"
    _assert_same_training(two, one)


def test_two_devices_equal_two_accumulated_micro_batches(runs):
    """The seed's claim: two contexts at global batch 32 are one context accumulating 2 micro-batches of 16 (the same
    per-shard gradients, summed in the same order). Observed bit for bit."""
    _assert_same_training(runs["sgd-2"], runs["accumulated-1"])


def _adapter(devices: int = 2, sync: bool = False, compile: str = "default", model=None,
             optimizer: OptimizerSpec = kit.SGD) -> MXNetAdapter:
    data, info = kit.digits(kit.CNN if model is None else model)
    parallel = (DataParallel(devices=tuple(f"cpu:{i}" for i in range(devices)), sync_batchnorm=sync)
                if devices > 1 else None)
    adapter = MXNetAdapter(RunOptions(data_parallel=parallel, compile=compile))
    adapter.prepare("cpu", 1, 0)
    adapter.build_neutral(info, models.initial_weights(info, 0), optimizer)
    adapter.load(data)
    return adapter


def _held(adapter: MXNetAdapter, device: int) -> dict[str, np.ndarray]:
    """Every parameter and buffer as context ``device`` holds it."""
    ctx = adapter.contexts[device]
    return {name: param.data(ctx).asnumpy() for name, (param, _) in adapter._neutral.tensors.items()}


def test_batchnorm_normalises_each_devices_own_shard(runs):
    """Without sync each context's batchnorm normalises over its own 16 samples: the two-context first step's loss is
    the mean of the first-step losses of two one-device adapters trained on shard(indices, 2, 0) and shard(indices,
    2, 1) from the same weights, not the one-device loss of the whole batch; and each context's running statistics
    are its shard's run's (get_buffers returns context 0's), while the parameters are the same on both contexts."""
    model = _model(True)
    data, _ = kit.digits(model)
    first = datasets.epoch_order(len(data.y_train), 0, 0)[:32]
    shards = []
    for device in range(2):
        single = _adapter(1, model=model)
        kit.step(single, shard(first, 2, device))
        shards.append((single.read_loss()[0], {**single.get_weights(), **single.get_buffers()}))
    whole = _adapter(1, model=model)
    kit.step(whole, first)
    whole_loss = whole.read_loss()[0]
    expected = (shards[0][0] + shards[1][0]) / 2
    assert runs["bn-2"]["losses"][0] == pytest.approx(expected, rel=1e-6)
    assert abs(runs["bn-2"]["losses"][0] - whole_loss) > 1e-4 * whole_loss  # 7e-4 relative apart

    parallel = _adapter(2, model=model)
    kit.step(parallel, first)
    assert parallel.read_loss()[0] == pytest.approx(expected, rel=1e-6)
    held = [_held(parallel, device) for device in range(2)]
    for device, (_, state) in enumerate(shards):
        for name in ("1.running_mean", "1.running_var"):
            np.testing.assert_allclose(held[device][name], state[name], rtol=1e-6, atol=1e-7,
                                       err_msg=f"context {device} {name}")
    assert not np.allclose(held[0]["1.running_mean"], held[1]["1.running_mean"])
    for name, value in parallel.get_buffers().items():
        np.testing.assert_array_equal(value, held[0][name], err_msg=name)
    for name in parallel.get_weights():
        np.testing.assert_array_equal(held[1][name], held[0][name], err_msg=name)


def test_synchronised_batchnorm_is_refused_on_the_cpu_with_the_reason():
    """The declaration offers SyncBatchNorm on GPUs only: the plan's rule (``harness.plan.support.unsupported``)
    refuses it on the CPU with the declaration's reason, for a model with batchnorm; a model without batchnorm is
    accepted with the option (there is nothing to synchronise), and the adapter builds and trains it."""
    model = _model(True)
    _, info = kit.digits(model)
    why = unsupported(DECLARATION, info, Conditions(device="cpu", data_parallel=2, sync_batchnorm=True))
    assert why is not None and why.startswith("the mxnet adapter has no synchronised batchnorm on cpu: ")
    assert "deadlocks" in why and "MXNET_CPU_TEMP_COPY" in why
    assert why == data_parallel_gap(DECLARATION, info, 2, True, "cpu")
    assert unsupported(DECLARATION, info, Conditions(device="cuda:0", data_parallel=2, sync_batchnorm=True)) is None
    assert unsupported(DECLARATION, kit.digits()[1],
                                               Conditions(device="cpu", data_parallel=2, sync_batchnorm=True)) is None
    adapter = _adapter(2, sync=True)  # the CNN without batchnorm builds, loads and trains
    kit.step(adapter, np.arange(32))
    assert np.isfinite(adapter.read_loss()[0])


def test_the_synchronised_path_normalises_over_the_global_batch(runs, tmp_path):
    """The SyncBatchNorm path the adapter takes on GPUs (``gluon.contrib.nn.SyncBatchNorm(num_devices=N)``, the running
    variance corrected with the global batch's values per channel), run over two CPU contexts in a driver whose
    interpreter lifts the CPU refusal. It can run there only with a private temporary workspace for every operator of a
    step (MXNET_CPU_TEMP_COPY=1024; with the default 4 it hangs in the first step) and in the eager mode, where every
    step draws its workspaces in the same turn (hybridized, the cached graph keeps its own while the per-step operators
    move on through the pool, and it hung after 5 steps even with 64). Then: the first step's loss is the one-device
    loss of the whole batch, and after 10 steps every parameter and running statistic is the one-device run's within
    1e-5 + 1e-5 |b| (test_equivalence.py's batchnorm tolerance; observed 1.5e-6 at most, the conv bias before the
    batchnorm, whose exact gradient is zero)."""
    outs = {"one": tmp_path / "sync-1.npz", "two": tmp_path / "sync-2.npz"}
    argv = [sys.executable, "-c", FORCED_SYNC, "mxnet", *runs_argument(
        [(1, outs["one"], "--batchnorm"), (2, outs["two"], "--batchnorm", "--sync-batchnorm")])]
    saved = _drive(argv, outs, _environment(MXNET_CPU_TEMP_COPY="1024"))
    one, two = saved["one"], saved["two"]
    assert two["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6)
    assert abs(two["losses"][0] - runs["bn-2"]["losses"][0]) > 1e-4 * one["losses"][0]  # not the per-device loss
    _assert_same_training(two, one, atol=SYNC_ATOL)


@pytest.mark.parametrize("optimizer", [kit.SGD, OptimizerSpec(name="adam", learning_rate=0.001)], ids=["sgd", "adam"])
def test_the_eager_mode_trains_like_one_device_and_like_the_compiled_mode(optimizer):
    """Unhybridized, two contexts train like one eager context and like the two hybridized ones (10 steps of 32)."""
    data, _ = kit.digits()
    steps = kit.batches(len(data.y_train), 32, 10)
    states = {}
    for name, devices, mode in (("one", 1, "eager"), ("eager", 2, "eager"), ("compiled", 2, "compiled")):
        adapter = _adapter(devices, compile=mode, optimizer=optimizer)
        assert adapter.settings().compile == mode
        losses, kept = kit.train_on(adapter, steps, keep=(10,))
        states[name] = (losses, kept[10], adapter.evaluate(64))
    for name in ("eager", "compiled"):
        losses, state, evaluation = states[name]
        np.testing.assert_allclose(losses, states["one"][0], rtol=1e-5, err_msg=f"{name} losses")
        for key, value in states["one"][1].items():
            np.testing.assert_allclose(state[key], value, rtol=RTOL, atol=ATOL, err_msg=f"{name} {key}")
        assert evaluation[0] == pytest.approx(states["one"][2][0], rel=1e-5)
        assert evaluation[1] == states["one"][2][1]


def test_every_context_holds_the_same_parameters_and_staging_changes_nothing():
    """Each context applies the same update to its own copy: after steps from one staged epoch (one ``batches`` call:
    each context's shard a slice of its own copy of the epoch's order) and steps each staged alone, the two contexts
    hold bit for bit the same parameters, and the two ways of staging agree bit for bit."""
    data, _ = kit.digits()
    order = datasets.epoch_order(len(data.y_train), 0, 0)[:128]
    weights = []
    for staged in (False, True):
        adapter = _adapter(2)
        if staged:
            batches = list(adapter.batches(order, 32, 0))
            assert [[i.context for i in batch] for batch in batches] == [adapter.contexts] * 4
            for position, batch in enumerate(batches):
                step = order[position * 32:(position + 1) * 32]
                for device, indices in enumerate(batch):
                    np.testing.assert_array_equal(indices.asnumpy(), shard(step, 2, device))
                adapter.train_step(batch)
        else:
            for step in range(4):
                kit.step(adapter, order[step * 32:(step + 1) * 32])
        adapter.read_loss()
        held = [_held(adapter, device) for device in range(2)]
        for name, value in held[0].items():
            np.testing.assert_array_equal(held[1][name], value, err_msg=name)
        weights.append(adapter.get_weights())
    for name, value in weights[0].items():
        np.testing.assert_array_equal(weights[1][name], value, err_msg=name)


def test_augmented_images_reach_every_context():
    """set_train_images overwrites every context's resident copy of the training images (each gathers its shard from
    its own), and the evaluation runs on the first context's test set."""
    adapter = _adapter(2)
    data, _ = kit.digits()
    augmented = datasets.augment(data.x_train, seed=0, epoch=0)
    adapter.set_train_images(augmented)
    for x, _ in adapter.inputs.train:
        np.testing.assert_array_equal(x.asnumpy(), augmented.transpose(0, 3, 1, 2))
    assert [x.context for x, _ in adapter.inputs.train] == adapter.contexts
    assert adapter.inputs.x_test.context == adapter.contexts[0] == adapter.ctx


def test_what_data_parallel_training_refuses():
    """Gradient accumulation with data parallelism, a global batch that two contexts cannot share equally, a
    multi-process trial, and devices of another kind than the trial's."""
    adapter = _adapter(2)
    with pytest.raises(ValueError, match="gradient accumulation with data parallelism is not supported"):
        kit.step(adapter, np.arange(32), micro_batches=2)
    with pytest.raises(ValueError, match="cannot be split into 2 equal per-device batches"):
        kit.step(adapter, np.arange(31))
    for parallel, device, match in (
            (DataParallel(devices=("cpu:0", "cpu:1"), processes=2), "cpu", "from one process"),
            (DataParallel(devices=("cuda:0", "cuda:1")), "cpu", "is not a cpu device"),
            (DataParallel(devices=("cpu:0", "cpu:0")), "cpu", "names a device twice")):
        refused = MXNetAdapter(RunOptions(data_parallel=parallel))
        with pytest.raises(DeviceUnavailable, match=match):
            refused.prepare(device, 1, 0)


def test_the_declaration_and_the_settings_name_the_mechanism():
    """One process drives every context (no environment to set); the settings record the contexts, the kvstore Gluon
    created, the update on every context and the batchnorm kind."""
    parallel = DECLARATION.data_parallel
    assert parallel.kind == "devices" and not parallel.environment
    assert parallel.sync_batchnorm == frozenset({"cuda"})
    assert "'device' kvstore" in parallel.mechanism
    adapter = _adapter(2)
    kit.step(adapter, np.arange(32))
    adapter.read_loss()
    assert adapter.settings().data_parallel == {
        "contexts": ["cpu(0)", "cpu(1)"], "kvstore": "device", "update_on_kvstore": False,
        "batchnorm": "BatchNorm (per device)"}
    assert _adapter(1).settings().data_parallel is None

"""TensorFlow data parallelism (``tf.distribute.MirroredStrategy`` over N = 2 logical CPU devices, one process): the
driver ``tests.adapters.data_parallel_run`` trains every run of its RUNS in one fresh interpreter, as the worker would
set it up for two devices (the two-device runs first: the first prepare splits the CPU, which TF allows only before
its runtime starts; the one-device runs then train on "/CPU:0", bit for bit as each alone in an interpreter of its
own), and in that interpreter a checks script (``CHECKS``) then builds adapters side by side; this file compares what
they saved. Starting an interpreter and importing TF is most of a run's cost, hence one interpreter for all of them.

Equivalence with one device (fp32, 10 steps of batch 32): parameters within |a - b| <= 1e-6 + 1e-5 |b| (the
comparison of tests/adapters/test_equivalence.py's accumulation test), losses within 1e-5 relative, the same
evaluation, with SGD with momentum and with Adam; N = 2 equals 2 micro-batches of 16 on one device. Observed: at most
4.2e-7 apart (SGD), 3e-8 (Adam), losses 1.2e-7 relative; N = 2 and the 2 micro-batches are bit for bit the same.
Batchnorm: each device normalises its own shard (the first step's loss is the mean of two one-device runs on the two
shards, and so are the parameters and running statistics after it); synchronised, the one-device run (within
test_equivalence.py's cross-framework tolerance, 1e-5 + 1e-5 |b|: observed 1.7e-6 at most, the conv bias before the
batchnorm, whose exact gradient is zero, being rounding noise of 1e-6 in both runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import adapters
from harness.neutral import models
from harness.plan.support import Conditions, unsupported
from harness.spec import ROOT
from tests.adapters import kit
from tests.adapters.data_parallel_run import RUNS, _model, runs_argument

#: Parameters of two runs that should train alike: |a - b| <= ATOL + RTOL |b|; with sync batchnorm the
#: cross-framework tolerance of tests/adapters/test_equivalence.py (PARAM_ATOL = PARAM_RTOL = 1e-5).
RTOL, ATOL, SYNC_ATOL = 1e-5, 1e-6, 1e-5

#: In a fresh interpreter, after the driver's runs (``sys.argv[2:]``: its ``--runs``, the two-device runs first, so the
#: first adapter's prepare splits the CPU into two logical CPUs; one-device adapters then train on /CPU:0 beside
#: them): one-device adapters on each shard of the first step next to two-device ones, with batchnorm; the adapter's
#: own facts; the compiled mode; Keras's layers (the decoder); bf16.
CHECKS = r'''
import json, sys
from tests.adapters import data_parallel_run
assert data_parallel_run.main(["tensorflow", *sys.argv[2:]]) == 0
import numpy as np
import tensorflow as tf
from adapters.base import DataParallel, RunOptions, shard
from adapters.tensorflow.adapter import TensorFlowAdapter
from harness.neutral import datasets, models
from tests.adapters import kit, scenarios
from tests.adapters.data_parallel_run import _model, refusals

data, info = kit.digits(_model(True))
plain_info = kit.digits()[1]
order = datasets.epoch_order(len(data.y_train), 0, 0)
first = order[:32]

def adapter(devices=1, sync=False, compile="default", precision="fp32", model=info, d=data, optimizer=kit.SGD):
    parallel = DataParallel(devices=("cpu:0", "cpu:1"), sync_batchnorm=sync) if devices == 2 else None
    a = TensorFlowAdapter(RunOptions(data_parallel=parallel, compile=compile, precision=precision))
    a.prepare("cpu", 1, 0)
    a.build_neutral(model, models.initial_weights(model, 0), optimizer)
    a.load(d)
    return a

def state(a):
    return {**a.get_weights(), **a.get_buffers()}

def step(a, indices):
    kit.step(a, indices)
    return a.read_loss()[0], state(a)

def listed(s):
    return {k: v.tolist() for k, v in s.items()}

out = {}
two = adapter(2)
out["logical_cpus"] = [d.name for d in tf.config.list_logical_devices("CPU")]
out["two_loss"], s = step(two, first)
out["two_state"] = listed(s)
shards = [step(adapter(), shard(first, 2, d)) for d in range(2)]
out["shard_losses"] = [loss for loss, _ in shards]
out["shard_mean_state"] = {k: ((shards[0][1][k] + shards[1][1][k]) / 2).tolist() for k in shards[0][1]}
out["whole_loss"] = step(adapter(), first)[0]
out["sync_loss"] = step(adapter(2, sync=True), first)[0]

# the copies: every parameter on both devices, the same; the running statistics per device (sync-on-read)
network = two.training.model
out["param_devices"] = [v.device for v in network.params["0.weight"][0][0].values]
out["param_copies_equal"] = all(bool(np.array_equal(*[c.numpy() for c in v.values]))
                                for v in network.trainable_variables)
statistic = network.buffers["1.running_mean"][0][0]
out["statistic_kind"] = type(statistic).__name__
out["statistic_copies"] = [c.numpy().tolist() for c in statistic.values]
out["settings"] = two.settings().record()["data_parallel"]
losses = []
for batch in two.batches(order[32:128], 32, 0):
    two.train_step(batch)
    losses.append(float(two.training.last_loss.numpy()))
out["three_losses"], out["read_three"] = losses, two.read_loss()
out["errors"] = refusals(two, order)

# the compiled mode: the CNN on 1 and 2 devices, and batchnorm per device on 2
compiled = {}
for name, devices, model in (("cnn-1", 1, plain_info), ("cnn-2", 2, plain_info), ("bn-2", 2, info)):
    a = adapter(devices, compile="compiled", model=model)
    run_losses = [step(a, order[:32])[0]]
    after_first = a.compilations()
    run_losses += [step(a, order[p * 32:(p + 1) * 32])[0] for p in range(1, 10)]
    compiled[name] = {"losses": run_losses, "state": listed(state(a)), "compilations": [after_first, a.compilations()],
                      "test": list(a.evaluate(32)), "jit": a.settings().record()["jit_compile"]}
out["compiled"] = compiled

# Keras's layers (layernorm, attention) and an embedding: the decoder, 3 Adam steps of 16
model, cfg = scenarios.BLOCK_MODELS["decoder"]
tokens = datasets.load(cfg, seed=0)
token_info = models.analyze(model, *datasets.describe_input(cfg))
token_order = datasets.epoch_order(len(tokens.y_train), 0, 0)
decoder = {}
for devices in (1, 2):
    a = adapter(devices, model=token_info, d=tokens, optimizer=scenarios.BLOCK_OPTIMIZERS["adam"])
    run_losses = [step(a, token_order[p * 16:(p + 1) * 16])[0] for p in range(3)]
    decoder[devices] = {"losses": run_losses, "state": listed(a.get_weights()), "test": list(a.evaluate(16))}
out["decoder"] = decoder

# bf16: 5 steps of the CNN on 1 and 2 devices
out["bf16"] = [[step(a, order[p * 32:(p + 1) * 32])[0] for p in range(5)]
               for a in (adapter(n, precision="bf16", model=plain_info) for n in (1, 2))]
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
'''

#: TF started (an op ran) before prepare: the CPU can no longer be split, and prepare says so.
STARTED = r'''
import tensorflow as tf
from adapters.base import DataParallel, RunOptions
from adapters.tensorflow.adapter import TensorFlowAdapter
tf.constant(1.0) + 1.0
a = TensorFlowAdapter(RunOptions(data_parallel=DataParallel(devices=("cpu:0", "cpu:1"))))
try:
    a.prepare("cpu", 1, 0)
except RuntimeError as err:
    print("ERROR:", err)
'''


def _python(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every driver run and then the checks in one interpreter, the started-first script in another beside it."""
    out_dir = tmp_path_factory.mktemp("tf_data_parallel")
    checks_path = out_dir / "checks.json"
    paths = {name: out_dir / f"{name}.npz" for name in RUNS}
    runs = runs_argument((devices, paths[name], *extra) for name, (devices, extra) in RUNS.items())

    def checks() -> dict:
        done = _python(["-c", CHECKS, str(checks_path), *runs])
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(checks_path.read_text())

    with ThreadPoolExecutor(2) as pool:
        checked = pool.submit(checks)
        started = pool.submit(_python, ["-c", STARTED])
        checked_result = checked.result()
        loaded = {}
        for name, path in paths.items():
            with np.load(path) as saved:
                loaded[name] = {k: saved[k] for k in saved.files}
        return {"runs": loaded, "checks": checked_result, "started": started.result()}


@pytest.fixture(scope="module")
def runs(outputs) -> dict[str, dict[str, np.ndarray]]:
    return outputs["runs"]


@pytest.fixture(scope="module")
def checks(outputs) -> dict:
    return outputs["checks"]


def _state(run: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[2:]: v for k, v in run.items() if k.startswith("w:")}


def _assert_state_close(ours: dict[str, np.ndarray], reference: dict[str, np.ndarray], atol: float = ATOL,
                        rtol: float = RTOL) -> None:
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(np.asarray(ours[name]), np.asarray(value), rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_devices_train_as_one(runs, optimizer):
    """N = 2 at global batch 32 gives one device's parameters, per-step losses and evaluation after 10 steps: the
    gradients all-reduced (summed) over the replicas are the global batch's mean."""
    one, two = runs[f"{optimizer}-1"], runs[f"{optimizer}-2"]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    _assert_state_close(_state(two), _state(one))
    initial = models.initial_weights(kit.digits()[1], 0)
    assert all(np.abs(two[f"w:{name}"] - value).max() > 1e-3 for name, value in initial.items())  # they trained
    np.testing.assert_allclose(two["test"][0], one["test"][0], rtol=1e-6)
    assert two["test"][1] == one["test"][1]


def test_two_devices_equal_two_micro_batches(runs):
    """The seed's claim: N = 2 at batch 32 equals one device accumulating 2 micro-batches of 16 (observed: bit for
    bit the same)."""
    _assert_state_close(_state(runs["sgd-2"]), _state(runs["accumulated-1"]))
    np.testing.assert_allclose(runs["sgd-2"]["losses"], runs["accumulated-1"]["losses"], rtol=1e-5)


def test_batchnorm_normalises_each_devices_shard(runs, checks):
    """Without sync, each replica normalises its own shard: the two-device first step's loss is the mean of the
    losses of two one-device adapters each trained on one shard (``shard(indices, 2, d)``) from the same weights,
    and not the whole batch's loss; its parameters and running statistics after that step are those two adapters'
    mean too (the gradients are averaged; each replica's running statistics come from its shard and read as their
    mean, sync-on-read)."""
    assert checks["two_loss"] == pytest.approx(np.mean(checks["shard_losses"]), rel=1e-6)
    assert abs(checks["two_loss"] - checks["whole_loss"]) > 1e-4 * abs(checks["whole_loss"])
    mean = {k: np.asarray(v) for k, v in checks["shard_mean_state"].items()}
    _assert_state_close({k: np.asarray(v) for k, v in checks["two_state"].items()}, mean)
    assert set(mean) >= {"1.running_mean", "1.running_var"}
    # each replica's copy of the running mean is its own shard's; the parameters' copies are one
    copies = np.asarray(checks["statistic_copies"])
    assert checks["statistic_kind"] == "SyncOnReadVariable" and np.abs(copies[0] - copies[1]).max() > 1e-4
    assert checks["param_copies_equal"]
    # the driver's runs: per-device batchnorm trains differently from one device from the first step
    assert abs(runs["bn-2"]["losses"][0] - runs["bn-1"]["losses"][0]) > 1e-4 * abs(runs["bn-1"]["losses"][0])


def test_sync_batchnorm_is_the_whole_batch(runs, checks):
    """Synchronised (the moments all-reduced over the replicas), the first step's loss is the whole batch's on one
    device, and 10 steps give its parameters and running statistics (within test_equivalence.py's 1e-5 + 1e-5 |b|:
    the conv bias before the batchnorm has an exact gradient of zero, so both runs hold rounding noise of 1e-6)."""
    assert checks["sync_loss"] == pytest.approx(checks["whole_loss"], rel=1e-6)
    sync, one = runs["bn-sync-2"], runs["bn-1"]
    np.testing.assert_allclose(sync["losses"], one["losses"], rtol=1e-5)
    _assert_state_close(_state(sync), _state(one), atol=SYNC_ATOL)
    np.testing.assert_allclose(sync["test"][0], one["test"][0], rtol=1e-5)


def test_compiled_mode(runs, checks):
    """The compiled mode under the strategy: each replica's forward and backward pass and its update are
    XLA-compiled functions (the step around them, with the all-reduce, is not), traced once per replica on the
    first step and never again; two devices train as one, and per-device batchnorm trains as in the eager mode."""
    compiled = checks["compiled"]
    one, two = compiled["cnn-1"], compiled["cnn-2"]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    _assert_state_close({k: np.asarray(v) for k, v in two["state"].items()},
                        {k: np.asarray(v) for k, v in one["state"].items()})
    np.testing.assert_allclose(two["test"], one["test"], rtol=1e-6)
    assert two["jit"] and two["compilations"] == [5, 5]  # the step, and the 2 functions traced for each replica
    assert one["compilations"] == [1, 1]
    bn = compiled["bn-2"]
    np.testing.assert_allclose(bn["losses"], runs["bn-2"]["losses"], rtol=1e-5)
    _assert_state_close({k: np.asarray(v) for k, v in bn["state"].items()}, _state(runs["bn-2"]), atol=SYNC_ATOL)


def test_sync_batchnorm_in_the_compiled_mode_is_a_declared_limit():
    """Sync batchnorm data-parallel in the compiled mode, with a model that has batchnorm, is refused by the plan's
    rule from the declaration (its ``Limit``), with the reason; the eager mode, per-device batchnorm, one device
    and a model without batchnorm are not."""
    record = adapters.BUILTIN["tensorflow"]
    norm, plain = kit.digits(_model(True))[1], kit.digits()[1]
    why = unsupported(record, norm, Conditions("fp32", "compiled", "cpu", 2, True))
    assert why is not None and why.startswith("the tensorflow adapter has no sync batchnorm in the compiled mode: "
                                              "the all-reduce of the batch statistics would lie inside the "
                                              "XLA-compiled forward pass of each replica")
    assert unsupported(record, norm,
                       Conditions("fp32", "default", "cuda:0", 2, True)) is None  # eager, TF's default mode
    assert unsupported(record, norm, Conditions("fp32", "compiled", "cpu", 2, False)) is None
    assert unsupported(record, norm, Conditions("fp32", "compiled", "cpu", 1, True)) is None
    assert unsupported(record, plain, Conditions("fp32", "compiled", "cpu", 2, True)) is None


def test_strategy_facts(checks):
    """Two logical CPU devices; every parameter mirrored on both; the strategy's all-reduce is CollectiveAllReduce
    (RING on CPUs); the loss sum stays on the device across steps (one read gives their mean); gradient accumulation
    and a batch that N does not divide are refused."""
    assert checks["logical_cpus"] == ["/device:CPU:0", "/device:CPU:1"]
    assert [d.rsplit("/", 1)[1] for d in checks["param_devices"]] == ["device:CPU:0", "device:CPU:1"]
    assert checks["settings"] == {"mechanism": "tf.distribute.MirroredStrategy", "world_size": 2,
                                  "devices": ["/cpu:0", "/cpu:1"], "cross_device_ops": "CollectiveAllReduce (RING)",
                                  "sync_batchnorm": False}
    mean, steps = checks["read_three"]
    assert steps == 3 and mean == pytest.approx(np.mean(checks["three_losses"]), rel=1e-6)
    assert checks["errors"]["accumulation"] == "gradient accumulation with data parallelism is not supported"
    assert "33 samples cannot be split into 2" in checks["errors"]["uneven"]


def test_keras_layers_and_embedding(checks):
    """The decoder (Keras's LayerNormalization and MultiHeadAttention, whose variables are created under the
    strategy's scope too, and an embedding, whose sparse gradient is made dense before the all-reduce): two devices
    train as one."""
    one, two = checks["decoder"]["1"], checks["decoder"]["2"]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    _assert_state_close({k: np.asarray(v) for k, v in two["state"].items()},
                        {k: np.asarray(v) for k, v in one["state"].items()})
    np.testing.assert_allclose(two["test"], one["test"], rtol=1e-6)


def test_bf16(checks):
    """bf16 (mixed precision) trains under the strategy: the first step's loss is one device's, later ones stay
    within 1 % (each replica rounds its shard's activations to bf16 as one device would, but the float32 sums of the
    gradients are taken in another order; observed 1.3e-3 after 5 steps)."""
    one, two = checks["bf16"]
    assert two[0] == pytest.approx(one[0], rel=1e-6)
    np.testing.assert_allclose(two, one, rtol=1e-2)


def test_runtime_started_before_prepare(outputs):
    """An op before prepare has started TF with one CPU device, which can no longer be split: prepare says so."""
    done = outputs["started"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cannot split the CPU into 2 logical devices: its runtime started before prepare" in done.stdout

"""JAX data parallelism (``jax.shard_map`` over a Mesh of N = 2 host devices on the CPU): the driver
``tests.adapters.data_parallel_run`` trains every run of its RUNS in envs/jax's interpreter, in one fresh process set
up as the worker would set it up for two devices (the declaration's XLA_FLAGS appended to the launcher's before JAX is
imported, one thread: OMP_NUM_THREADS=1; a one-device run trains on the first host device, bit for bit as alone in a
process without the flag), followed in that process by a checks script (starting a process and importing JAX is most
of a run's cost), and this file compares what they saved. Equivalence with one device (fp32, 10 steps): parameters,
buffers and losses within 1e-5 relative (the comparison of tests/adapters/test_equivalence.py's accumulation test:
|a - b| <= 1e-6 + 1e-5 |b|), the same evaluation; N = 2 equals 2 micro-batches on one device; batchnorm per device
(each normalises its own shard) unless synchronised (``lax.pmean`` of the moments: then the one-device run, within the
same 1e-5)."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harness.execution import environments
from harness.spec import ROOT
from tests.adapters.data_parallel_run import RUNS, runs_argument

#: A flag of the launcher's own that the data-parallel one must be appended to, not replace.
LAUNCHER_FLAG = "--xla_cpu_enable_fast_math=false"


#: In envs/jax, after the driver's runs (``sys.argv[3:]``: its ``--runs``), which set up the two host devices (the
#: launcher's XLA_FLAGS, ``sys.argv[2]``, then the declaration's appended before JAX is imported): one-device adapters
#: on each shard of the first step (``shard(indices, 2, d)``) next to a two-device one, with batchnorm; the adapter's
#: own facts (flags, mesh, compilations, refusals); bf16.
CHECKS = r'''
import json, os, sys
os.environ["XLA_FLAGS"] = sys.argv[2]
from tests.adapters import data_parallel_run
from tests.adapters.data_parallel_run import _model, refusals
assert data_parallel_run.main(["jax", *sys.argv[3:]]) == 0
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from adapters.base import DataParallel, RunOptions, shard
from adapters.jax.adapter import JaxAdapter
from adapters.jax.training import DATA
from harness.neutral import datasets, models
from tests.adapters import kit

data, info = kit.digits(_model(True))
weights = models.initial_weights(info, 0)
order = datasets.epoch_order(len(data.y_train), 0, 0)
first = order[:32]

def adapter(devices=1, precision="fp32", sync=False, model=True):
    parallel = DataParallel(devices=("cpu:0", "cpu:1"), sync_batchnorm=sync) if devices == 2 else None
    a = JaxAdapter(RunOptions(data_parallel=parallel, precision=precision))
    a.prepare("cpu", 1, 0)
    info_ = info if model else kit.digits()[1]
    a.build_neutral(info_, weights if model else models.initial_weights(info_, 0), kit.SGD)
    a.load(data)
    return a

def step(a, indices):
    kit.step(a, indices)
    return a.read_loss()[0], {**a.get_weights(), **a.get_buffers()}

out = {"xla_flags": os.environ["XLA_FLAGS"], "cpu_devices": len(jax.devices("cpu"))}
shards = [step(adapter(), shard(first, 2, d)) for d in range(2)]
out["shard_losses"] = [loss for loss, _ in shards]
out["shard_mean_state"] = {k: ((shards[0][1][k] + shards[1][1][k]) / 2).tolist() for k in shards[0][1]}
out["whole_loss"] = step(adapter(), first)[0]
two = adapter(2)
out["two_loss"], state = step(two, first)
out["two_state"] = {k: v.tolist() for k, v in state.items()}
out["sync_loss"] = step(adapter(2, sync=True), first)[0]

# the mesh: device d holds shard(indices, 2, d) of a batch sharded along DATA, as the step's indices are
mesh = two.training.mesh
placed = jax.device_put(np.asarray(first, np.int32), NamedSharding(mesh, PartitionSpec(DATA)))
out["mesh_devices"] = [str(d) for d in mesh.devices.flat]
out["placed"] = {str(s.device): np.asarray(s.data).tolist() for s in placed.addressable_shards}
out["shards"] = [shard(first, 2, d).tolist() for d in range(2)]
for batch in two.batches(order[32:128], 32, 0):
    two.train_step(batch)
out["loss_read"] = two.read_loss()
kit.step(two, order[128:160])
out["loss_read_again"] = two.read_loss()
out["compilations"] = two.compilations()
queued = np.concatenate([order[(p % 40) * 32:(p % 40 + 1) * 32] for p in range(300)])
for batch in two.batches(queued, 32, 0):  # queued without a read (see test_many_queued_steps_finish)
    two.train_step(batch)
out["queued"] = two.read_loss()
out["settings"] = {k: v for k, v in two.settings().record().items() if k in ("data_parallel", "intra_op_threads")}
out["parameter_devices"] = sorted(str(d) for d in two.training.params["0.weight"].devices())
out["evaluate_devices"] = sorted(str(d) for d in two.training.first(two.training.params)["0.weight"].devices())
out["errors"] = refusals(two, order)

# bf16 under data parallelism: 5 steps on 2 devices next to 1 (the plain CNN)
curves = []
for devices in (1, 2):
    a = adapter(devices, "bf16", model=False)
    curves.append([step(a, order[p * 32:(p + 1) * 32])[0] for p in range(5)])
out["bf16"] = curves
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
'''

#: Without the host device count (a worker that forgot it): a data-parallel prepare must say what is missing.
TOO_FEW = r'''
import json, sys
from adapters.base import DataParallel, DeviceUnavailable, RunOptions
from adapters.jax.adapter import JaxAdapter
a = JaxAdapter(RunOptions(data_parallel=DataParallel(devices=("cpu:0", "cpu:1"))))
try:
    a.prepare("cpu", 1, 0)
    message = None
except DeviceUnavailable as err:
    message = str(err)
json.dump({"message": message}, open(sys.argv[1], "w"))
'''


@pytest.fixture(scope="module")
def jax_python() -> str:
    """envs/jax (made when missing), as in tests/adapters/test_jax.py."""
    return str(environments.create("jax", ROOT / "envs")[0])


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "XLA_FLAGS": LAUNCHER_FLAG}
    env.pop("JAX_PLATFORMS", None)
    return env


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def out(jax_python, tmp_path_factory) -> dict:
    """Every driver run of RUNS (name -> its .npz as a dict) and the two scripts' JSON ("checks", "too-few"): the
    runs and then the checks in one process, the other script in another beside it."""
    folder = tmp_path_factory.mktemp("jax-dp")
    runs = runs_argument((devices, folder / f"{name}.npz", *extra) for name, (devices, extra) in RUNS.items())
    jobs = {"checks": [jax_python, "-c", CHECKS, str(folder / "checks.json"), LAUNCHER_FLAG, *runs]}
    jobs["too-few"] = [jax_python, "-c", TOO_FEW, str(folder / "too-few.json")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(_run, jobs.values()))
    result: dict = {}
    for name in RUNS:
        with np.load(folder / f"{name}.npz") as loaded:
            result[name] = dict(loaded)
    for name in ("checks", "too-few"):
        result[name] = json.loads((folder / f"{name}.json").read_text())
    return result


def _state(run: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in run.items() if k.startswith("w:")}


def _assert_same_training(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    """Every parameter and buffer within 1e-6 + 1e-5 |b| (and the same names), the losses of the 10 steps within 1e-5
    relative, the evaluation (loss, accuracy) within 1e-5 relative."""
    assert sorted(_state(ours)) == sorted(_state(theirs)) and _state(theirs)
    for name, value in _state(theirs).items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert len(theirs["losses"]) == 10
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(ours["test"], theirs["test"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_devices_train_like_one_at_the_same_global_batch(out, optimizer):
    """No batchnorm, global batch 32: N = 2 (16 a device) as N = 1, SGD with momentum and Adam (observed: 3e-7
    absolute, losses 1.2e-7 relative, the evaluation identical)."""
    _assert_same_training(out[f"{optimizer}-2"], out[f"{optimizer}-1"])
    assert not np.allclose(out[f"{optimizer}-1"]["losses"][0], out[f"{optimizer}-1"]["losses"][-1])  # it trained


def test_two_devices_equal_two_accumulated_micro_batches(out):
    """The seed's claim: one device with 2 micro-batches of 16 = two devices at a global 32."""
    _assert_same_training(out["accumulated-1"], out["sgd-2"])


def test_each_device_normalises_its_own_shard(out):
    """Batchnorm without sync: the two-device step-1 loss is the mean of the step-1 losses of one-device adapters
    each trained on one shard (``shard(indices, 2, d)``) from the same weights, and not the whole batch's loss; after
    that step (SGD, momentum's first step) the parameters are the mean of the two one-device adapters', and so are the
    running statistics (the devices' mean: the one-device running mean, the mean of the shards' variances)."""
    checks = out["checks"]
    shard_mean = float(np.mean(checks["shard_losses"]))
    for two_step_one in (out["bn-2"]["losses"][0], checks["two_loss"]):
        assert two_step_one == pytest.approx(shard_mean, rel=1e-6)
        assert abs(two_step_one / out["bn-1"]["losses"][0] - 1) > 1e-4
    assert checks["whole_loss"] == pytest.approx(out["bn-1"]["losses"][0], rel=1e-6)
    assert sorted(checks["two_state"]) == sorted(checks["shard_mean_state"])
    assert any(name.endswith("running_var") for name in checks["two_state"])
    for name, value in checks["shard_mean_state"].items():
        np.testing.assert_allclose(checks["two_state"][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.allclose(out["bn-2"]["w:0.weight"], out["bn-1"]["w:0.weight"], rtol=1e-4, atol=1e-5)


def test_synchronised_batchnorm_is_the_one_device_run(out):
    """--sync-batchnorm (the moments pmean'd over the devices, the global count in the unbiased running variance):
    the step-1 loss is the whole batch's, and parameters and running statistics after 10 steps are the one-device
    run's within the same 1e-5 (observed: 2.4e-7 absolute)."""
    assert out["bn-sync-2"]["losses"][0] == pytest.approx(out["bn-1"]["losses"][0], rel=1e-6)
    assert out["checks"]["sync_loss"] == pytest.approx(out["checks"]["whole_loss"], rel=1e-6)
    _assert_same_training(out["bn-sync-2"], out["bn-1"])


def test_the_host_device_flag_joins_the_launchers_and_the_thread_flags(out):
    """XLA_FLAGS as the worker's process has it: the launcher's flag, then the device count (appended by the driver
    as the worker must), then the adapter's one-thread flags (appended at its import); JAX sees 2 CPU devices."""
    checks = out["checks"]
    flags = checks["xla_flags"].split()
    assert flags[:3] == [LAUNCHER_FLAG, "--xla_force_host_platform_device_count=2",
                         "--xla_cpu_multi_thread_eigen=false"]
    assert checks["cpu_devices"] == 2
    assert checks["settings"]["intra_op_threads"] == 1


def test_the_mesh_places_each_devices_shard_and_evaluates_on_the_first(out):
    """The mesh is cpu:0, cpu:1 in order, and a batch sharded along its axis puts ``shard(indices, 2, d)`` on device
    d; parameters live on both, evaluation uses the first device's copy."""
    checks = out["checks"]
    assert checks["mesh_devices"] == list(checks["placed"]) == ["cpu:0", "cpu:1"]
    assert list(checks["placed"].values()) == checks["shards"]
    assert len(checks["parameter_devices"]) == 2 and len(checks["evaluate_devices"]) == 1
    assert checks["evaluate_devices"] == ["cpu:0"]
    assert checks["settings"]["data_parallel"]["evaluation"] == "the first device"


def test_one_compilation_the_loss_sum_and_the_refusals(out):
    """The data-parallel step compiles once (restarting the loss sum compiles nothing); the carried sum reads the
    mean of the steps since the read before; accumulation and a batch N does not divide are refused."""
    checks = out["checks"]
    assert checks["compilations"] == 1
    assert checks["loss_read"][1] == 3 and checks["loss_read_again"][1] == 1
    assert np.isfinite(checks["loss_read"][0])
    assert checks["errors"]["accumulation"] == "gradient accumulation with data parallelism is not supported"
    assert "cannot be split into 2 equal per-device batches" in checks["errors"]["uneven"]


def test_many_queued_steps_finish(out):
    """300 steps queued without a read finish, and the sum holds them all: the adapter keeps one data-parallel step
    in flight on host devices, since XLA's CPU client otherwise deadlocks in the all-reduce's rendezvous (2 host
    devices on 2 cores: aborted after 40 s within the first 100 queued steps)."""
    loss, steps = out["checks"]["queued"]
    assert steps == 300 and np.isfinite(loss)


def test_bf16_trains_under_data_parallelism(out):
    """bf16 on two devices follows one device's bf16 curve (16-bit operands: within 2e-2 relative over 5 steps)."""
    one, two = out["checks"]["bf16"]
    np.testing.assert_allclose(two, one, rtol=2e-2)


def test_too_few_host_devices_is_a_clear_refusal(out):
    """Without --xla_force_host_platform_device_count JAX sees one CPU device: prepare raises DeviceUnavailable and
    names the flag."""
    message = out["too-few"]["message"]
    assert message and "--xla_force_host_platform_device_count=2" in message and "cpu:1" in message

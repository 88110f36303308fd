"""Data-parallel trials through the whole harness: the spec's field and variant, the checks before anything runs (one
line, exit 2), the plan's trials, a one-process-per-device framework's ranks started and ended by its worker (the fault
adapter as ``fault_dp``: real processes, no numbers), and the report's scaling section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.plan import checked_spec, data_parallel_devices, plan, unsupported_reason
from harness.plan.support import Conditions
from harness.spec import DataParallelSpec
from tests.helpers import ROOT, base_spec, data_parallel_env, ranks_gone


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_short_forms_and_the_device_list():
    assert DataParallelSpec.model_validate(2).size == 2
    listed = DataParallelSpec.model_validate(["cuda:0", "cuda:3"])
    assert listed.size == 2 and data_parallel_devices(listed, "cuda:0") == ("cuda:0", "cuda:3")
    assert data_parallel_devices(DataParallelSpec(devices=3), "cuda:1") == ("cuda:1", "cuda:2", "cuda:3")
    assert data_parallel_devices(DataParallelSpec(devices=2), "cpu") == ("cpu:0", "cpu:1")


@pytest.mark.parametrize("changes, field, words", [
    ({"data_parallel": ["cuda:0", "cuda:0"]}, "data_parallel.devices", "cuda:0 is listed twice"),
    ({"data_parallel": ["gpu0"]}, "data_parallel.devices", "GPUs as cuda:N"),
    ({"data_parallel": 0}, "data_parallel.devices", "at least 1, not 0"),
    ({"data_parallel": 3, "batch_sizes": [32]}, "batch_sizes.0", "does not split into 3 equal per-device batches"),
    ({"variants": {"data_parallel": [1, 4]}, "batch_sizes": [8, 10]}, "batch_sizes.1",
     "(variants.data_parallel.1: 4)"),
    ({"data_parallel": 2, "accumulation_steps": 2}, "data_parallel", "not combined in one trial"),
])
def test_a_bad_data_parallel_spec_is_one_line_and_exit_2(write_spec, tmp_path, changes, field, words):
    path = write_spec(base_spec(**changes))
    proc = _cli("run", str(path), "--out", str(tmp_path / "runs"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith(f"{path}: {field}: ") and words in line, line
    assert not (tmp_path / "runs").exists()


def test_more_devices_than_the_cpu_has_is_stopped_before_anything_runs(write_spec, tmp_path):
    cores = len(os.sched_getaffinity(0))
    path = write_spec(base_spec(data_parallel=cores + 1, batch_sizes=[8 * (cores + 1)]))
    proc = _cli("run", str(path), "--out", str(tmp_path / "runs"))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"{path}: data_parallel: {cores + 1} devices on the CPU, but this process may use {cores} cores (one logical "
        "device per core at most)")
    assert not (tmp_path / "runs").exists()


def test_the_plan_crosses_devices_with_batch_sizes(tmp_path):
    spec = checked_spec(base_spec(frameworks=["pytorch"], batch_sizes=[16, 32],
                                  variants={"data_parallel": [1, 2, {"devices": 2, "sync_batchnorm": True}]}),
                        tmp_path / "s.yaml")
    trials = plan(spec, "cpu")
    assert [(t.id, t.variant, t.per_device_batch_size, t.devices, t.sync_batchnorm) for t in trials] == [
        ("pytorch-bs16-r0-v0", "1 device", 16, (), False),
        ("pytorch-bs32-r0-v0", "1 device", 32, (), False),
        ("pytorch-bs16-r0-v1-dp2", "2 devices", 8, ("cpu:0", "cpu:1"), False),
        ("pytorch-bs32-r0-v1-dp2", "2 devices", 16, ("cpu:0", "cpu:1"), False),
        ("pytorch-bs16-r0-v2-dp2", "2 devices, sync bn", 8, ("cpu:0", "cpu:1"), True),
        ("pytorch-bs32-r0-v2-dp2", "2 devices, sync bn", 16, ("cpu:0", "cpu:1"), True)]


def test_a_framework_without_data_parallelism_is_unsupported_at_plan_time(tmp_path, monkeypatch):
    import adapters
    from adapters.declaration import Declaration

    spec = checked_spec(base_spec(frameworks=["pytorch"]), tmp_path / "s.yaml")
    plain = Declaration(name="pytorch", title="PyTorch", adapter="adapters.pytorch.adapter:PyTorchAdapter")
    monkeypatch.setitem(adapters.BUILTIN, "pytorch", plain)
    assert unsupported_reason(spec, "pytorch", Conditions(data_parallel=2)) == \
        "the pytorch adapter does not train data-parallel"
    assert unsupported_reason(spec, "pytorch", Conditions(data_parallel=1)) is None


def _records(out):
    run = next(Path(out).iterdir())
    return {r["id"]: r for r in map(json.loads, (run / "trials.jsonl").read_text().splitlines())}, run


def test_ranks_run_as_processes_and_the_record_says_so(write_spec, tmp_path):
    pids, env = data_parallel_env(tmp_path)
    path = write_spec(base_spec(frameworks=["fault_dp"], batch_sizes=[16], data_parallel=2, warmup_steps=1))
    proc = _cli("run", str(path), "--out", str(tmp_path / "runs"), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records, run = _records(tmp_path / "runs")
    record = records["fault-dp-bs16-r0-dp2"]
    assert record["status"] == "ok" and record["data_parallel"] == 2 and record["per_device_batch_size"] == 8
    assert record["devices"] == ["cpu:0", "cpu:1"] and record["effective_batch_size"] == 16
    metrics = record["metrics"]
    assert metrics["data_parallel"] == 2 and metrics["data_parallelism"]["mechanism"].startswith("one numpy process")
    assert metrics["data_parallelism"]["devices"] == ["cpu:0", "cpu:1"]
    assert sorted(p.name.split("-")[0] for p in pids.iterdir()) == ["rank0", "rank1"]
    assert len({p.name.split("-")[1] for p in pids.iterdir()}) == 2  # two processes
    assert ranks_gone(list(pids.iterdir()))
    report = (run / "report.md").read_text()
    assert "## Data-parallel scaling" in report and "one numpy process per device" in report


@pytest.mark.parametrize("rank, fault, reason", [
    (1, "exit", "rank 1: exited with status 3"),
    (1, "raise", "rank 1: ValueError: injected failure"),
    (0, "raise", "ValueError: injected failure"),
    (1, "oom", "rank 1: MemoryError: injected out of memory"),
])
def test_one_failing_rank_ends_the_trial_and_the_sweep_goes_on(write_spec, tmp_path, rank, fault, reason):
    pids, env = data_parallel_env(tmp_path, HARNESS_FAULT=f"16:{fault}", HARNESS_FAULT_RANK=str(rank),
                        HARNESS_STEP_SLEEP="*:0.01")
    path = write_spec(base_spec(frameworks=["fault_dp"], batch_sizes=[16, 32], data_parallel=2, warmup_steps=1,
                                after_oom="try"))
    proc = _cli("run", str(path), "--out", str(tmp_path / "runs"), env=env)
    records, _ = _records(tmp_path / "runs")
    failed, next_one = records["fault-dp-bs16-r0-dp2"], records["fault-dp-bs32-r0-dp2"]
    assert failed["status"] == ("oom" if fault == "oom" else "error") and failed["reason"] == reason, failed["reason"]
    assert next_one["status"] == "ok" and proc.returncode == 0, proc.stderr[-2000:]
    # both trials' ranks started (a rank of the failed trial may end before it records itself) and none is left
    started = sorted(p.name.split("-")[0] for p in pids.iterdir())
    assert started.count("rank0") == 2 and started.count("rank1") >= 1, started
    assert ranks_gone(list(pids.iterdir())), "a rank outlived its trial"


def test_the_declared_environment_appends_to_flag_variables_and_sets_the_others():
    from adapters.declaration import DataParallelism

    parallel = DataParallelism(kind="devices", environment={"XLA_FLAGS": "--count={devices}", "OTHER": "{devices}"})
    assert parallel.variables(2, {"XLA_FLAGS": "--launcher", "OTHER": "9"}) == {
        "XLA_FLAGS": "--launcher --count=2", "OTHER": "2"}
    assert parallel.variables(4, {}) == {"XLA_FLAGS": "--count=4", "OTHER": "4"}


def test_flags_are_composed_from_flags_only_whatever_the_order():
    """A token that is no flag ends XLA's parsing of XLA_FLAGS (jaxlib 0.10.2): the one-thread setting's stray
    ``intra_op_parallelism_threads=1`` hid the host device count of every one-thread data-parallel JAX trial."""
    from adapters.declaration import DataParallelism, append_flags

    stray = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    assert append_flags(stray, "--xla_force_host_platform_device_count=2") == (
        "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=2")
    assert append_flags("--a=1 --b", "--a=2") == "--b --a=2"  # the last value wins, in the last place
    assert append_flags("", "") == "" and append_flags("  -- x ", "--c") == "--c"
    parallel = DataParallelism(kind="devices", environment={"XLA_FLAGS": "--count={devices}"})
    assert parallel.variables(2, {"XLA_FLAGS": stray}) == {
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false --count=2"}


@pytest.mark.slow
def test_every_framework_trains_data_parallel_at_one_thread_per_device(envs, write_spec, tmp_path):
    """``cpu_threads: 1`` with 2 devices, each framework in its envs/ interpreter and a real worker (forked or cold as
    the sweep decides): every trial trains on both devices. The suite's data-parallel comparisons use 2 threads, so
    JAX's one-thread regression (its host device count ignored) passed them all."""
    spec = write_spec(base_spec(name="dp1", frameworks=[{"name": fw, "python": python} for fw, python in envs.items()],
                                batch_sizes=[32], epochs=1, warmup_steps=1, cpu_threads=1, data_parallel=2))
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--out", str(out), "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    records = [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    assert sorted(r["framework"] for r in records) == sorted(envs)
    for r in records:
        assert r["status"] == "ok", (r["id"], r["reason"])
        assert r["data_parallel"] == 2 and r["settings"]["intra_op_threads"] == 1, r["id"]

"""The launcher with real worker processes: every way a trial can end, while the rest of the sweep finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.execution.launcher import classify, run_worker, worker_env
from harness.execution.protocol import Payload
from harness.plan import checked_spec as validate
from harness.plan import plan
from harness.results import report, store
from harness.spec import SpecError
from harness.studies.sweep import run_spec
from tests.helpers import ROOT, base_spec


@pytest.mark.serial  # a trial's timeout, timed
def test_every_status_in_one_sweep(fault_adapter, monkeypatch, tmp_path):
    # batch 8 raises, 12 runs out of memory, 16 is killed by SIGKILL, 20 segfaults, 24 exits silently, 28 hangs;
    # 32 and 64 must still finish ok.
    monkeypatch.setenv("HARNESS_FAULT", "8:raise,12:oom,16:kill,20:segv,24:exit,28:hang")
    spec = validate(base_spec(frameworks=[fault_adapter], batch_sizes=[8, 12, 16, 20, 24, 28, 32, 64],
                              timeout_s=4, warmup_steps=0, epochs=2, after_oom="try"), tmp_path / "s.yaml")
    run_dir = run_spec(spec, tmp_path / "results")
    records = {r.batch_size: r for r in store.read_trials(run_dir)}
    assert {bs: r.status for bs, r in records.items()} == {
        8: "error", 12: "oom", 16: "crashed", 20: "crashed", 24: "error", 28: "timeout", 32: "ok", 64: "ok"}
    assert records[8].reason == "ValueError: injected failure"
    assert "ValueError: injected failure" in records[8].traceback
    assert records[12].reason == "MemoryError: injected out of memory"
    assert records[16].reason.startswith("killed by SIGKILL")
    assert records[20].reason.startswith("killed by SIGSEGV")
    assert records[24].reason.startswith("the worker exited with status 3 without reporting why")
    assert records[28].reason.startswith("no exit within 4 s")
    assert 4 <= records[28].wall_s < 16
    for bs in (32, 64):
        metrics = records[bs].metrics
        assert metrics.measured_steps == 2 * (1438 // bs) and metrics.throughput_samples_per_s > 0
        assert metrics.test_accuracy > 0.5  # the numpy softmax regression learns digits
    # the report still renders, with the statuses in the failed cells
    text = report.write(run_dir).read_text()
    assert "| Fault | error | oom | crashed | crashed | error | timeout |" in text.replace("fault", "Fault")


def test_events_are_stamped_and_phases_are_ordered(fault_adapter, tmp_path):
    spec = validate(base_spec(frameworks=[fault_adapter], batch_sizes=[64], epochs=3, warmup_steps=3),
                    tmp_path / "s.yaml")
    run_dir = run_spec(spec, tmp_path / "results")
    events = store.read_events(run_dir, "fault-bs64-r0")  # typed, as the launcher kept them
    kinds = [(e.event, getattr(e, "name", None), getattr(e, "edge", None)) for e in events]
    assert kinds[:9] == [("start", None, None), ("phase", "import", "start"), ("phase", "import", "end"),
                         ("phase", "data", "start"), ("phase", "data", "end"), ("phase", "build", "start"),
                         ("phase", "build", "end"), ("ready", None, None), ("phase", "warmup", "start")]
    assert kinds.count(("phase", "train", "start")) == 3 and kinds[-1] == ("result", None, None)
    stamps = [e.t for e in events]
    assert stamps == sorted(stamps)
    record = store.read_trials(run_dir)[0]
    assert record.metrics.measured_steps == 3 * 22 - 3  # 1438 // 64 = 22 steps per epoch, 3 warm-up
    assert events[-1].metrics == record.metrics  # the result event's metrics are the record's


def test_batch_larger_than_the_dataset_is_a_clear_error(fault_adapter, tmp_path):
    spec = validate(base_spec(frameworks=[fault_adapter], batch_sizes=[4096]), tmp_path / "s.yaml")
    record = store.read_trials(run_spec(spec, tmp_path / "r"))[0]
    assert record.status == "error"
    assert record.reason == "batch size 4096 exceeds the 1438 training samples"


def test_missing_framework_is_one_line_before_anything_runs(monkeypatch, tmp_path):
    """The probe of the entry's interpreter finds it (harness.execution.environments); nothing is written."""
    monkeypatch.setenv("HARNESS_ADAPTERS", "ghost=no_such_module:Ghost")
    spec = validate(base_spec(frameworks=["ghost"]), tmp_path / "s.yaml")
    with pytest.raises(SpecError, match=r"^s\.yaml: frameworks\.0: ghost is not installed in .*No module named"):
        run_spec(spec, tmp_path / "r", "s.yaml")
    assert not (tmp_path / "r").exists()


def test_a_framework_missing_in_the_worker_is_an_error_not_a_crash(fault_adapter, monkeypatch, tmp_path):
    """Should the environment change between the probe and a trial, the worker reports it as the trial's error."""
    spec = validate(base_spec(frameworks=[fault_adapter]), tmp_path / "s.yaml")
    trial = plan(spec, "cpu")[0]
    payload = Payload(trial=trial)
    monkeypatch.setenv("HARNESS_ADAPTERS", "fault=no_such_module:Ghost")
    outcome = run_worker(payload, 60, None, "cpu", 1)
    assert outcome.status == "error" and outcome.reason.startswith("fault is not installed here")


def test_classify_without_events():
    assert classify(0, [], False, 10, "")[0] == "error"
    assert classify(-9, [], False, 10, "Killed\n") == (
        "crashed", "killed by SIGKILL (the kernel's OOM killer sends SIGKILL): Killed")
    assert classify(None, [], True, 10, "")[0] == "timeout"


def test_worker_env_sets_threads_for_every_runtime():
    env = worker_env(3, base={"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == "3"
    assert env["TF_NUM_INTEROP_THREADS"] == env["MXNET_CPU_WORKER_NTHREADS"] == "1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "OMP_NUM_THREADS" not in worker_env(None, base={"PATH": "/bin"})


def test_trials_survive_sigkill_of_the_orchestrator(fault_adapter, write_spec, tmp_path):
    """Kill `harness run` mid-sweep: every line of trials.jsonl is a whole trial, and the report still works."""
    spec = write_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[16, 32, 64, 128, 256, 512], epochs=3))
    out = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", str(spec), "--out", str(out), "--no-progress"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    deadline = time.monotonic() + 90
    trials_file = None
    while time.monotonic() < deadline:
        found = list(out.glob("*/trials.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 2:
            trials_file = found[0]
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert trials_file is not None, "no trial finished in 90 s"
    lines = trials_file.read_text().splitlines()
    assert 2 <= len(lines) < 6
    for line in lines:
        record = json.loads(line)  # whole lines only
        assert record["status"] == "ok" and record["metrics"]["throughput_samples_per_s"] > 0
    text = report.write(trials_file.parent).read_text()
    assert f"{len(lines)} of 6 trials" in text and "not finished" in text


def test_after_an_oom_larger_batch_sizes_are_skipped_unless_asked(fault_adapter, monkeypatch, tmp_path):
    monkeypatch.setenv("HARNESS_FAULT", "32:oom")
    common = dict(frameworks=[fault_adapter], batch_sizes=[16, 32, 64, 24], warmup_steps=0)
    spec = validate(base_spec(**common), tmp_path / "s.yaml")
    records = {r.batch_size: r for r in store.read_trials(run_spec(spec, tmp_path / "a"))}
    assert {bs: r.status for bs, r in records.items()} == {16: "ok", 32: "oom", 64: "skipped", 24: "ok"}
    assert records[64].reason == "not run: batch size 32 already ran out of memory (after_oom: skip)"
    spec = validate(base_spec(after_oom="try", **common), tmp_path / "s.yaml")
    statuses = {r.batch_size: r.status for r in store.read_trials(run_spec(spec, tmp_path / "b"))}
    assert statuses == {16: "ok", 32: "oom", 64: "ok", 24: "ok"}


def test_learning_rate_scaling_and_accumulation_reach_the_trial(tmp_path):
    spec = validate(base_spec(batch_sizes=[16, 64], accumulation_steps=2, learning_rate_scaling="sqrt",
                              base_batch_size=32, optimizer={"name": "sgd", "learning_rate": 0.1}), tmp_path / "s.yaml")
    trials = plan(spec, "cpu")
    assert [(t.batch_size, t.effective_batch_size) for t in trials] == [(16, 32), (64, 128)]
    assert trials[0].learning_rate == pytest.approx(0.1) and trials[1].learning_rate == pytest.approx(0.2)
    linear = validate(base_spec(batch_sizes=[128], learning_rate_scaling="linear", base_batch_size=32,
                                optimizer={"name": "sgd", "learning_rate": 0.1}), tmp_path / "s.yaml")
    assert plan(linear, "cpu")[0].learning_rate == pytest.approx(0.4)


def test_time_to_target_accuracy(fault_adapter, tmp_path):
    spec = validate(base_spec(frameworks=[fault_adapter], batch_sizes=[16], epochs=4, target_accuracy=0.5),
                    tmp_path / "s.yaml")
    record = store.read_trials(run_spec(spec, tmp_path / "r"))[0]
    reached = record.metrics.time_to_target
    first = next(e.epoch for e in record.metrics.epochs if e.test_accuracy >= 0.5)
    assert reached.epochs == first + 1 and 0 < reached.training_s <= reached.wall_s
    unreachable = validate(base_spec(frameworks=[fault_adapter], batch_sizes=[16], target_accuracy=1.0),
                           tmp_path / "s.yaml")
    assert store.read_trials(run_spec(unreachable, tmp_path / "u"))[0].metrics.time_to_target is None


def test_a_trial_stops_at_its_target_when_asked(fault_adapter, tmp_path):
    """stop_at_target (MLPerf's rule): the trial ends at the first evaluation at or above the target, its metrics
    those of the epochs it trained; without a target the spec is refused."""
    spec = validate(base_spec(frameworks=[fault_adapter], batch_sizes=[16], epochs=6, target_accuracy=0.5,
                              stop_at_target=True), tmp_path / "s.yaml")
    record = store.read_trials(run_spec(spec, tmp_path / "r"))[0]
    reached = record.metrics.time_to_target
    assert reached is not None and reached.epochs < 6
    assert [e.epoch for e in record.metrics.epochs] == list(range(reached.epochs))
    assert record.metrics.epochs[-1].test_accuracy >= 0.5 > max(
        [e.test_accuracy for e in record.metrics.epochs[:-1]], default=0.0)
    assert record.metrics.total_steps == reached.epochs * record.metrics.steps_per_epoch
    with pytest.raises(SpecError, match="stop_at_target needs target_accuracy"):
        validate(base_spec(stop_at_target=True), tmp_path / "s.yaml")


def test_each_seed_trains_from_its_own_weights_and_batches(fault_adapter, tmp_path):
    """seeds: [1, 2]: one trial per seed, each recording its seed; the batch order (the fault adapter's weights
    start at zero) and so the final loss follow the seed, while the same seed gives the same loss again."""
    spec = validate(base_spec(frameworks=[fault_adapter], seeds=[1, 2], repeats=2, epochs=1), tmp_path / "s.yaml")
    records = store.read_trials(run_spec(spec, tmp_path / "r"))
    assert [(r.id, r.seed) for r in records] == [("fault-bs32-r0-s1", 1), ("fault-bs32-r0-s2", 2),
                                                 ("fault-bs32-r1-s1", 1), ("fault-bs32-r1-s2", 2)]
    loss = {(r.repeat, r.seed): r.metrics.final_train_loss for r in records}
    assert loss[(0, 1)] == loss[(1, 1)] and loss[(0, 2)] == loss[(1, 2)]
    assert loss[(0, 1)] != loss[(0, 2)]


def test_a_worker_gets_only_its_own_frameworks_variables(tmp_path):
    """A PyTorch worker's environment holds none of the TF_, XLA_ or MXNET_ variables the harness sets for the other
    frameworks' workers (their declarations' ``Environment.variables`` and ``Environment.threads``), only the generic
    thread counts with PyTorch's own; a TensorFlow worker gets TensorFlow's. Checked on what the launcher computes
    and on a real PyTorch worker's process environment."""
    import psutil

    from harness.execution.workers import Workers
    from harness.record.events import Start

    def trial(name):
        data = base_spec(frameworks=[{"name": name, "python": str(ROOT / "envs" / name / "bin" / "python")}],
                         batch_sizes=[32], epochs=1, cpu_threads=1)
        return plan(validate(data, tmp_path / f"{name}.yaml"), "cpu")[0]

    foreign = ("TF_", "XLA_", "MXNET_")
    torch = Workers.settings(trial("pytorch"), 1)
    assert not [k for k in torch if k.startswith(foreign)], torch
    assert torch["OMP_NUM_THREADS"] == torch["MKL_NUM_THREADS"] == "1"
    assert Workers.settings(trial("tensorflow"), 2)["TF_NUM_INTRAOP_THREADS"] == "2"
    seen = {}

    def on_event(event):
        if isinstance(event, Start):
            seen.update(psutil.Process(event.pid).environ())

    outcome = run_worker(Payload(trial=trial("pytorch")), 120, None, "cpu", threads=1, on_event=on_event)
    assert outcome.status == "ok", outcome.reason
    added = {k for k in seen if k.startswith(foreign)} - set(os.environ)
    assert seen and not added, added

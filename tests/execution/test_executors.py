"""The executors as the sweep uses them (``harness.execution.executors.Executor``): a launcher that raises for one
trial gives that trial an ``error`` record with the reason and the sweep goes on, on the one default slot (the
trial runs in the calling thread) as on several (a thread per trial); Ctrl-C still stops a one-slot run; the sweep
closes only the executor it made. No worker runs: the launcher function is replaced."""

from __future__ import annotations

import json

import pytest

from harness.execution import executors
from harness.execution.executors import LocalExecutor, local_slots
from harness.execution.launcher import Outcome
from harness.execution.protocol import Payload
from harness.plan import checked_spec, plan
from harness.studies import sweep
from tests.helpers import base_spec, skip_probes


def _fake_launcher(monkeypatch, failing: str, calls: list[str], error: type[BaseException] = RuntimeError):
    """Replaces the launcher the executors call: the trial ``failing`` raises ``error``; every other one ends ok at
    once. ``calls`` gets each trial id the launcher was called for, in order."""

    def run_worker(payload, timeout_s, interval_s, device, threads=None, **kwargs):
        calls.append(payload.trial.id)
        if payload.trial.id == failing:
            raise error(f"boom in {failing}")
        return Outcome("ok", "")

    monkeypatch.setattr(executors, "run_worker", run_worker)


def _records(run_dir) -> list[dict]:
    """trials.jsonl as written, one dict per trial in the order they finished."""
    return [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines() if line.strip()]


def _run_json(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _spec(tmp_path, **changes):
    return checked_spec(base_spec(frameworks=["pytorch"], batch_sizes=[16, 32, 64], **changes), tmp_path / "s.yaml")


@pytest.mark.parametrize("slots", [None, 2], ids=["default-one-slot", "two-slots"])
def test_a_launcher_failure_is_an_error_trial_and_the_sweep_goes_on(monkeypatch, tmp_path, slots):
    skip_probes(monkeypatch)  # no interpreter probed
    calls: list[str] = []
    _fake_launcher(monkeypatch, "pytorch-bs32-r0", calls)
    spec = _spec(tmp_path)
    if slots is None:  # the sweep's own executor: one slot, each trial in the calling thread
        run_dir = sweep.run_spec(spec, tmp_path / "runs")
    else:
        with LocalExecutor(local_slots("cpu", parallel=slots, threads=1, cpus=[0, 1])) as executor:
            run_dir = sweep.run_spec(spec, tmp_path / "runs", executor=executor)
    records = {r["id"]: r for r in _records(run_dir)}
    assert sorted(calls) == sorted(records) == ["pytorch-bs16-r0", "pytorch-bs32-r0", "pytorch-bs64-r0"]
    failed = records["pytorch-bs32-r0"]
    assert failed["status"] == "error"
    assert failed["reason"] == "the launcher failed: RuntimeError: boom in pytorch-bs32-r0"
    assert records["pytorch-bs16-r0"]["status"] == records["pytorch-bs64-r0"]["status"] == "ok"
    assert _run_json(run_dir)["finished"] is not None  # the run ended, not interrupted


def test_one_slot_waits_for_a_failing_launcher_and_frees_the_slot(monkeypatch, tmp_path):
    calls: list[str] = []
    _fake_launcher(monkeypatch, "pytorch-bs16-r0", calls)
    spec = _spec(tmp_path)
    first, second = (Payload(trial=t) for t in plan(spec, "cpu")[:2])
    with LocalExecutor(local_slots("cpu")) as executor:
        assert executor.capacity == 1
        executor.submit("a", first, 60, None, 1)
        assert not executor.has_room(1) and set(executor.running) == {"a"}
        finished = executor.wait()
        assert finished.key == "a" and finished.outcome.status == "error"
        assert finished.outcome.reason == "the launcher failed: RuntimeError: boom in pytorch-bs16-r0"
        assert executor.has_room(1) and not executor.running
        executor.submit("b", second, 60, None, 1)
        assert executor.wait().outcome.status == "ok"
    assert calls == ["pytorch-bs16-r0", "pytorch-bs32-r0"]


def test_ctrl_c_in_a_one_slot_launcher_still_stops_the_run(monkeypatch, tmp_path):
    """A KeyboardInterrupt is a stop, not a failed trial: it goes through the executor to the sweep, which marks
    run.json interrupted."""
    skip_probes(monkeypatch)
    calls: list[str] = []
    _fake_launcher(monkeypatch, "pytorch-bs32-r0", calls, error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt) as stopped:
        sweep.run_spec(_spec(tmp_path), tmp_path / "runs")
    run_dir = stopped.value.run_dir
    assert [r["id"] for r in _records(run_dir)] == ["pytorch-bs16-r0"]
    assert calls == ["pytorch-bs16-r0", "pytorch-bs32-r0"]
    assert _run_json(run_dir)["interrupted"]["not_run"] == ["pytorch-bs32-r0", "pytorch-bs64-r0"]


def test_the_sweep_closes_only_the_executor_it_made(monkeypatch, tmp_path):
    skip_probes(monkeypatch)
    _fake_launcher(monkeypatch, "none", [])
    closed: list[str] = []
    monkeypatch.setattr(LocalExecutor, "close", lambda self: closed.append(self.describe()["executor"]))
    given = LocalExecutor(local_slots("cpu"))
    sweep.run_spec(_spec(tmp_path), tmp_path / "given", executor=given)
    assert closed == []  # the caller's: still open
    sweep.run_spec(_spec(tmp_path), tmp_path / "own")
    assert closed == ["local"]  # the sweep's own default executor
    with given:
        pass
    assert closed == ["local", "local"]

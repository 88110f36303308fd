"""A run stopped from outside: the worker dies with its orchestrator, whatever kills the orchestrator; SIGTERM and
SIGHUP are recorded as an interruption (run.json says what finished and what did not, the report of what finished is
written, exit 128 + the signal) and ``--resume`` finishes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.helpers import base_spec, start_run

# Batch 1 on digits is 1438 steps an epoch; at 10 ms a step the second trial would take about 30 s.
LONG = {"HARNESS_STEP_SLEEP": "1:0.01"}


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _is_worker(process: psutil.Process) -> bool:
    """A trial's worker: started cold (the bootstrap's command line), or forked from a preloaded parent (a child
    of a process running harness.execution.forkserver, whose command line it keeps)."""
    try:
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        if "harness.execution.bootstrap" in " ".join(process.cmdline()):
            return True
        parent = process.parent()
        return parent is not None and all("harness.execution.forkserver" in " ".join(p.cmdline())
                                          for p in (process, parent))
    except psutil.Error:  # it ended meanwhile
        return False


def wait_gone(process: psutil.Process, timeout: float) -> float | None:
    """Seconds until ``process`` has ended (gone, or a zombie: dead, waiting for its new parent to reap it), or None
    if it still runs after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - start
        except psutil.NoSuchProcess:
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def wait_for_worker(proc, out, finished: int, timeout: float = 90):
    """The worker of the trial after the first ``finished`` ones, once those are on disk."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [len(p.read_text().splitlines()) for p in out.glob("*/trials.jsonl")]
        workers = [p for p in _children(proc.pid) if _is_worker(p)] if proc.poll() is None else []
        if (finished == 0 or (lines and lines[0] >= finished)) and workers:
            return workers[0]
        time.sleep(0.05)
    pytest.fail(f"no worker after {finished} finished trial(s) within {timeout} s")


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_record_the_interruption_and_resume_finishes(fault_adapter, write_spec, tmp_path, signum,
                                                                         status):
    spec = write_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[16, 1], warmup_steps=0))
    out = tmp_path / "results"
    proc = start_run(spec, out, tmp_path, LONG)
    worker = wait_for_worker(proc, out, finished=1)
    time.sleep(0.5)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == status, stderr[-2000:]
    # the run waited for its worker's end before exiting (the launcher's close): gone already, not within a time
    # (how fast a worker dies with its orchestrator: test_the_worker_dies_within_a_second_of_its_orchestrator)
    assert wait_gone(worker, 0.5) is not None, "the worker outlived the run"
    assert f"interrupted by {signal.Signals(signum).name}" in stderr and "--resume" in stderr
    run_dir = next(out.iterdir())
    run = json.loads((run_dir / "run.json").read_text())
    assert run["finished"] is None
    assert run["interrupted"]["by"] == signal.Signals(signum).name
    assert run["interrupted"]["finished"] == ["fault-bs16-r0"] and run["interrupted"]["not_run"] == ["fault-bs1-r0"]
    report = (run_dir / "report.md").read_text()
    assert "1 of 2 trials" in report and f"Interrupted by {signal.Signals(signum).name}" in report

    resumed = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--resume", str(run_dir),
                              "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HARNESS_STEP_SLEEP": ""})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["finished"] and "interrupted" not in run and len(run["interruptions"]) == 1
    ids = [json.loads(line)["id"] for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    assert ids == ["fault-bs16-r0", "fault-bs1-r0"]


@pytest.mark.serial  # judges how soon the worker ends against a bound of one second
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_the_worker_dies_within_a_second_of_its_orchestrator(fault_adapter, write_spec, tmp_path, signum):
    """SIGKILL leaves the orchestrator no say: the worker sees its standard input close (and, on Linux, its parent
    die) and kills itself. SIGTERM: the orchestrator kills it on the way out."""
    spec = write_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[1], warmup_steps=0))
    proc = start_run(spec, tmp_path / "results", tmp_path, LONG)
    worker = wait_for_worker(proc, tmp_path / "results", finished=0)
    time.sleep(1.0)
    proc.send_signal(signum)
    proc.wait(timeout=30)
    seconds = wait_gone(worker, 5)
    assert seconds is not None, f"the worker outlived its orchestrator ({signal.Signals(signum).name}) by 5 s"
    assert seconds < 1.0, f"the worker ended {seconds:.2f} s after its orchestrator"


class _StuckBackend:
    """The host backend whose calls block ``seconds`` after the first (an NVML call stuck in the driver, a loaded
    machine): what a launcher that stops its sampler before it kills the worker waits for."""

    def __init__(self, seconds: float):
        from harness.measure.host import HostBackend

        self.inner, self.seconds, self.calls = HostBackend(), seconds, 0
        self.name, self.unavailable = self.inner.name, self.inner.unavailable

    def attach(self, pid):
        self.inner.attach(pid)

    def sample(self):
        self.calls += 1
        if self.calls > 1:
            time.sleep(self.seconds)
        return self.inner.sample()

    def close(self):
        self.inner.close()

    def describe(self):
        return self.inner.describe()


def _watch_gone(pid: int, started: list[float], gone: dict[str, float]) -> threading.Thread:
    """A thread that records in ``gone["at"]`` when ``pid`` has ended (time.monotonic())."""
    process = psutil.Process(pid)

    def watch():
        seconds = wait_gone(process, 30)
        gone["at"] = time.monotonic() if seconds is not None else float("inf")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.serial  # judges how soon the worker ends against a bound of one second
@pytest.mark.parametrize("worker_start", ["auto", "cold"])
def test_ctrl_c_kills_the_worker_at_once_whatever_its_sampler_is_doing(fault_adapter, monkeypatch, tmp_path,
                                                                        worker_start):
    """Ctrl-C (KeyboardInterrupt in the launcher's thread) while the sampler's backend call blocks: the worker is
    killed first, then the sampler stopped (its join may take seconds), so the worker is gone within a second."""
    from harness.execution import launcher
    from harness.execution.protocol import Payload
    from harness.plan import checked_spec, plan
    from harness.record.events import Start

    monkeypatch.setenv("HARNESS_STEP_SLEEP", "1:0.01")
    monkeypatch.setattr(launcher, "make_backend", lambda *args, **kwargs: (_StuckBackend(5.0), None))
    spec = checked_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[1], warmup_steps=0,
                                  worker_start=worker_start), tmp_path / "s.yaml")
    (trial,) = plan(spec, "cpu")
    main, sent, gone = threading.main_thread().ident, [], {}

    def on_event(event):
        if isinstance(event, Start):
            _watch_gone(event.pid, sent, gone)

            def interrupt():
                sent.append(time.monotonic())
                signal.pthread_kill(main, signal.SIGINT)

            threading.Timer(1.0, interrupt).start()

    with pytest.raises(KeyboardInterrupt):
        launcher.run_worker(Payload(trial=trial), 60, 0.05, "cpu", threads=1, on_event=on_event)
    deadline = time.monotonic() + 10
    while "at" not in gone and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent and "at" in gone
    assert gone["at"] - sent[0] < 1.0, f"the worker ended {gone['at'] - sent[0]:.2f} s after Ctrl-C"


@pytest.mark.serial  # judges how soon the workers end against a bound of one second
def test_closing_a_parallel_executor_kills_its_workers_at_once(fault_adapter, monkeypatch, tmp_path):
    """A parallel run stopped (the executor closed): each worker is killed within a second, its sampler stuck or
    not."""
    from harness.execution import launcher
    from harness.execution.executors import LocalExecutor, Slot
    from harness.execution.protocol import Payload
    from harness.plan import checked_spec, plan
    from harness.record.events import Start

    monkeypatch.setenv("HARNESS_STEP_SLEEP", "1:0.01")
    monkeypatch.setattr(launcher, "make_backend", lambda *args, **kwargs: (_StuckBackend(5.0), None))
    spec = checked_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[1], warmup_steps=0, repeats=2),
                        tmp_path / "s.yaml")
    trials = plan(spec, "cpu")
    pids: list[int] = []
    executor = LocalExecutor([Slot("cpu", "cpu", {}, None, 1), Slot("cpu", "cpu", {}, None, 1)])
    for trial in trials:
        executor.submit(trial.id, Payload(trial=trial), 60, 0.05, 1,
                        on_event=lambda e: pids.append(e.pid) if isinstance(e, Start) else None)
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 2
    time.sleep(1.0)
    gone: list[dict[str, float]] = [{}, {}]
    watchers = [_watch_gone(pid, [], into) for pid, into in zip(pids, gone)]
    started = time.monotonic()
    executor.close()
    for watcher in watchers:
        watcher.join(10)
    assert all("at" in g for g in gone)
    late = max(g["at"] for g in gone) - started
    assert late < 1.0, f"a worker ended {late:.2f} s after the executor's close"


@pytest.mark.serial  # judges how soon every process of the run ends against a bound of one second
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_every_process_of_the_run_ends_within_a_second_before_the_report(fault_adapter, write_spec, tmp_path,
                                                                          signum):
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it), SIGTERM or SIGKILL to the orchestrator while
    a forked trial trains after a finished one: the worker and the preloaded parent it forked from end within a
    second (the report of the finished trial is written after: it takes seconds)."""
    spec = write_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[16, 1], warmup_steps=0))
    out = tmp_path / "results"
    env = {**os.environ, **LONG}
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", str(spec), "--out", str(out), "--no-progress"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        worker = wait_for_worker(proc, out, finished=1)
        time.sleep(0.5)
        processes = _children(proc.pid)
        assert len(processes) >= 2, processes  # the preloaded parent and its forked worker
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        late = {p.pid: wait_gone(p, 5) for p in processes}
        report = next(out.iterdir()) / "report.md"
        assert all(seconds is not None and seconds < 1.0 for seconds in late.values()), (
            f"after {signal.Signals(signum).name}: {late} (seconds each process lived; worker {worker.pid})")
        proc.communicate(timeout=60)
        if signum != signal.SIGKILL:
            assert proc.returncode == 128 + signum and report.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

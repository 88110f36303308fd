"""A data-parallel run interrupted while a trial's ranks train (the fault adapter as ``fault_dp``: real rank
processes): SIGTERM records the interruption, every rank of the running trial is gone, and ``--resume`` runs the
interrupted trial again, with its ranks, and finishes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers import ROOT, base_spec, data_parallel_env, ranks_gone, start_run


def _ranks_started(pids, trials: int, timeout: float = 90) -> None:
    """Waits until ``trials`` trials' rank 1 processes have started (each writes its pid file in ``prepare``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(p.name.startswith("rank1-") for p in pids.iterdir()) >= trials:
            return
        time.sleep(0.05)
    raise AssertionError(f"rank 1 of trial {trials} did not start within {timeout} s: {sorted(os.listdir(pids))}")


def test_an_interrupted_data_parallel_trial_leaves_no_rank_and_resumes(write_spec, tmp_path):
    # global batch 2 is 719 steps an epoch on digits; at 10 ms a step the second trial would take about 7 s
    pids, env = data_parallel_env(tmp_path, HARNESS_STEP_SLEEP="2:0.01")
    spec = write_spec(base_spec(frameworks=["fault_dp"], batch_sizes=[16, 2], data_parallel=2, warmup_steps=0))
    out = tmp_path / "results"
    proc = start_run(spec, out, ROOT, env)
    _ranks_started(pids, trials=2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr[-2000:]
    assert ranks_gone(list(pids.iterdir()), within_s=5), "a rank outlived the interrupted run"
    run_dir = next(out.iterdir())
    run = json.loads((run_dir / "run.json").read_text())
    assert run["interrupted"]["finished"] == ["fault-dp-bs16-r0-dp2"]
    assert run["interrupted"]["not_run"] == ["fault-dp-bs2-r0-dp2"]

    before = set(pids.iterdir())
    resumed = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--resume", str(run_dir),
                              "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, **env, "HARNESS_STEP_SLEEP": ""})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    assert [(r["id"], r["status"], r["data_parallel"]) for r in records] == [
        ("fault-dp-bs16-r0-dp2", "ok", 2), ("fault-dp-bs2-r0-dp2", "ok", 2)]
    again = sorted(p.name.split("-")[0] for p in set(pids.iterdir()) - before)
    assert again == ["rank0", "rank1"], again  # only the interrupted trial ran again, with both ranks
    assert ranks_gone(list(pids.iterdir()))

"""The nightly runner's pieces on real runs: compare (a planted slowdown is caught, repeats of one run are not),
resume after the orchestrator is killed at several points, the history file, and the nightly's own spec."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from harness.plan import checked_spec as validate
from harness.results import store
from harness.studies import history
from harness.studies.compare import compare_runs
from harness.studies.sweep import run_spec
from tests.helpers import base_spec


def cli(*args, cwd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          env=env or os.environ.copy(), timeout=timeout)


@pytest.fixture
def steady(fault_adapter, monkeypatch):
    """Fault-adapter steps that take a steady 3 ms, so throughput is stable enough to compare."""
    monkeypatch.setenv("HARNESS_STEP_SLEEP", "*:0.003")
    return fault_adapter


def small_spec(framework, tmp_path, **changes):
    settings = {"name": "nightly", "frameworks": [framework], "batch_sizes": [64, 128], "epochs": 1,
                "warmup_steps": 2, "repeats": 3, **changes}
    data = base_spec(**settings)
    return validate(data, tmp_path / "nightly.yaml")


@pytest.mark.serial  # judges a planted slowdown against timing noise
def test_compare_catches_a_planted_slowdown_and_not_noise(steady, monkeypatch, tmp_path):
    # Every timed window (>= 55 ms at 6 ms a step) holds a periodic sample (50 ms apart) of the live worker, so each
    # repeat has every metric: a shorter window's only sample can come after the worker has exited (no reading).
    monkeypatch.setenv("HARNESS_STEP_SLEEP", "*:0.006")
    spec = small_spec(steady, tmp_path, sampler={"interval_s": 0.05})
    base = run_spec(spec, tmp_path / "r")
    again = run_spec(spec, tmp_path / "r")
    monkeypatch.setenv("HARNESS_STEP_SLEEP", "*:0.006,64:0.012")  # batch 64 steps take twice as long
    slow = run_spec(spec, tmp_path / "r")

    rows, summary = compare_runs(base, again, threshold_pct=10)
    assert summary["regressions"] == 0, [r for r in rows if r.verdict == "regression"]
    assert all(r.score is not None for r in rows), [r for r in rows if r.score is None]  # a noise estimate everywhere

    rows, summary = compare_runs(base, slow, threshold_pct=10)
    flagged = {(r.batch_size, r.metric) for r in rows if r.verdict == "regression"}
    assert flagged == {(64, "Throughput")}, rows
    row = next(r for r in rows if r.batch_size == 64 and r.metric == "Throughput")
    assert -60 < row.change_pct < -35 and row.score > row.needed

    proc = cli("compare", str(base), str(slow), "--threshold", "10", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "1 regression(s)" in proc.stdout
    markdown = (slow / f"compare-{base.name}.md").read_text()
    assert "| fault | 64 | Throughput |" in markdown and "**regression**" in markdown
    assert cli("compare", str(base), str(again), "--threshold", "10", cwd=tmp_path).returncode == 0


def test_compare_lists_missing_and_failed_cells(steady, monkeypatch, tmp_path):
    base = run_spec(small_spec(steady, tmp_path, repeats=1), tmp_path / "r")
    monkeypatch.setenv("HARNESS_FAULT", "128:raise")
    new = run_spec(small_spec(steady, tmp_path, repeats=1, batch_sizes=[32, 64, 128]), tmp_path / "r")
    rows, summary = compare_runs(base, new)
    verdicts = {(r.batch_size, r.verdict) for r in rows if r.metric in ("-", "Throughput")}
    assert (32, "new only") in verdicts and (128, "failed in new") in verdicts
    assert summary["missing"] == ["fault bs32: new only", "fault bs128: failed in new"]
    assert next(r for r in rows if r.batch_size == 64 and r.metric == "Throughput").noise.endswith(
        "(drift only, no repeats)")  # one repeat: no spread of its own, only the drift assumed between runs


def kill_after(proc, trials_glob, lines, out, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(out.glob(trials_glob))
        if lines == 0 and list(out.glob("*/events")):
            break  # the first worker has started
        if found and len(found[0].read_text().splitlines()) >= lines > 0:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("kill_at_lines", [0, 1, 4])
def test_resume_after_a_kill_finishes_exactly_the_plan(steady, write_spec, tmp_path, kill_at_lines):
    spec_file = write_spec(base_spec(name="nightly", frameworks=[steady], batch_sizes=[32, 64, 128], epochs=1,
                                     repeats=2, warmup_steps=1))
    out = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", str(spec_file), "--out", str(out),
                             "--no-progress"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after(proc, "*/trials.jsonl", kill_at_lines, out)
    (run_dir,) = out.iterdir()
    before = [r.id for r in store.read_trials(run_dir)]
    assert len(before) < 6
    if kill_at_lines:
        with open(run_dir / "trials.jsonl", "ab") as f:
            f.write(b'{"id": "fault-bs128-r1", "status": "o')  # a write cut short by the crash
    proc = cli("run", str(spec_file), "--resume", str(run_dir), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = [r.id for r in store.read_trials(run_dir)]
    planned = json.loads((run_dir / "run.json").read_text())["planned_trials"]
    assert sorted(after) == sorted(planned) and len(after) == len(set(after)) == 6
    assert after[:len(before)] == before  # finished trials were kept, not rerun
    for line in (run_dir / "trials.jsonl").read_text().splitlines():
        assert json.loads(line)["status"] == "ok"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["finished"] and len(run["resumed"]) == 1


def test_resume_refuses_a_different_spec(steady, write_spec, tmp_path):
    spec_file = write_spec(base_spec(name="nightly", frameworks=[steady], batch_sizes=[64], epochs=1))
    proc = cli("run", str(spec_file), "--out", str(tmp_path / "r"), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "r").iterdir()
    proc = cli("run", str(spec_file), "--resume", str(run_dir), "--epochs", "3", "--batch-sizes", "64,128",
               cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"{spec_file}: cannot resume {run_dir}: the spec differs from the one it started "
                                   f"with in batch_sizes, epochs")
    proc = cli("run", str(spec_file), "--resume", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "is not a run directory" in proc.stderr


@pytest.mark.serial  # judges a planted slowdown against timing noise
def test_history_across_three_runs(steady, monkeypatch, tmp_path):
    spec = small_spec(steady, tmp_path, repeats=1)
    history_file = tmp_path / "results" / "history.jsonl"
    runs = []
    for pause in ("0.003", "0.004", "0.006"):
        monkeypatch.setenv("HARNESS_STEP_SLEEP", f"*:{pause}")
        runs.append(run_spec(spec, tmp_path / "results"))
        history.append(history_file, runs[-1])
    history.append(history_file, runs[-1])  # the same run twice is one row
    rows = history.read(history_file)
    assert [r["run"] for r in rows] == [r.name for r in runs]
    throughput = [r["cells"]["fault/64"]["throughput"] for r in rows]
    assert throughput[0] > throughput[1] > throughput[2]  # the steps got slower run by run
    assert rows[0]["cells"]["fault/128"]["status"] == "ok" and rows[0]["spec"] == "nightly"
    proc = cli("history", "--file", str(history_file), "--metric", "throughput", "--batch-sizes", "64",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "results" / "history.throughput.png").stat().st_size > 1000
    assert cli("history", "--file", str(history_file), "--metric", "nonsense", cwd=tmp_path).returncode == 2


def test_nightly_script_sets_a_baseline_then_catches_a_regression(steady, write_spec, monkeypatch, tmp_path):
    """The script's plumbing: the first run becomes the baseline, the second, whose training is planted to learn
    nothing (its accuracy falls from ~90 % to the zero weights' ~10 %, the same in every repeat: no timing involved,
    so this test runs beside others), exits 1 and is not a baseline; the second is logged to MLflow, both to the
    history; with no GPU and without ALLOW_CPU the script exits 2. (Throughput regressions against noise:
    ``test_compare_catches_a_planted_slowdown_and_not_noise``, in the serial part.)"""
    from tests.helpers import ROOT

    spec_file = write_spec(base_spec(name="nightly", frameworks=[steady], batch_sizes=[64], epochs=1, repeats=3))
    env = {**os.environ, "PYTHON": sys.executable, "SPEC": str(spec_file), "RESULTS": str(tmp_path / "nightly"),
           "THRESHOLD": "10", "ALLOW_CPU": "1"}
    script = str(ROOT / "scripts" / "nightly-gpu.sh")
    first = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "this run becomes the baseline" in first.stdout
    baseline = (tmp_path / "nightly" / "last-good").read_text().strip()
    env["HARNESS_FAULT"] = "*:frozen"
    env["HARNESS_MLFLOW_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the nightly also logs to MLflow
    second = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    accuracy = next(line for line in second.stdout.splitlines() if "Test accuracy" in line)
    assert accuracy.rstrip(" │").endswith("regression"), second.stdout[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["HARNESS_MLFLOW_URI"])
    logged = client.search_runs([client.get_experiment_by_name("nightly").experiment_id])
    assert sorted(r.data.tags["harness.kind"] for r in logged) == ["sweep", "trial", "trial", "trial"]
    assert (tmp_path / "nightly" / "last-good").read_text().strip() == baseline  # a regression is not a baseline
    assert len(history.read(tmp_path / "nightly" / "history.jsonl")) == 2
    assert (tmp_path / "nightly" / "history.throughput.png").exists()
    no_gpu = subprocess.run(["bash", script], env={**env, "ALLOW_CPU": "0"}, capture_output=True, text=True,
                            timeout=120)
    assert no_gpu.returncode == 2 and "no GPU visible to NVML" in no_gpu.stderr


def fewest_repeats_for_noise_aware_verdicts(tmp_path):
    """The fewest repeats a cell needs for ``compare_runs`` to measure the noise of two runs itself (a repeat-to-repeat
    spread behind every throughput verdict), found by asking the rule on constructed runs of 1, 2, ... repeats."""
    import math

    from tests.helpers import repeated_run

    for repeats in range(1, 10):
        def wobble(fw, bs, r):
            return 1000.0 * math.exp(0.02 * ((r * 7919) % 5 - 2))

        base = repeated_run(tmp_path / f"base{repeats}", wobble, repeats=repeats)
        new = repeated_run(tmp_path / f"new{repeats}", wobble, repeats=repeats)
        rows, summary = compare_runs(base, new)
        throughput = [r for r in rows if r.metric == "Throughput"]
        if (summary["resolvable"].get("Throughput", {}).get("within_pct") is not None
                and all(r.score is not None and "no repeats" not in r.noise for r in throughput)):
            return repeats
    raise AssertionError("no number of repeats gave the comparison a noise estimate")


def test_the_nightly_runs_its_own_spec_with_enough_interleaved_repeats(tmp_path):
    """scripts/nightly-gpu.sh and the workflow run specs/nightly.yaml: the Ohio State model of specs/cnn.yaml on
    synthetic CIFAR-shaped data, fewer epochs, at least the repeats compare needs for noise-aware verdicts (derived
    from the rule), each repeat a pass over every cell (interleaved), within an hour by the README's Scale-out model
    (15 s fixed per trial, 1 ms per step), which the spec's comment quotes."""
    from harness import spec as spec_module
    from harness.plan import load, plan
    from tests.helpers import ROOT

    script = (ROOT / "scripts" / "nightly-gpu.sh").read_text()
    assert re.search(r"^SPEC=\$\{SPEC:-([^}]+)\}$", script, re.M).group(1) == "specs/nightly.yaml"
    workflow = (ROOT / ".github" / "workflows" / "nightly-gpu.yml").read_text()
    assert "specs/nightly.yaml" in workflow and "-cnn" not in workflow
    spec = load(ROOT / "specs" / "nightly.yaml")  # read and checked, as `harness run` does
    cnn = spec_module.load(ROOT / "specs" / "cnn.yaml")  # read only: its check wants the CIFAR-10 archive
    assert spec.model == cnn.model and spec.epochs < cnn.epochs and spec.batch_sizes == cnn.batch_sizes
    assert spec.dataset.name == "synthetic" and tuple(spec.dataset.shape) == (32, 32, 3) and spec.dataset.classes == 10
    needed = fewest_repeats_for_noise_aware_verdicts(tmp_path)
    assert needed > 1 and spec.repeats >= needed
    trials = plan(spec, "cuda:0")
    cells = {(t.framework, t.batch_size) for t in trials}
    assert len(trials) == len(cells) * spec.repeats
    per_repeat = len(cells)
    for repeat in range(spec.repeats):  # repeats are the outer loop: every cell once, then the next repeat
        block = trials[repeat * per_repeat:(repeat + 1) * per_repeat]
        assert {t.repeat for t in block} == {repeat} and {(t.framework, t.batch_size) for t in block} == cells
    minutes = sum(15 + t.epochs * (spec.dataset.size // t.batch_size) * 1e-3 for t in trials) / 60
    assert minutes <= 60
    comment = (ROOT / "specs" / "nightly.yaml").read_text()
    assert f"{len(trials)} trials" in comment and f"{minutes:.0f} min" in comment


@pytest.mark.skipif(not (__import__("tests.helpers").helpers.ROOT / "envs" / "pytorch" / "bin" / "python").exists(),
                    reason="needs envs/pytorch (make envs)")
def test_the_nightly_script_on_a_cpu_with_the_nightly_spec_made_tiny(tmp_path):
    """Two nights of the script on the CPU with specs/nightly.yaml shrunk (PyTorch only, one batch size, a small
    synthetic set, 2 repeats): the second night's comparison judges throughput against the noise (repeats and the
    drift assumed until the history has two earlier runs), not by the threshold alone."""
    import yaml

    from tests.helpers import ROOT

    data = yaml.safe_load((ROOT / "specs" / "nightly.yaml").read_text())
    data.update(batch_sizes=[128], epochs=1, warmup_steps=1, repeats=2, cpu_threads=1, timeout_s=300,
                dataset={**data["dataset"], "size": 512, "test_size": 128})
    spec_file = tmp_path / "nightly.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHON": sys.executable, "SPEC": str(spec_file), "RESULTS": str(tmp_path / "nightly"),
           "FRAMEWORKS": "pytorch", "ALLOW_CPU": "1"}
    script = str(ROOT / "scripts" / "nightly-gpu.sh")
    first = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    second = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode in (0, 1), second.stdout[-2000:] + second.stderr[-2000:]
    (markdown,) = (tmp_path / "nightly").glob("*-nightly/compare-*.md")
    text = markdown.read_text()
    assert "Without a history: between-run drift floor 5.0 % assumed" in text
    throughput = [line for line in text.splitlines() if "| Throughput |" in line]
    assert throughput and all("se, needs" in line and "threshold only" not in line for line in throughput)

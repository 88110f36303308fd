"""The main job end to end: `python -m harness run` with all three real frameworks on digits, then the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.results import store
from tests.conftest import base_spec


def run_cli(spec, tmp_path):
    """``python -m harness run SPEC`` in a subprocess; asserts exit 0 and returns (the process, its run directory)."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--out", str(out), "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return proc, run_dir


@pytest.mark.slow
def test_cli_runs_all_frameworks_and_writes_the_report(write_spec, tmp_path):
    spec = write_spec(base_spec(name="e2e", frameworks=["pytorch", "tensorflow", "mxnet"], batch_sizes=[32, 256],
                                epochs=2, warmup_steps=2))
    proc, run_dir = run_cli(spec, tmp_path)
    records = store.read_trials(run_dir)
    assert [r["id"] for r in records] == ["pytorch-bs32-r0", "tensorflow-bs32-r0", "mxnet-bs32-r0",
                                          "pytorch-bs256-r0", "tensorflow-bs256-r0", "mxnet-bs256-r0"]
    for r in records:
        assert r["status"] == "ok", (r["id"], r["reason"], r.get("log_tail", "")[-1500:])
        m = r["metrics"]
        assert m["measured_steps"] == 2 * (1438 // r["batch_size"]) - 2
        assert m["throughput"] > 0 and m["step_time_p90_s"] >= m["step_time_median_s"] > 0
        assert m["parameter_count"] == 4 * 9 + 4 + 64 * 10 + 10  # tiny CNN: conv 4x1x3x3, dense 64 -> 10
        assert r["sampler"]["backend"] == "host" and r["sampler"]["stats"]["rss_bytes"]["count"] >= 1
        assert r["versions"] and r["settings"]["intra_op_threads"] == 1
        # the framework's own count of train step graphs: TensorFlow traced its step once, in warm-up, and never in
        # the timed windows; PyTorch eager and MXNet keep no count
        expected = (1, 0) if r["framework"] == "tensorflow" else (None, None)
        assert (m["compilations_warmup"], m["recompilations"]) == expected, r["id"]
    accuracy = {r["id"]: r["metrics"]["test_accuracy"] for r in records}
    assert min(accuracy[f"{fw}-bs32-r0"] for fw in ("pytorch", "tensorflow", "mxnet")) > 0.8, accuracy
    run = json.loads((run_dir / "run.json").read_text())
    assert run["finished"] and run["device"] == "cpu" and run["spec"]["name"] == "e2e"
    report = (run_dir / "report.md").read_text()
    assert "| PyTorch CPU use % |" in report and "| MXNet accuracy after 2 epochs % |" in report
    for metric in ("throughput", "util", "memory", "accuracy", "seconds_per_epoch"):
        assert (run_dir / "plots" / f"{metric}.png").stat().st_size > 1000
    assert "samples/s" in proc.stdout and "report:" in proc.stdout


def test_augmentation_variants_through_the_cli(write_spec, tmp_path):
    """variants.augmentation [false, true] from the command line: the harness augments once per epoch, outside the
    timed windows, and the augmented images change the training. That every framework trains on the same augmented
    images (their losses agree) is tests/execution/test_input_pipeline.py's, resident and through each loader."""
    spec = write_spec(base_spec(name="aug", frameworks=["pytorch"], batch_sizes=[128], epochs=2, warmup_steps=1,
                                variants={"augmentation": [False, True]}))
    _, run_dir = run_cli(spec, tmp_path)
    records = store.read_trials(run_dir)
    assert len(records) == 2 and all(r["status"] == "ok" for r in records), [(r["id"], r["reason"]) for r in records]
    loss = {r["variant"]: r["metrics"]["final_train_loss"] for r in records}
    assert set(loss) == {"aug off", "aug on"} and abs(loss["aug on"] - loss["aug off"]) > 1e-3, loss
    augmented = next(r for r in records if r["variant"] == "aug on")
    events = (run_dir / "events" / f"{augmented['id']}.jsonl").read_text()
    assert events.count('"name": "augment"') == 4  # start and end, once per epoch, outside the timed windows

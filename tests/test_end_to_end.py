"""The main job end to end: `python -m harness run` with the four frameworks, each in its own environment, on
digits, then the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.results import store
from tests.helpers import base_spec


def run_cli(spec, tmp_path):
    """``python -m harness run SPEC`` in a subprocess; asserts exit 0 and returns (the process, its run directory)."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--out", str(out), "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return proc, run_dir


FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax")


@pytest.mark.slow
def test_cli_runs_every_framework_in_its_own_environment_and_writes_the_report(envs, write_spec, tmp_path):
    """As the main job does (specs/quick.yaml): each framework in its envs/ interpreter, PyTorch, TensorFlow and JAX
    on numpy 2, MXNet on numpy 1.26; the same model trains to the same losses and measures the same gradient norms
    (the noise scale's, issue 56), and the report says where each ran."""
    spec = write_spec(base_spec(name="e2e", frameworks=[{"name": fw, "python": f"{{root}}/envs/{fw}/bin/python"}
                                                        for fw in FRAMEWORKS], batch_sizes=[32, 256],
                                epochs=2, warmup_steps=2, gradient_noise={"micro_batches": 8, "probes": 2}))
    proc, run_dir = run_cli(spec, tmp_path)
    records = store.read_trials(run_dir)
    assert [r.id for r in records] == [f"{fw}-bs{bs}-r0" for bs in (32, 256) for fw in FRAMEWORKS]
    for r in records:
        assert r.status == "ok", (r.id, r.reason, (r.log_tail or "")[-1500:])
        m = r.metrics
        assert m.measured_steps == 2 * (1438 // r.batch_size) - 2
        assert m.throughput_samples_per_s > 0 and m.step_time_p90_s >= m.step_time_median_s > 0
        assert m.parameter_count == 4 * 9 + 4 + 64 * 10 + 10  # tiny CNN: conv 4x1x3x3, dense 64 -> 10
        assert r.sampler.backend == "host"
        # windows of at least two sampling intervals hold samples of the live worker; a shorter trial's only
        # samples may come after its exit, which are no reading (harness.measure.windows.samples_until)
        if m.measured_s >= 2 * r.sampler.interval_s:
            assert r.sampler.stat("rss_bytes", "count") >= 1, r.id
        assert r.sampler.stat("rss_bytes", "count") == 0 or r.sampler.stat("rss_bytes", "max") > 0, r.id
        assert r.versions and r.settings["intra_op_threads"] == 1
        # the framework's own count of train step compilations: TensorFlow traced and JAX compiled its step once,
        # in warm-up, and never in the timed windows; PyTorch eager and MXNet keep no count
        expected = (1, 0) if r.framework in ("tensorflow", "jax") else (None, None)
        assert (m.compilations_warmup, m.recompilations) == expected, r.id
    for bs in (32, 256):  # the same model, weights and batches: the same training, wherever it ran
        cell = [r.metrics for r in records if r.batch_size == bs]
        losses, accuracies = [m.final_train_loss for m in cell], [m.test_accuracy for m in cell]
        assert max(losses) - min(losses) < 1e-3 * max(losses), (bs, losses)
        assert max(accuracies) - min(accuracies) <= 1 / 359 + 1e-9, (bs, accuracies)  # one of 359 test images
    assert min(r.metrics.test_accuracy for r in records if r.batch_size == 32) > 0.8
    # the gradient noise scale's norms (spec gradient_noise), measured at every evaluation without changing the
    # training (the losses above are as without them): the same in every framework within 1e-3 relative
    for bs in (32, 256):
        cell = [r for r in records if r.batch_size == bs]
        for epoch in range(2):
            noise = [r.metrics.epochs[epoch].gradient_noise for r in cell]
            assert all(n.micro_batch == bs // 8 and n.batch == bs and len(n.big) == 2 for n in noise), noise
            for other in noise[1:]:
                assert other.small == pytest.approx(noise[0].small, rel=1e-3), (bs, epoch)
                assert other.big == pytest.approx(noise[0].big, rel=1e-3), (bs, epoch)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["finished"] and run["device"] == "cpu" and run["spec"]["name"] == "e2e"
    entries = {e["name"]: e for e in run["frameworks"]}
    assert all(entries[fw]["numpy"].startswith("2.") for fw in ("pytorch", "tensorflow", "jax"))
    assert entries["mxnet"]["numpy"].startswith("1.26.")
    assert entries["pytorch"]["versions"]["torch"] == "2.13.0" and entries["mxnet"]["versions"]["mxnet"] == "1.9.1"
    assert entries["jax"]["versions"]["jax"] == "0.10.2"
    assert {fw: e["executable"] for fw, e in entries.items()} == envs
    assert any(p.startswith("numpy==2.") for p in entries["pytorch"]["packages"])  # the environment's pip freeze
    assert not any(p.lower().startswith("torch==") for p in entries["mxnet"]["packages"])
    assert not any(p.startswith("harness==") for e in entries.values() for p in e["packages"])  # not installed there
    assert entries["mxnet"]["python"] == envs["mxnet"] and entries["mxnet"]["python_version"].startswith("3.")
    report = (run_dir / "report.md").read_text()
    assert "| PyTorch CPU use % |" in report and "| MXNet accuracy after 2 epochs % |" in report
    assert "## Frameworks and their environments" in report and f"`{envs['mxnet']}`" in report
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
    assert len(records) == 2 and all(r.status == "ok" for r in records), [(r.id, r.reason) for r in records]
    loss = {r.variant: r.metrics.final_train_loss for r in records}
    assert set(loss) == {"aug off", "aug on"} and abs(loss["aug on"] - loss["aug off"]) > 1e-3, loss
    augmented = next(r for r in records if r.variant == "aug on")
    events = (run_dir / "events" / f"{augmented.id}.jsonl").read_text()
    assert events.count('"name": "augment"') == 4  # start and end, once per epoch, outside the timed windows

"""benchmarks/harness_vs_loop.py and benchmarks/idiomatic_loops.py: the device (``--device``) reaches the harness's
trial, its sampler and the hand-written loop; a framework's interpreter can be replaced (``--python``); TensorFlow and
MXNet on a GPU are one-line refusals, recorded as skipped cells, with nothing imported or started for them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from benchmarks import harness_vs_loop, idiomatic_loops
from harness.record import TrialMetrics
from tests.helpers import ROOT

REFUSAL = "not supported on a GPU in this benchmark: "


def test_the_device_refusal_is_for_tensorflow_and_mxnet_on_a_gpu_only():
    for framework in ("tensorflow", "mxnet"):
        reason = idiomatic_loops.device_refusal(framework, "cuda:1")
        assert reason is not None and reason.startswith(f"{framework} {REFUSAL}") and "\n" not in reason
        assert idiomatic_loops.device_refusal(framework, "cpu") is None
    for framework in ("pytorch", "jax"):
        assert idiomatic_loops.device_refusal(framework, "cuda:0") is None
        assert idiomatic_loops.device_refusal(framework, "cpu") is None


def test_the_tensorflow_loop_on_a_gpu_is_refused_before_tensorflow_is_imported():
    # In a fresh interpreter, so that no other test's imports count: main exits with the one line, and neither
    # TensorFlow nor MXNet (nor Keras) was imported on the way.
    code = ("import sys\nfrom benchmarks import idiomatic_loops\n"
            "try:\n    idiomatic_loops.main(['--framework', 'tensorflow', '--device', 'cuda:0', '--batch-size', '64', "
            "'--epochs', '1'])\nexcept SystemExit as end:\n    print('EXIT', end.code)\n"
            "print('IMPORTED', sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'mxnet')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(f"EXIT idiomatic_loops: tensorflow {REFUSAL}"), proc.stdout
    assert lines[-1] == "IMPORTED []", proc.stdout


class _Outcome:
    """What harness_vs_loop reads of run_worker's Outcome."""

    status, reason, wall_seconds = "error", "fake worker", 0.0

    def result(self):
        return None


@pytest.mark.parametrize("threads", [None, 3])
def test_a_cuda_device_reaches_the_trial_the_sampler_and_the_loop(threads, tmp_path, monkeypatch):
    """No GPU needed: run_worker and the loop's subprocess are stand-ins that record what they were given. Threads
    on a GPU: --cpu-threads, else every available CPU (not specs/quick.yaml's one), for both sides."""
    workers, loops = [], []

    def fake_run_worker(payload, timeout_s, interval_s, device, threads, *rest, **options):
        workers.append(SimpleNamespace(payload=payload, interval_s=interval_s, device=device, threads=threads))
        return _Outcome()

    def fake_run(argv, **options):
        loops.append(SimpleNamespace(argv=argv, env=options["env"]))
        out = {"variants": {"jit": {"test_accuracy": 0.5, "timed_steps": 3, "throughput": 100.0}}, "best": "jit",
               "throughput": 100.0, "device": argv[argv.index("--device") + 1]}
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(harness_vs_loop, "run_worker", fake_run_worker)
    monkeypatch.setattr(harness_vs_loop.subprocess, "run", fake_run)
    out = tmp_path / "hvl.json"
    assert harness_vs_loop.main(["--device", "cuda:0", "--frameworks", "jax,tensorflow", "--batch-sizes", "64",
                                 "--repeats", "1", "--epochs", "1", "--python", "jax=python3",
                                 "--out", str(out), *(["--cpu-threads", str(threads)] if threads else [])]) == 0
    threads = threads or harness_vs_loop.available_cpus()

    (worker,) = workers  # jax only: nothing starts for the refused tensorflow cell
    trial = worker.payload.trial
    assert (worker.device, trial.device, worker.payload.trial.device) == ("cuda:0", "cuda:0", "cuda:0")
    assert trial.framework == "jax" and trial.python == "python3" and trial.command is None
    assert worker.threads == trial.threads == threads and worker.interval_s == 0.1  # specs/quick.yaml's sampler
    (loop,) = loops
    assert loop.argv[0] == "python3" and loop.argv[1:4] == ["-m", "benchmarks.idiomatic_loops", "--framework"]
    assert loop.argv[loop.argv.index("--device") + 1] == "cuda:0"
    assert loop.argv[loop.argv.index("--threads") + 1] == str(threads)
    # the worker's environment (worker_settings of the trial's threads), nothing CPU-only forced on a GPU run
    assert loop.env["OMP_NUM_THREADS"] == str(threads) and loop.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert loop.env.get("JAX_PLATFORMS") == os.environ.get("JAX_PLATFORMS")
    assert loop.env.get("XLA_FLAGS") == os.environ.get("XLA_FLAGS")

    data = json.loads(out.read_text())
    assert data["device"] == "cuda:0" and data["pythons"] == {"jax": "python3"} and data["threads"] == threads
    rows = {row["framework"]: row for row in data["summary"]}
    assert rows["tensorflow"]["skipped"].startswith(f"tensorflow {REFUSAL}") and rows["tensorflow"]["repeats"] == 0
    assert "skipped" not in rows["jax"] and rows["jax"]["failures"] == ["harness error: fake worker"]
    (jax_run,) = [r for r in data["runs"] if r["framework"] == "jax"]
    assert jax_run["harness"]["device"] == "cuda:0" and jax_run["loop"]["device"] == "cuda:0"


class _Measured:
    """An ok Outcome whose trial ran at ``throughput`` samples/s."""

    status, reason, wall_seconds = "ok", "", 1.0

    def __init__(self, throughput):
        self.metrics = TrialMetrics(throughput_samples_per_s=throughput, measured_steps=10, test_accuracy=0.5)

    def result(self):
        return self


def test_harness_variants_run_beside_the_loop_in_rotating_order(tmp_path, monkeypatch):
    """--harness unsampled,sampled,unsampled-cold: each repeat runs the three trials and the loop, in an order that
    rotates; each trial gets its sampler (or none) and its worker start; the ratios are paired within a repeat."""
    speeds = {(None, "auto"): 100.0, (0.1, "auto"): 90.0, (None, "cold"): 80.0}  # the fake trials' samples/s
    workers, order = [], []

    def fake_run_worker(payload, timeout_s, interval_s, device, threads, *rest, **options):
        key = (interval_s, payload.trial.worker_start)
        workers.append(key)
        order.append(key)
        return _Measured(speeds[key] * (1 + len(workers) / 100))  # drifts: only paired ratios stay exact

    def fake_run(argv, **options):
        order.append("loop")
        out = {"variants": {"jit": {"test_accuracy": 0.5, "timed_steps": 3, "throughput": 50.0}}, "best": "jit",
               "throughput": 50.0, "device": "cpu"}
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(harness_vs_loop, "run_worker", fake_run_worker)
    monkeypatch.setattr(harness_vs_loop.subprocess, "run", fake_run)
    out = tmp_path / "hvl.json"
    variants = ["unsampled", "sampled", "unsampled-cold"]
    assert harness_vs_loop.main(["--frameworks", "jax", "--batch-sizes", "64", "--repeats", "4", "--epochs", "1",
                                 "--harness", ",".join(variants), "--out", str(out)]) == 0
    assert set(workers) == set(speeds) and len(workers) == 12
    assert len({str(order[i * 4]) for i in range(4)}) == 4  # each of the four sides went first once

    data = json.loads(out.read_text())
    assert data["harness_variants"] == variants and data["sampler"] is False
    sides = [*variants, "loop"]
    for run in data["runs"]:
        assert run["order"] == sides[run["repeat"]:] + sides[:run["repeat"]]  # one cell: shifted by the repeat
        assert run["harness"] == run["variants"]["unsampled"] and run["ratio"] == run["ratios"]["unsampled"]
        assert run["variants"]["sampled"]["sampler_interval_s"] == 0.1
        assert run["variants"]["unsampled-cold"]["start"] == "cold"
        assert run["variants"]["unsampled"]["sampler_interval_s"] is None
    rows = {row["variant"]: row for row in data["variant_summary"]}
    assert set(rows) == set(variants) and all(row["repeats"] == 4 for row in rows.values())
    for name, key in zip(variants, speeds):
        # the drift of one trial to the next is at most 12 %: the paired ratio stays near the speeds' ratio
        assert rows[name]["reference_ratio_median"] == pytest.approx(speeds[key] / 100.0, rel=0.05)
        assert rows[name]["loop_ratio_median"] == pytest.approx(speeds[key] / 50.0, rel=0.12)
    assert rows["unsampled"]["reference_ratio_min"] == rows["unsampled"]["reference_ratio_max"] == 1.0
    # gpu-check's summary.md shows the same rows
    lines = _gpu_check().harness_vs_loop_lines(data)
    assert len(lines) == 3 + len(variants) and lines[3].startswith("| jax | 64 | unsampled | ")
    assert lines[4].split(" | ")[3] == f"{rows['sampled']['loop_ratio_median']:.3f}"
    (main_row,) = data["summary"]  # a run with one harness trial: its main table's row
    assert _gpu_check().harness_vs_loop_lines({**data, "variant_summary": []})[3].startswith(
        f"| jax | 64 | unsampled | {main_row['ratio_median']:.3f} | ")
    # and the step table's detail is one line without a table's bars (the fourth GPU run's cell held six table rows)
    detail = _gpu_check().harness_vs_loop_detail(data)
    assert detail == (f"harness / loop: jax 64 {main_row['ratio_median']:.3f} "
                      f"({main_row['ratio_min']:.3f}..{main_row['ratio_max']:.3f})")


def _gpu_check():
    """scripts/gpu_check.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [["--harness", "sampled,fast"], ["--harness", "sampled,sampled"],
                                  ["--harness", "sampled", "--no-sampler"]])
def test_a_bad_harness_variant_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as end:
        harness_vs_loop.main([*argv, "--frameworks", "jax"])
    assert end.value.code == 2
    assert "--harness" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--device", "gpu"], ["--device", "cuda:x"], ["--python", "jax"],
                                  ["--python", "caffe=python3"], ["--cpu-threads", "0"]])
def test_a_bad_device_or_python_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as end:
        harness_vs_loop.main([*argv, "--frameworks", "jax"])
    assert end.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_device_cpu_reaches_a_real_trial_and_loop(envs, tmp_path):
    """One real JAX cell on the CPU, tiny (one epoch at batch 64, one repeat, no sampler): both sides say cpu, in the
    interpreter --python names."""
    out = tmp_path / "hvl.json"
    proc = subprocess.run([sys.executable, "benchmarks/harness_vs_loop.py", "--device", "cpu", "--frameworks", "jax",
                           "--batch-sizes", "64", "--repeats", "1", "--epochs", "1", "--no-sampler",
                           "--python", f"jax={envs['jax']}", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["pythons"] == {"jax": envs["jax"]} and data["threads"] == 1  # the spec's
    (run,) = data["runs"]
    harness, loop = run["harness"], run["loop"]
    assert harness["status"] == "ok" and loop["status"] == "ok", (harness["reason"], loop["reason"])
    assert harness["device"] == harness["trial"]["device"] == "cpu" and harness["python"] == [envs["jax"]]
    assert loop["device"] == "cpu" and loop["versions"]["platform"] == "cpu" and loop["python"] == [envs["jax"]]
    assert harness["test_accuracy"] == pytest.approx(loop["test_accuracy"], abs=0.02)  # the same model and batches
    assert "| jax | 64 | 1 |" in proc.stdout and "device cpu" in proc.stdout

"""scripts/gpu-check.sh, proven on the CPU before it meets a GPU: --allow-cpu runs every step with tiny sizes (the
entries in this test's interpreters), writes summary.json, summary.md, env.json and the run's reports, and a failing
step leaves the others running."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

KERAS_JAX = ROOT / "envs" / "keras-jax" / "bin" / "python"


def gpu_check(out, *args, timeout=400):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--python", sys.executable, "--allow-cpu",
                           "--out", str(out), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_gpu_check_with_allow_cpu_runs_every_step_and_leaves_a_summary_and_a_report(tmp_path):
    if not KERAS_JAX.exists():
        pytest.fail("envs/keras-jax is missing: make envs")
    wheels = tmp_path / "wheels"  # every requirement is already installed: pip needs no wheel for it
    wheels.mkdir()
    # PyTorch in this test's interpreter, Keras on JAX in its own environment (--entry-python): the GPU run's
    # second framework, JAX, takes the same paths as PyTorch in the check itself, and costs a minute more here
    done = gpu_check(tmp_path / "out", "--wheels", str(wheels), "--frameworks", "pytorch",
                     "--keras", "keras-jax", "--entry-python", f"keras-jax={KERAS_JAX}")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    steps = summary["steps"]
    assert done.returncode == 0, (done.stderr[-3000:], summary)
    assert list(steps) == ["install", "environment", "gpu_tests", "fork_check", "sweep", "max_batch",
                           "harness_vs_loop", "step_host_costs", "sampler_blocks", "advise", "sampler_overhead",
                           "sweep_keras"]
    assert steps["harness_vs_loop"]["status"] == "not run"  # tests/test_harness_vs_loop.py runs it on the CPU
    # every framework's worker forked from its preloaded parent and trained, so the sweep forks too
    assert steps["fork_check"]["status"] == "ok"
    assert [(t["label"], t["start"]) for t in steps["fork_check"]["trials"]] == [("pytorch", "forked")]
    assert steps["install"]["status"] == "ok" and steps["environment"]["status"] == "ok"
    assert steps["gpu_tests"]["status"] == "not run" and steps["gpu_tests"]["collected"] >= 4  # never a pass
    sweep = steps["sweep"]
    assert sweep["status"] == "ok" and sweep["trials"] == sweep["ok"] == 1  # 1 framework x 1 batch size
    assert [c["label"] for c in sweep["cells"]] == ["pytorch"]
    assert all(c["throughput"] > 0 for c in sweep["cells"])
    assert [p.rsplit("/", 1)[1] for p in sweep["reports"]] == ["report.md", "report.html"]
    found = steps["max_batch"]["results"]["pytorch"]
    assert found["limit"] and found["limit_ok_in_probes"] >= 2
    costs = steps["step_host_costs"]
    assert costs["status"] == "ok" and costs["costs"]["pytorch"]["batches_before_us_per_step"] > 0
    (blocks,) = steps["sampler_blocks"]["results"]  # 2 pairs of blocks, one sampled in each
    assert steps["sampler_blocks"]["status"] == "ok" and blocks["framework"] == "pytorch" and blocks["pairs"] == 2
    assert blocks["backend"] == "host" and blocks["samples_per_block"] >= 1
    advise = steps["advise"]  # throughput and the noise scale answered; energy has no counter on the CPU
    assert advise["status"] == "ok" and advise["answers"]["pytorch"]["throughput"]["batch_size"] == 64
    assert advise["noise"]["pytorch"]["b_simple"] > 0 and advise["noise"]["pytorch"]["batch"] == 64
    assert "energy counter" in advise["answers"]["pytorch"]["energy"]["reason"]
    assert "| advise | B_simple" in (tmp_path / "out" / "summary.md").read_text()
    cells = steps["sampler_overhead"]["cells"]
    assert {c["framework"] for c in cells} == {"pytorch"} and all(c["ratios"] for c in cells)
    assert json.loads((tmp_path / "out" / "env.json").read_text())["python"]
    assert "| sweep | ok |" in (tmp_path / "out" / "summary.md").read_text()
    spec = json.loads((tmp_path / "out" / "gpu-check.yaml").read_text())
    assert spec["frameworks"] == [{"name": "pytorch", "python": sys.executable}]
    assert spec["worker_start"] == "auto"
    keras = steps["sweep_keras"]
    assert keras["status"] == "ok" and [c["label"] for c in keras["cells"]] == ["keras-jax"]
    assert json.loads((tmp_path / "out" / "sweep_keras.yaml").read_text())["frameworks"] == [
        {"name": "keras", "backend": "jax", "label": "keras-jax", "python": str(KERAS_JAX)}]
    assert "| keras-jax | 16 | 0 | ok |" in (tmp_path / "out" / "summary.md").read_text()


def test_a_failing_step_leaves_the_others_running_and_the_check_exits_1(tmp_path):
    done = gpu_check(tmp_path, "--frameworks", "nosuch", timeout=200)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 1
    statuses = {name: step["status"] for name, step in summary["steps"].items()}
    assert statuses == {"install": "ok", "environment": "ok", "gpu_tests": "not run", "fork_check": "failed",
                        "sweep": "failed", "max_batch": "failed", "harness_vs_loop": "not run",
                        "step_host_costs": "failed", "sampler_blocks": "failed", "advise": "failed",
                        "sampler_overhead": "failed"}
    assert summary["failed"] == ["fork_check", "sweep", "max_batch", "step_host_costs", "sampler_blocks", "advise",
                                 "sampler_overhead"]
    assert "nosuch" in summary["steps"]["sweep"]["reason"]


def test_steps_choose_what_runs_and_an_unknown_step_is_refused(tmp_path):
    """--steps runs only the steps named (a second call on a warm GPU machine runs what the first had no time for);
    an unknown name exits 2 before anything runs."""
    done = gpu_check(tmp_path / "bad", "--steps", "sweep,nosuch", timeout=60)
    assert done.returncode == 2 and "--steps: unknown nosuch" in done.stderr
    assert not (tmp_path / "bad" / "summary.json").exists()
    done = gpu_check(tmp_path / "out", "--frameworks", "nosuch", "--steps", "max_batch,harness_vs_loop",
                     "--harness-vs-loop-args", "--no-sampler --batch-sizes 512", timeout=200)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert done.returncode == 1
    assert list(summary["steps"]) == ["install", "environment", "max_batch", "harness_vs_loop"]
    # the benchmark's own arguments last, so that a later --batch-sizes wins (argparse keeps the last)
    assert summary["steps"]["harness_vs_loop"]["argv"][-3:] == ["--no-sampler", "--batch-sizes", "512"]
    assert "nosuch" in summary["steps"]["max_batch"]["reason"]
    assert json.loads((tmp_path / "out" / "gpu-check.yaml").read_text())["frameworks"][0]["name"] == "nosuch"



JAX = ROOT / "envs" / "jax" / "bin" / "python"


@pytest.mark.slow
def test_step_host_costs_runs_each_framework_in_its_entry_python(tmp_path):
    """JAX is not in this test's interpreter, only in envs/jax: the step must run JAX's benchmark there, as every
    other step honours --entry-python (the fourth GPU run's rehearsal failed on "No module named 'jax'")."""
    if not JAX.exists():
        pytest.fail("envs/jax is missing: make envs")
    done = gpu_check(tmp_path / "out", "--frameworks", "pytorch,jax", "--entry-python", f"jax={JAX}",
                     "--steps", "step_host_costs", timeout=300)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    costs = summary["steps"]["step_host_costs"]
    assert done.returncode == 0 and costs["status"] == "ok", (done.stderr[-3000:], costs)
    assert costs["costs"]["pytorch"]["batches_before_us_per_step"] > 0
    assert costs["costs"]["jax"]["batches_before_us_per_step"] > 0
    assert costs["costs"]["device"] == "cpu" and costs["costs"]["batch_size"] == 64
    log = (tmp_path / "out" / "logs" / "step_host_costs.log").read_text()
    assert f"$ {JAX} benchmarks/step_host_costs.py" in log

"""The README's two commands on a GPU machine: which builds ``envs create`` chooses, a framework that cannot use the
spec's GPU stopped before anything runs, and a run in which nothing succeeded exits non-zero. The GPU machine is
simulated at the hardware boundary only: a fake ``pynvml`` (tests/fakes/site) reporting one H100, with the real
CPU-only framework builds of envs/ behind it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import cli
from harness.execution import environments, probes
from tests.helpers import ROOT, base_spec

FAKE_SITE = ROOT / "tests" / "fakes" / "site"
H100 = {"available": True, "devices": [{"index": 0, "name": "NVIDIA H100 80GB HBM3"}]}
NO_GPU = {"available": False, "reason": "NVMLError_LibraryNotFound: NVML Shared Library Not Found"}


def harness(*args, gpu=True, cwd=ROOT, timeout=240):
    """``python -m harness ARGS`` in a fresh interpreter; with ``gpu`` NVML (the fake) reports one H100."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_SITE), str(ROOT)] if gpu else [str(ROOT)])}
    if not gpu:
        env["HARNESS_FAKE_NVML_NAME"] = "unused"
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line(stderr):
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("forced, info, gpu", [(None, H100, True), (None, NO_GPU, False), ("cpu", H100, False),
                                               ("gpu", NO_GPU, True)])
def test_envs_create_builds_cuda_requirements_when_nvml_sees_a_gpu(forced, info, gpu):
    chosen, why = environments.choose_build(gpu=forced == "gpu", cpu=forced == "cpu", gpu_info=info)
    assert chosen is gpu
    assert (f"--{forced} given" == why) if forced else ("NVIDIA H100" in why if gpu else "no NVIDIA GPU" in why)


def test_the_stamp_records_the_build_and_a_switch_remakes_the_environment(tmp_path):
    env = tmp_path / "pytorch"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    cpu_file = environments.requirements_file("pytorch", gpu=False)
    (env / ".harness-stamp").write_text(f"{environments._stamp(cpu_file)}\nrequirements/pytorch-cpu.txt (CPU builds)\n")
    assert "up to date" in environments.plan_create("pytorch", tmp_path, gpu=False)
    again = environments.plan_create("pytorch", tmp_path, gpu=True)
    assert "would remake" in again and "pytorch-gpu.txt" in again and "made from requirements/pytorch-cpu.txt" in again
    assert "would create" in environments.plan_create("pytorch", tmp_path / "none", gpu=True)


def test_dry_run_on_a_simulated_gpu_machine_says_it_would_build_the_gpu_requirements(tmp_path):
    done = harness("envs", "create", "--dry-run", "--dir", str(tmp_path), "pytorch", "jax")
    assert done.returncode == 0, done.stderr
    assert "CUDA builds" in done.stderr and "NVML sees 1 NVIDIA GPU(s) (NVIDIA H100 80GB HBM3)" in done.stderr
    assert "would create" in done.stdout and "requirements/pytorch-gpu.txt" in done.stdout
    assert "requirements/jax-gpu.txt" in done.stdout
    assert not any(tmp_path.iterdir())  # nothing made
    forced = harness("envs", "create", "--dry-run", "--cpu", "--dir", str(tmp_path), "pytorch")
    assert "requirements/pytorch-cpu.txt" in forced.stdout and "--cpu given" in forced.stderr


def test_quick_spec_on_a_simulated_gpu_machine_with_cpu_environments_exits_2_before_anything_runs(tmp_path):
    pytest.importorskip("yaml")
    if not (ROOT / "envs" / "pytorch" / "bin" / "python").exists():
        pytest.fail("envs/pytorch is missing: make envs")
    out = tmp_path / "results"
    done = harness("run", "specs/quick.yaml", "--frameworks", "pytorch", "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done.stderr)
    assert line.startswith("specs/quick.yaml: frameworks.0: pytorch in ") and "cannot use cuda:0" in line
    assert "CPU-only build" in line and "`harness envs create --gpu pytorch`" in line
    assert not out.exists()  # nothing written
    mb = harness("max-batch", "specs/max_batch.yaml", "--framework", "pytorch", "--device", "cuda:0", "--out",
                 str(out))
    assert mb.returncode == 2 and "`harness envs create --gpu pytorch`" in one_line(mb.stderr)
    assert not out.exists()


def test_an_interpreter_outside_envs_is_told_to_install_the_cuda_build():
    from harness.spec import FrameworkEntry

    assert "`harness envs create --gpu jax`" in probes.gpu_fix(
        FrameworkEntry(name="jax", python=str(ROOT / "envs" / "jax" / "bin" / "python")))
    assert probes.gpu_fix(FrameworkEntry(name="jax", python="python3")) == \
        "install the CUDA build of requirements/jax-gpu.txt in that interpreter"


@pytest.mark.parametrize("faults, code", [("16:raise,32:raise", 3), ("16:raise", 0), ("16:oom,32:oom", 0)])
def test_a_run_with_no_trial_ok_and_one_failed_exits_3(fault_adapter, write_spec, tmp_path, monkeypatch, capsys,
                                                       faults, code):
    """Exit 3 only when nothing ended ok and something failed; one ok trial, or nothing but OOMs (results), is 0."""
    monkeypatch.setenv("HARNESS_FAULT", faults)
    spec = write_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[16, 32], epochs=1, after_oom="try"))
    assert cli.main(["run", str(spec), "--out", str(tmp_path / "runs"), "--no-progress"]) == code
    err = capsys.readouterr().err
    assert ("no trial ended ok (error): exit 3" in err) is bool(code)

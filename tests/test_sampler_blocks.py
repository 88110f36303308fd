"""benchmarks/sampler_blocks.py: the sampler on and off in alternate blocks of one training process. The pairs' order
and arithmetic, the verdict against the goal, and a real run on the CPU (the PyTorch environment trains, the
harness's psutil sampler watches it in this process during the sampled blocks only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import sampler_blocks
from tests.helpers import ROOT


def test_blocks_come_in_abba_pairs_after_one_unrecorded_pair():
    blocks = sampler_blocks.order(4)
    assert blocks[:2] == [True, False]
    pairs = [blocks[i:i + 2] for i in range(2, len(blocks), 2)]
    assert pairs == [[True, False], [False, True], [True, False], [False, True]]


def test_each_pair_gives_sampled_over_unsampled_throughput_and_the_first_pair_is_left_out():
    # unsampled blocks take 1.0 s; the sampled one of pair k takes 1 + k/100 s; the unrecorded pair (5 s and 3 s)
    # would move every figure below if it counted
    blocks = [{"sampled": True, "seconds": 5.0, "wall_s": 5.0, "samples": 50, "call_s": 0.001, "busy_s": 0.05},
              {"sampled": False, "seconds": 3.0, "wall_s": 3.0}]
    for k, sampled_first in enumerate(sampler_blocks.order(5)[2::2]):
        sampled = {"sampled": True, "seconds": 1 + (k + 1) / 100, "wall_s": 1.0, "samples": 10, "call_s": 0.002,
                   "busy_s": 0.02}
        plain = {"sampled": False, "seconds": 1.0, "wall_s": 1.0}
        blocks += [sampled, plain] if sampled_first else [plain, sampled]
    summary = sampler_blocks.summarize(blocks, steps=100)
    expected = [1 / (1 + k / 100) for k in range(1, 6)]
    assert summary["pairs"] == 5 and summary["ratios"] == pytest.approx(expected)
    assert summary["ratio_median"] == pytest.approx(expected[2]) and summary["ratio_min"] == pytest.approx(expected[4])
    low, high = summary["ci95"]
    assert expected[4] <= low <= summary["ratio_median"] <= high <= expected[0]
    assert summary["verdict"] == "not met"  # every pair at least 1 % slower: the interval is below 0.995
    assert summary["samples_per_block"] == 10 and summary["call_ms"] == pytest.approx(2.0)
    assert summary["busy_percent"] == pytest.approx(2.0) and summary["unsampled_step_us"] == pytest.approx(1e4)


@pytest.mark.parametrize(("low", "high", "verdict"), [(0.996, 1.01, "met"), (0.99, 0.994, "not met"),
                                                      (0.99, 1.01, "inconclusive"), (0.995, 0.999, "met")])
def test_the_verdict_is_what_the_interval_says_of_the_goal(low, high, verdict):
    assert sampler_blocks.verdict(low, high) == verdict


def test_a_real_run_samples_the_training_process_in_its_sampled_blocks_only(envs, tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/sampler_blocks.py", "--frameworks", "pytorch", "--pairs", "2",
                           "--block-seconds", "0.3", "--min-steps", "2", "--warmup-steps", "2", "--batch-size", "64",
                           "--interval", "0.05", "--python", f"pytorch={envs['pytorch']}", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "sampler_blocks.json").read_text(encoding="utf-8"))
    (result,) = data["results"]
    assert result["backend"] == "host" and result["pairs"] == 2 and data["threads"] == 1  # quick.yaml's
    blocks = result["blocks"]
    assert [b["sampled"] for b in blocks] == sampler_blocks.order(2)
    assert all(b["seconds"] > 0 and b["wall_s"] >= b["seconds"] for b in blocks)
    # a block of about 0.3 s at 50 ms: the sampler's first sample at its start, then one every interval
    assert all(b["samples"] >= 2 and not b["errors"] for b in blocks if b["sampled"])
    assert all("samples" not in b for b in blocks if not b["sampled"])
    assert "| pytorch | host (50 ms) |" in proc.stdout


@pytest.mark.parametrize("argv", [["--python", "jax"], ["--python", "mxnet=python3"], ["--frameworks", "mxnet"]])
def test_a_bad_python_or_framework_is_a_usage_error_before_anything_runs(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as end:
        sampler_blocks.main([*argv, "--out", str(tmp_path)])
    assert end.value.code == 2 and argv[0] in capsys.readouterr().err
    assert not (tmp_path / "sampler_blocks.json").exists()


def test_a_relative_interpreter_path_reaches_the_training_process_absolute(tmp_path, monkeypatch):
    """The training process starts with the repository as its working directory: a relative --python path is made
    absolute first (harness_vs_loop.parse_pythons)."""
    started = []

    def fake_measure(framework, python, args, threads):
        started.append(python)
        raise RuntimeError("not started")

    monkeypatch.setattr(sampler_blocks, "measure", fake_measure)
    monkeypatch.chdir(tmp_path)
    assert sampler_blocks.main(["--frameworks", "jax", "--python", "jax=venv/bin/python", "--out", "."]) == 1
    assert started == [[str(tmp_path / "venv" / "bin" / "python")]]
    assert "RuntimeError: not started" in (tmp_path / "sampler_blocks.json").read_text()

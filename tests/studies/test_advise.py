"""``harness advise`` end to end on the CPU, real training (an MLP on digits in envs/ interpreters): the answer per
objective first, the evidence after; bad input one line and exit 2 before anything runs; a budget that cuts stages
says what the answer rests on. That every framework's trial records the same gradient norms is
tests/test_end_to_end.py's (its four-framework run measures them)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from harness.studies.advise.trials import MIN_BOUNDED_STEPS, NOISE_EVERY
from tests.helpers import base_spec

MLP = [{"type": "flatten"}, {"type": "dense", "units": 32, "activation": "relu"}, {"type": "dense", "units": 10}]


def _spec(write_spec, envs, names=("pytorch",), **changes):
    data = base_spec(name="adv", model={"layers": MLP}, frameworks=[{"name": f, "python": envs[f]} for f in names],
                     batch_sizes=[8, 128], epochs=4, optimizer={"name": "sgd", "learning_rate": 0.05, "momentum": 0.9},
                     learning_rate_scaling="sqrt", base_batch_size=32, target_accuracy=0.9, device="cpu")
    data.update(changes)
    return write_spec(data)


def _advise(spec, tmp_path, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "harness", "advise", str(spec), "--out", str(tmp_path / "out"),
                           *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_advise_answers_each_objective_first_with_its_evidence(envs, write_spec, tmp_path):
    spec = _spec(write_spec, envs)
    done = _advise(spec, tmp_path, "--objective", "throughput,time,energy", "--repeats", "2", "--probes", "3",
                   "--validate")
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = (tmp_path / "out").iterdir()
    advice = json.loads((folder / "advice.json").read_text())
    assert advice["candidates"] == [8, 16, 31, 32, 33, 64, 128]
    answers = advice["entries"]["pytorch"]["objectives"]
    assert answers["throughput"]["batch_size"] in advice["candidates"]
    assert answers["throughput"]["knee"] <= answers["throughput"]["batch_size"]
    assert answers["energy"]["batch_size"] is None and "energy counter" in answers["energy"]["reason"]
    time_answer = answers["time"]
    noise = advice["entries"]["pytorch"]["noise_scale"]
    low, high = noise["interval"]
    assert 0 < low <= noise["b_simple"] <= high and noise["micro_batch"] == 4 and noise["batch"] == 32
    # the noise trial stopped at its first evaluation at the target (stop_at_target), where the value is taken
    assert noise["trajectory"][-1]["test_accuracy"] >= 0.9 and noise["probes"] >= 3
    assert all(e["test_accuracy"] < 0.9 for e in noise["trajectory"][:-1])
    assert time_answer["batch_size"] in advice["candidates"] and time_answer["b_noise"] == noise["b_simple"]
    lo, hi = time_answer["range"]
    assert lo <= time_answer["batch_size"] <= hi
    # the prediction is calibrated on the noise trial: at its own size it predicts the steps it took
    noise_run = [json.loads(line) for line in (folder / advice["noise_run"].rsplit("/", 1)[1] / "trials.jsonl")
                 .read_text().splitlines()]
    (trial,) = noise_run
    took = trial["metrics"]["time_to_target"]["steps"]
    at_32 = next(r for r in time_answer["rows"] if r["batch_size"] == 32)
    assert at_32["steps"] == pytest.approx(took)
    rows = {r["batch_size"]: r["seconds"] for r in time_answer["rows"]}
    assert time_answer["batch_size"] == min(rows, key=rows.get)
    # S0 resolved finer than an epoch: evaluations every 1437 // 8 samples (44 steps an epoch at 32: every 5 or 6
    # steps); the gradient norms at every NOISE_EVERY-th of them and at the one that reached the target (the last)
    evaluations = trial["metrics"]["epochs"]
    steps = [e["step"] for e in evaluations]
    assert steps[-1] == took and all(0 < b - a <= 6 for a, b in zip([0] + steps, steps))
    measured = [i + 1 for i, e in enumerate(evaluations) if e["gradient_noise"] is not None]
    assert measured == [i for i in range(1, len(evaluations) + 1) if i % NOISE_EVERY == 0 or i == len(evaluations)]
    assert len(noise["trajectory"]) == len(measured)
    assert all(len(e["gradient_noise"]["big"]) == 3 for e in evaluations if e["gradient_noise"] is not None)
    # the answer first: on standard output and at the top of advice.md, before any table
    first = done.stdout.splitlines()
    assert first[0].startswith("# Which batch size?") and not any(line.startswith("|") for line in first)
    assert any("**least time to target**" in line for line in first)
    md = (folder / "advice.md").read_text()
    assert md.index("least time to target") < md.index("# Evidence") < md.index("| batch size |")
    assert advice["spent"]["seconds"]["throughput"] > 0 and advice["spent"]["seconds"]["noise"] > 0
    # each throughput trial timed no more than the training to the target predicted at its size (the compute goal)
    bound = advice["throughput_bound"]["pytorch"]
    assert bound == {"b_noise": noise["b_simple"], "s_min": pytest.approx(time_answer["s_min"])}
    speed_run = [json.loads(line) for line in (folder / advice["throughput_run"].rsplit("/", 1)[1] / "trials.jsonl")
                 .read_text().splitlines()]
    assert {t["batch_size"] for t in speed_run} == set(advice["candidates"])
    for t in speed_run:
        predicted = math.ceil(bound["s_min"] * (1 + bound["b_noise"] / t["batch_size"]))
        # the trial's epochs are cut to the steps it needs: at most one step an epoch beyond them (equal shares)
        m = t["metrics"]
        timed, epochs = m["measured_steps"], m["total_steps"] // m["steps_per_epoch"]
        assert timed < max(MIN_BOUNDED_STEPS, predicted) + epochs, (t["batch_size"], timed, predicted)
    # --validate: successive halving over the candidates, its seconds those the trials recorded to the target
    validation = time_answer["validation"]
    rounds = validation["rounds"]
    assert rounds[0] == advice["candidates"] and len(rounds[-1]) <= 2
    assert all(set(later) < set(earlier) for earlier, later in zip(rounds, rounds[1:]))
    recorded = {}
    for trials in (folder / "validate-pytorch").glob("*/trials.jsonl"):
        for line in trials.read_text().splitlines():
            t = json.loads(line)
            at = t["metrics"]["time_to_target"] if t["status"] == "ok" else None
            recorded.setdefault(str(t["batch_size"]), []).append(None if at is None else at["training_s"])
    assert {b: sorted(v, key=str) for b, v in recorded.items()} == \
        {b: sorted(row["seconds"], key=str) for b, row in validation["sizes"].items()}
    best = validation["measured_best"]
    assert best in rounds[-1] and validation["held"] is (validation["ratio"] is not None and
                                                        validation["ratio"] <= validation["hold_ratio"])
    assert "validated:" in next(line for line in first if "least time to target" in line)
    assert "validation (successive halving" in md
    # the figure: predicted and measured time to the target against batch size, linked from advice.md
    figure = advice["entries"]["pytorch"]["plot"]
    assert (folder / figure).stat().st_size > 10_000 and f"]({figure})" in md


@pytest.mark.parametrize(("args", "changes", "words"), [
    (["--framework", "nosuch"], {}, "--framework: 'nosuch' is not an entry"),
    (["--objective", "speed"], {}, "speed: each is one of memory, throughput, time, energy"),
    (["--micro-batches", "3"], {}, "--micro-batches: the noise trial's batch of 32 samples cannot be split into 3"),
    (["--target-accuracy", "1.5"], {}, "--target-accuracy: 1.5 is not a fraction"),
    ([], {"input": "loader"}, "gradient_noise is measured on one device with resident input"),
    (["--global-batch", "1"], {}, "--global-batch: 1 is not between 2 and the"),
    (["--validate"], {"target_accuracy": None}, "--validate: needs a target accuracy"),
    (["--validate", "--objective", "throughput"], {}, "--validate: judges the time objective"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(envs, write_spec, tmp_path, args, changes, words):
    spec = _spec(write_spec, envs, **changes)
    done = _advise(spec, tmp_path, *args, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert words in lines[-1] and "Traceback" not in done.stderr
    # one line, or argparse's usage and its one error line for an argument it checks itself
    assert len(lines) == 1 or lines[0].startswith("usage: harness advise"), done.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_budget_that_cuts_every_stage_says_what_the_answer_rests_on(envs, write_spec, tmp_path):
    spec = _spec(write_spec, envs)
    done = _advise(spec, tmp_path, "--objective", "throughput,time", "--budget", "0", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (folder,) = (tmp_path / "out").iterdir()
    advice = json.loads((folder / "advice.json").read_text())
    assert advice["spent"]["cut"] == ["throughput", "noise"]
    answers = advice["entries"]["pytorch"]["objectives"]
    assert answers["throughput"]["batch_size"] is None and answers["time"]["batch_size"] is None
    assert "the budget" in answers["time"]["reason"]
    assert "cut: throughput, noise" in done.stdout


@pytest.mark.slow
def test_a_global_batch_is_planned_over_micro_batches_that_hold_and_measured_side_by_side(envs, write_spec,
                                                                                          tmp_path):
    spec = _spec(write_spec, envs, model={"layers": [{"type": "flatten"}, {"type": "dense", "units": 16},
                                                     {"type": "batchnorm"}, {"type": "relu"},
                                                     {"type": "dense", "units": 10}]})
    done = _advise(spec, tmp_path, "--objective", "memory", "--global-batch", "512", "--repeats", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = (tmp_path / "out").iterdir()
    advice = json.loads((folder / "advice.json").read_text())
    memory = advice["entries"]["pytorch"]["objectives"]["memory"]
    plans = advice["entries"]["pytorch"]["global_batch"]
    largest = plans["largest_that_holds"]
    assert largest == memory["batch_size"] and largest >= 8
    rows = plans["rows"]
    assert rows and all(r["micro_batch"] * r["accumulation"] * r["devices"] == 512 for r in rows)
    assert all(r["micro_batch"] <= largest and r["repeats"] == 2 for r in rows)
    assert rows[0]["micro_batch"] == max(m for m in range(1, min(largest, 512) + 1) if 512 % m == 0)
    best = max(rows, key=lambda r: r["throughput_median"])
    assert plans["batch_size"] == best["plan"] and plans["plan"]["micro_batch"] == best["micro_batch"]
    # every plan trained G samples per optimizer step at the learning rate of G (sqrt from 32: 0.05 x 4)
    (run_dir,) = [d for d in folder.iterdir() if (d / "trials.jsonl").exists()]
    trials = [json.loads(line) for line in (run_dir / "trials.jsonl").read_text().splitlines()]
    assert {t["effective_batch_size"] for t in trials} == {512}
    assert [t["learning_rate"] for t in trials] == pytest.approx([0.2] * len(trials))
    assert {(t["batch_size"], t["accumulation_steps"]) for t in trials} == \
        {(r["micro_batch"], r["accumulation"]) for r in rows}
    notes = " ".join(plans["notes"])
    assert "one device" in notes and ("batchnorm" in notes) == any(r["accumulation"] > 1 for r in rows)
    assert any(line.startswith("- **a global batch of 512**") for line in done.stdout.splitlines())

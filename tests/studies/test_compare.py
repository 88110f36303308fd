"""The regression rule of ``harness compare`` on constructed runs with known noise: few false alarms between runs
of the same distribution, large changes caught, changes inside the noise not, the run-to-run spread of a history
joining the noise (and, without one, an assumed drift), and the statement of what a comparison can resolve.
Tests of the within-run part alone pass ``drift_pct=0``."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from harness.record import TrialRecord
from harness.results import store
from harness.studies.compare import DEFAULT_DRIFT_PCT, compare_runs, resolvable_lines, to_markdown
from tests.helpers import record, repeated_run

FRAMEWORKS, BATCH_SIZES = ("pytorch", "mxnet"), (8, 16, 32, 64)


def noisy(rng, spread=0.10, slower=None):
    """Throughput 1000 x 2^(index of bs) with log-normal noise of ``spread``; ``slower``: {(fw, bs): factor}."""
    def throughput(fw, bs, r):
        factor = (slower or {}).get((fw, bs), 1.0)
        return 1000.0 * bs / 8 * factor * math.exp(rng.normal(0, spread))
    return throughput


def regressions(rows):
    return {(r.framework, r.batch_size, r.metric) for r in rows if r.verdict == "regression"}


def test_runs_of_the_same_distribution_rarely_raise_an_alarm(tmp_path):
    rng = np.random.default_rng(0)
    alarms = 0
    for i in range(30):
        base = repeated_run(tmp_path / f"b{i}", noisy(rng))
        new = repeated_run(tmp_path / f"n{i}", noisy(rng))
        rows, summary = compare_runs(base, new)
        alarms += summary["regressions"] > 0
        assert summary["tests"] == 8  # 8 cells x throughput; accuracy and memory repeat exactly: no noise to test
    assert alarms <= 3  # the rule allows 5 % for the whole comparison; 30 pairs


def test_a_large_change_is_caught_and_one_inside_the_noise_is_not(tmp_path):
    rng = np.random.default_rng(1)
    base = repeated_run(tmp_path / "base", noisy(rng))
    new = repeated_run(tmp_path / "new", noisy(rng, slower={("pytorch", 16): 0.5, ("mxnet", 32): 0.88}))
    assert regressions(compare_runs(base, new)[0]) == {("pytorch", 16, "Throughput")}
    rows, summary = compare_runs(base, new, drift_pct=0)  # the repeats alone
    assert regressions(rows) == {("pytorch", 16, "Throughput")}
    row = next(r for r in rows if (r.framework, r.batch_size, r.metric) == ("mxnet", 32, "Throughput"))
    assert row.verdict == "same" and row.score < row.needed  # more than the 5 % threshold, less than the noise
    resolvable = summary["resolvable"]["Throughput"]
    assert 12 < resolvable["pct"] < 60 and resolvable["repeats"] == 3 and resolvable["cells"] == 8
    assert 7 < resolvable["within_pct"] < 14  # the planted 10 % noise, pooled over 16 groups of 3
    assert resolvable["repeats_for_threshold"] > 3
    text = to_markdown(rows, summary)
    assert "Throughput: changes under" in text and "cannot be told apart from noise" in text
    assert "| pytorch | 16 | Throughput |" in text and "**regression**" in text


def test_quiet_cells_resolve_small_changes(tmp_path):
    rng = np.random.default_rng(2)
    base = repeated_run(tmp_path / "base", noisy(rng, spread=0.005))
    new = repeated_run(tmp_path / "new", noisy(rng, spread=0.005, slower={("mxnet", 8): 0.92}))
    rows, summary = compare_runs(base, new, drift_pct=0)  # e.g. a machine known not to drift
    assert regressions(rows) == {("mxnet", 8, "Throughput")}
    assert summary["resolvable"]["Throughput"]["pct"] == 5.0  # the threshold, not the noise, is the limit


def test_one_noisy_cell_keeps_most_of_its_own_spread(tmp_path):
    rng = np.random.default_rng(3)

    def throughput(fw, bs, r):  # every cell quiet but pytorch 8, which swings by 40 %
        return 1000.0 * math.exp(rng.normal(0, 0.4 if (fw, bs) == ("pytorch", 8) else 0.01))
    base = repeated_run(tmp_path / "base", throughput)
    new = repeated_run(tmp_path / "new", lambda fw, bs, r: throughput(fw, bs, r) * (0.75 if (fw, bs) == ("pytorch", 8)
                                                                                 else 1.0))
    rows, _ = compare_runs(base, new)
    assert ("pytorch", 8, "Throughput") not in regressions(rows)


def test_the_run_to_run_spread_of_a_history_joins_the_noise(tmp_path):
    rng = np.random.default_rng(4)
    base = repeated_run(tmp_path / "base", noisy(rng, spread=0.005))
    new = repeated_run(tmp_path / "new", noisy(rng, spread=0.005, slower={("pytorch", 64): 0.8}))
    assert regressions(compare_runs(base, new, drift_pct=0)[0]) == {("pytorch", 64, "Throughput")}
    history_file = tmp_path / "history.jsonl"
    for i in range(8):  # earlier runs whose medians swing by 25 % from run to run
        cells = {f"{fw}/{bs}": {"throughput": 1000.0 * bs / 8 * math.exp(rng.normal(0, 0.25)), "status": "ok"}
                 for fw in FRAMEWORKS for bs in BATCH_SIZES}
        store.append_line(history_file, {"run": f"old{i}", "spec": "t", "device": None, "cells": cells})
    store.append_line(history_file, {"run": "other", "spec": "another spec", "device": None, "cells": {}})
    rows, summary = compare_runs(base, new, history_file=history_file)
    assert regressions(rows) == set() and summary["history_runs"] == 8
    between = summary["resolvable"]["Throughput"]["between_pct"]
    assert 15 < between < 40
    assert "run-to-run spread" in "\n".join(resolvable_lines(summary))
    # history_runs: how many of the newest runs count
    assert compare_runs(base, new, history_file=history_file, history_runs=0)[1]["history_runs"] == 0


def test_without_repeats_the_drift_decides_and_says_so(tmp_path):
    base = repeated_run(tmp_path / "base", lambda fw, bs, r: 1000.0, repeats=1)
    slowed = {("mxnet", 16): 0.9, ("pytorch", 8): 0.5}
    new = repeated_run(tmp_path / "new", lambda fw, bs, r: 1000.0 * slowed.get((fw, bs), 1.0), repeats=1)
    rows, summary = compare_runs(base, new)
    assert regressions(rows) == {("pytorch", 8, "Throughput")}  # 10 % is inside a 5 % drift between two runs
    assert all(r.noise.endswith("(drift only, no repeats)") for r in rows if r.metric == "Throughput")
    assert summary["tests"] == 8 and summary["resolvable"]["Throughput"]["within_pct"] is None
    rows, summary = compare_runs(base, new, drift_pct=0)  # no drift assumed: the threshold alone, as it says
    assert regressions(rows) == {("mxnet", 16, "Throughput"), ("pytorch", 8, "Throughput")}
    assert {r.noise for r in rows if r.metric == "Throughput"} == {"threshold only (no repeats)"}
    assert summary["tests"] == 0 and summary["resolvable"] == {} and summary["drift_pct"] is None


def test_an_accuracy_drop_with_identical_repeats_is_decided_by_the_threshold(tmp_path):
    base = repeated_run(tmp_path / "base", lambda fw, bs, r: 1000.0 + r)
    new = repeated_run(tmp_path / "new", lambda fw, bs, r: 1000.0 + r,
                       accuracy=lambda fw, bs, r: 0.8 if (fw, bs) == ("pytorch", 8) else 0.9)
    rows, _ = compare_runs(base, new)
    assert regressions(rows) == {("pytorch", 8, "Test accuracy after the last epoch")}


def test_cli_options(tmp_path):
    rng = np.random.default_rng(5)
    base = repeated_run(tmp_path / "base", noisy(rng))
    new = repeated_run(tmp_path / "new", noisy(rng, slower={("pytorch", 16): 0.5}))

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "harness", "compare", str(base), str(new), *extra],
                              capture_output=True, text=True, timeout=120)

    proc = run()
    assert proc.returncode == 1 and "1 regression(s)" in proc.stdout
    assert "Throughput: changes under" in proc.stdout
    proc = run("--alpha", "1.5")
    assert proc.returncode == 2 and proc.stderr.strip() == "harness compare: --alpha must be between 0 and 1, not 1.5"
    markdown = (new / "compare-base.md").read_text()
    assert "chance of any false alarm" in markdown


@pytest.mark.parametrize("alpha", [0.2, 0.001])
def test_a_smaller_alpha_needs_a_larger_score(tmp_path, alpha):
    rng = np.random.default_rng(6)
    base = repeated_run(tmp_path / "base", noisy(rng))
    new = repeated_run(tmp_path / "new", noisy(rng))
    rows, summary = compare_runs(base, new, alpha=alpha)
    needed = {r.needed for r in rows if r.metric == "Throughput"}
    assert len(needed) == 1
    assert (needed.pop() > 3.5) == (alpha == 0.001)
    json.dumps(summary)  # the summary is plain data


def make_ab_run(path, rng, drift, b_factor=1.0, repeats=5, spread=0.05):
    """One run with rows A and B (two entries of pytorch, interleaved): the whole run at a speed of its own
    (log-normal, ``drift``), each trial with log-normal noise ``spread``; B's throughput times ``b_factor``."""
    path.mkdir(parents=True)
    speed = math.exp(rng.normal(0, drift))
    records = []
    for r in range(repeats):
        for bs in BATCH_SIZES:
            for label, factor in (("A", 1.0), ("B", b_factor)):
                rec = record("pytorch", bs, r, throughput=1000.0 * bs / 8 * speed * factor *
                             math.exp(rng.normal(0, spread)))
                records.append({**rec, "id": f"{label}-{rec['id']}", "label": label})
    store.write_json(path / "run.json", {"spec": {"name": "ab"}, "device": "cpu", "environment": {},
                                         "planned_trials": [r["id"] for r in records]})
    for rec in records:
        store.append_trial(path, TrialRecord.model_validate(rec))
    return path


def test_two_rows_of_one_run_cancel_the_drift_between_runs(tmp_path):
    """Runs that drift by 20 % as a whole and whose trials spread 5 %: two runs' A rows raise alarms (the drift is
    beyond what their repeats see), while A against B inside each run stays quiet, and B 30 % slower inside a run is
    caught at every batch size."""
    from harness.studies.compare import compare_rows

    rng = np.random.default_rng(7)
    runs = [make_ab_run(tmp_path / f"r{i}", rng, drift=0.2) for i in range(12)]
    between = sum(compare_runs(a, b, drift_pct=0)[1]["regressions"] > 0 for a, b in zip(runs[::2], runs[1::2]))
    within = sum(compare_rows(run, "A", "B")[1]["regressions"] > 0 for run in runs)
    assert between >= 2 and within <= 1, (between, within)
    for i in range(5):
        slowed = make_ab_run(tmp_path / f"s{i}", rng, drift=0.2, b_factor=0.7)
        rows, summary = compare_rows(slowed, "A", "B")
        assert regressions(rows) == {("B vs A", bs, "Throughput") for bs in BATCH_SIZES}
        assert summary["interleaved"] and summary["base"] == f"s{i} [A]" and summary["history_runs"] == 0
        assert "interleaved" in to_markdown(rows, summary)


def test_rows_on_the_command_line(tmp_path):
    rng = np.random.default_rng(8)
    run = make_ab_run(tmp_path / "ab", rng, drift=0.0, b_factor=0.5)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "harness", "compare", *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    proc = cli(run, "--rows", "A", "B")
    assert proc.returncode == 1 and "4 regression(s)" in proc.stdout and (run / "compare-rows.md").exists()
    proc = cli(run, "--rows", "A", "C")
    assert proc.returncode == 2 and proc.stderr.strip() == f"harness compare: {run}: no row 'C'; its rows: A, B"
    proc = cli(run, run, "--rows", "A", "B")
    assert proc.returncode == 2 and "give one run" in proc.stderr
    proc = cli(run)
    assert proc.returncode == 2 and "give two runs, or one run and --rows" in proc.stderr


def two_runs(tmp_path, change, spread=0.025, repeats=5, name="", history=None):
    """The user's case from issue 27: one framework at batch 32 and 64, ``repeats`` repeats spread by exactly
    ``spread`` (log standard deviation) in both runs, every cell of the new run ``change`` (-0.082: 8.2 % slower)."""
    pattern = np.arange(repeats) - (repeats - 1) / 2
    pattern = pattern / pattern.std(ddof=1) * spread
    kw = dict(repeats=repeats, frameworks=("pytorch",), batch_sizes=(32, 64))
    base = repeated_run(tmp_path / f"base{name}", lambda fw, bs, r: 100.0 * bs * math.exp(pattern[r]), **kw)
    new = repeated_run(tmp_path / f"new{name}", lambda fw, bs, r: 100.0 * bs * (1 + change) * math.exp(pattern[r]),
                       **kw)
    return base, new


def test_two_runs_minutes_apart_do_not_call_a_drift_of_the_whole_run_a_regression(tmp_path):
    """-8.2 % at both batch sizes, repeats spread 2.5 %: about 4 standard errors of the repeats alone (the old rule
    called it a regression), inside what the default run-to-run drift (5 %) allows; the output says so."""
    base, new = two_runs(tmp_path, -0.082)
    rows, summary = compare_runs(base, new, drift_pct=0)
    assert regressions(rows) == {("pytorch", 32, "Throughput"), ("pytorch", 64, "Throughput")}
    assert all(r.score > 4 for r in rows if r.metric == "Throughput")
    rows, summary = compare_runs(base, new)
    assert regressions(rows) == set() and summary["regressions"] == 0
    assert DEFAULT_DRIFT_PCT == 5.0 and summary["drift_pct"] == pytest.approx(DEFAULT_DRIFT_PCT)
    row = next(r for r in rows if r.metric == "Throughput")
    assert row.change_pct == pytest.approx(-8.2) and row.score < row.needed and row.noise.endswith(", with drift")
    resolvable = summary["resolvable"]["Throughput"]
    assert resolvable["drift_pct"] == pytest.approx(5.0) and 8.2 < resolvable["pct"] < 40
    assert resolvable["repeats_for_threshold"] == 0  # no number of repeats beats the drift
    text = to_markdown(rows, summary)
    assert "Without a history: between-run drift floor 5.0 % assumed" in text
    assert "no number of repeats resolves 5 %" in text
    # a lower floor, for a machine known to drift less, resolves less
    assert compare_runs(base, new, drift_pct=1.0)[1]["regressions"] == 2
    with pytest.raises(ValueError, match="0 or more percent"):
        compare_runs(base, new, drift_pct=-1)


def test_a_30_percent_drop_is_still_a_regression_without_a_history(tmp_path):
    base, new = two_runs(tmp_path, -0.30)
    rows, summary = compare_runs(base, new)
    assert regressions(rows) == {("pytorch", 32, "Throughput"), ("pytorch", 64, "Throughput")}
    assert summary["drift_pct"] is not None


def test_with_a_history_its_spread_replaces_the_assumed_drift(tmp_path):
    """A history whose run medians spread 1 %: its spread is the between-run noise (as before the drift floor), so
    the -8.2 % change is a regression again and no drift is assumed; a history of one run has no spread yet."""
    rng = np.random.default_rng(9)
    base, new = two_runs(tmp_path, -0.082)
    history_file = tmp_path / "history.jsonl"
    for i in range(8):
        cells = {f"pytorch/{bs}": {"throughput": 100.0 * bs * math.exp(rng.normal(0, 0.01)), "status": "ok"}
                 for bs in (32, 64)}
        store.append_line(history_file, {"run": f"old{i}", "spec": "t", "device": None, "cells": cells})
    rows, summary = compare_runs(base, new, history_file=history_file)
    assert regressions(rows) == {("pytorch", 32, "Throughput"), ("pytorch", 64, "Throughput")}
    assert summary["history_runs"] == 8 and summary["drift_pct"] is None
    assert summary["resolvable"]["Throughput"]["between_pct"] < 2
    assert "drift floor" not in to_markdown(rows, summary)
    assert all(not r.noise.endswith("with drift") for r in rows)
    rows, summary = compare_runs(base, new, history_file=history_file, history_runs=1)
    assert regressions(rows) == set() and summary["drift_pct"] == pytest.approx(5.0)


def test_drift_on_the_command_line(tmp_path):
    base, new = two_runs(tmp_path, -0.082)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "harness", "compare", *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    proc = cli(base, new)
    assert proc.returncode == 0 and "0 regression(s)" in proc.stdout
    assert "Without a history: between-run drift floor 5.0 % assumed" in proc.stdout
    proc = cli(base, new, "--drift-pct", "0")
    assert proc.returncode == 1 and "2 regression(s)" in proc.stdout and "drift floor" not in proc.stdout
    proc = cli(base, new, "--drift-pct", "-3")
    assert proc.returncode == 2 and "0 or more percent" in proc.stderr
    proc = cli(base, "--rows", "pytorch", "pytorch", "--drift-pct", "2")
    assert proc.returncode == 2 and "no --history or --drift-pct" in proc.stderr


def test_a_stored_version_1_run_compares_and_enters_the_history(tmp_path):
    """Runs written before the units moved into the names (schema version 1, tests/record/data/v1-run) read through
    the one loader: compare sets them against a run of this version, history summarises them, with the same cells."""
    import shutil
    from pathlib import Path

    from harness.studies import history

    old = tmp_path / "v1"
    shutil.copytree(Path(__file__).parents[1] / "record" / "data" / "v1-run", old)
    stored = {}
    for line in (old / "trials.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["status"] == "ok":
            stored.setdefault(r["batch_size"], []).append(r["metrics"]["throughput"])
    row = history.summary_row(old)
    assert row["spec"] == "t" and row["cells"]["fault (fp32)/15"]["throughput"] == np.median(stored[15])
    assert row["cells"]["fault (fp16)/15"] == {"status": "unsupported", **dict.fromkeys(
        ("throughput", "seconds_per_epoch", "accuracy", "memory", "util"))}
    new = tmp_path / "v2"  # the same trials written as this version's records
    new.mkdir()
    shutil.copy(old / "run.json", new / "run.json")
    for old_record in store.read_trials(old):
        store.append_trial(new, old_record.model_copy(update={"schema_version": 2}))
    rows, summary = compare_runs(old, new)
    assert summary["regressions"] == 0 and summary["missing"] == ["fault (fp16) bs15: failed in base"]
    throughput = [r for r in rows if r.metric == "Throughput"]
    assert {(r.framework, r.batch_size, r.verdict) for r in throughput} == {
        ("fault (fp16)", 15, "failed in base"), ("fault (fp32)", 15, "same"), ("fault (fp32)", 16, "same")}
    assert all(r.base == r.new for r in throughput if r.verdict == "same")


def test_a_wrong_command_line_is_answered_before_compare_is_imported():
    """The arguments' own errors (exit 2) come before any run is read and before compare's statistics (scipy,
    pandas) are imported."""
    code = ("import sys\nfrom harness.cli import main\n"
            "codes = [main(argv) for argv in (['compare', 'a'], ['compare', 'a', 'b', '--drift-pct', '-1'],"
            " ['compare', 'a', '--rows', 'x', 'y', '--history', 'h'], ['compare', 'a', 'b', '--alpha', '0'])]\n"
            "print(codes, 'harness.studies.compare' in sys.modules, 'scipy' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["[2,", "2,", "2,", "2]", "False", "False"], proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 4 and "Traceback" not in proc.stderr, proc.stderr

"""Does ``harness compare`` cry wolf, and does it catch real slowdowns? False alarms from pairs of identical runs,
detection rates from runs with a planted 10 % and 30 % slowdown, on this machine.

Every run is the same small study: the quick spec's CNN on digits under PyTorch on the CPU (one thread), batch sizes
32 and 128, ``--repeats`` repeats (3 by default, as a nightly would run), 8 epochs (about a second of timed training
each), through the harness's own sweep (one worker per trial). The runs are registered as the framework ``planted``
(``benchmarks/planted.py``: the PyTorch adapter, which in the slowed runs spins for 10 % or 30 % of each step's own
duration, so they keep the real framework's noise). Each round makes four runs in a rotating order: two plain ones (A
and B), one 10 % slower and one 30 % slower, so that drift in the machine falls on every kind of run.

Then every pair is compared with ``harness.studies.compare.compare_runs`` at the default threshold:

- false alarms: a plain run against every other plain run (A_i vs B_j and A_i vs A_j, i != j: the same round or
  hours apart, as a nightly against its last good run), an alarm being any regression in the comparison (the
  nightly's exit 1);
- each twice: without a history (the repeats inside the two runs and the assumed run-to-run drift, ``--drift-pct``:
  the comparison's default, or 0 for the repeats alone) and with a history of every plain run (``--history``: the
  run-to-run spread of the cells' medians joins the noise, as in the nightly job);
- detection: a plain run against every slowed run; "caught" means the throughput of both batch sizes was called a
  regression, "any" that the comparison failed at all.

``--interleaved`` measures the other design, both versions in one run (``harness compare RUN --rows A B``): each
round is one run whose spec lists four entries side by side, two plain (rows A and B: ``planted``), one 10 % and one
30 % slower (``planted10``, ``planted30``: fixed slowdowns under names of their own), so every trial of one kind
has trials of the others just before and after it; false alarms are A against B, detection A and B against each
slowed row, all inside each run (``compare_rows``). Use more repeats here: a cell's noise is then only the
repeat-to-repeat spread, and on this project's 2-core VM 16 repeats at batch 128 caught the 30 % slowdown in 8 of 8
comparisons where 8 repeats missed it in one cell of six (README, "Nightly runs").

It also prints the run-to-run drift the plain runs show: the spread of their cells' medians (log scale) beyond
what their repeats explain, sqrt(s_medians^2 - (pi / 2) s_repeats^2 / r), the figure the drift default rests on.

The table gives each rate with its count and a 95 % Clopper-Pearson interval (scipy.stats.binomtest); pairs that
share a run are not independent, so read the intervals as optimistic. The runs are kept in ``--runs`` so that the
comparison can be re-evaluated (``--evaluate-only``) without running them again.

    .venv/bin/python benchmarks/compare_false_alarms.py                  # 6 rounds: 24 runs, about 10 minutes
    .venv/bin/python benchmarks/compare_false_alarms.py --rounds 10 --repeats 5
    .venv/bin/python benchmarks/compare_false_alarms.py --evaluate-only --runs /tmp/compare-runs
    .venv/bin/python benchmarks/compare_false_alarms.py --evaluate-only --runs /tmp/compare-runs --drift-pct 0
    .venv/bin/python benchmarks/compare_false_alarms.py --interleaved --rounds 4 --repeats 16 --batch-sizes 128 \\
        --runs /tmp/ab16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.plan import checked_spec  # noqa: E402
from harness.studies.compare import DEFAULT_DRIFT_PCT, DEFAULT_THRESHOLD_PCT, MEDIAN_SE, compare_rows, compare_runs  # noqa: E402
from harness.studies.sweep import run_spec  # noqa: E402

KINDS = {"A": 0.0, "B": 0.0, "slow10": 0.10, "slow30": 0.30}
CNN = [{"type": "conv2d", "filters": 32, "kernel_size": 3, "padding": "same", "activation": "relu",
        "kernel_init": "he_uniform"},
       {"type": "maxpool2d", "pool_size": 2}, {"type": "flatten"},
       {"type": "dense", "units": 128, "activation": "relu", "kernel_init": "he_uniform"},
       {"type": "dense", "units": 10}]


#: --interleaved: the entries of each round's one run (row label -> registered adapter name)
AB_ROWS = {"A": "planted", "B": "planted", "slow10": "planted10", "slow30": "planted30"}


def spec_for(repeats: int, batch_sizes: list[int], interleaved: bool = False):
    frameworks = ([{"name": name, "label": label} for label, name in AB_ROWS.items()] if interleaved
                  else ["planted"])
    data = {"name": "compare-noise" + ("-ab" if interleaved else ""), "frameworks": frameworks,
            "model": {"layers": CNN},
            "dataset": {"name": "digits"}, "batch_sizes": batch_sizes, "epochs": 8, "warmup_steps": 2,
            "repeats": repeats, "optimizer": {"name": "sgd", "learning_rate": 0.01, "momentum": 0.9}, "seed": 0,
            "device": "cpu", "cpu_threads": 1, "timeout_s": 300}
    return checked_spec(data, "compare_false_alarms")


def collect(runs: Path, rounds: int, repeats: int, batch_sizes: list[int]) -> None:
    from benchmarks.planted import REGISTRATION  # here, not above: --evaluate-only needs no adapter

    os.environ["HARNESS_ADAPTERS"] = REGISTRATION
    os.environ["PYTHONPATH"] = str(ROOT)
    spec = spec_for(repeats, batch_sizes)
    kinds = list(KINDS)
    index = {"rounds": []}
    for r in range(rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        done = {}
        for kind in order:
            os.environ["HARNESS_PLANTED_SLOWDOWN"] = str(KINDS[kind])
            started = time.monotonic()
            run_dir = run_spec(spec, runs / f"round{r}-{kind}")
            done[kind] = str(run_dir)
            print(f"round {r + 1}/{rounds}: {kind} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        index["rounds"].append(done)
        (runs / "index.json").write_text(json.dumps(index, indent=1))


def collect_interleaved(runs: Path, rounds: int, repeats: int, batch_sizes: list[int]) -> None:
    """One run a round, its four rows side by side (``AB_ROWS``)."""
    from benchmarks.planted import REGISTRATION_ALL

    os.environ["HARNESS_ADAPTERS"] = REGISTRATION_ALL
    os.environ["PYTHONPATH"] = str(ROOT)
    os.environ["HARNESS_PLANTED_SLOWDOWN"] = "0"
    spec = spec_for(repeats, batch_sizes, interleaved=True)
    index: dict = {"interleaved": True, "rounds": []}
    for r in range(rounds):
        started = time.monotonic()
        index["rounds"].append({"run": str(run_spec(spec, runs / f"round{r}"))})
        print(f"round {r + 1}/{rounds}: one run of {len(AB_ROWS)} rows in {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)
        (runs / "index.json").write_text(json.dumps(index, indent=1))


def evaluate_interleaved(runs: Path, threshold: float) -> list[dict]:
    """False alarms (A against B) and detection (A and B against each slowed row), inside each round's run."""
    rounds = [d["run"] for d in json.loads((runs / "index.json").read_text())["rounds"]]
    results = [compare_rows(run, "A", "B", threshold) for run in rounds]
    rows = [{"pairs": "A vs B in one run (false alarms)", "n": len(results),
             "any": sum(summary["regressions"] > 0 for _, summary in results), "caught": None,
             "resolvable": results[0][1].get("resolvable", {}) if results else {}}]
    for kind in ("slow10", "slow30"):
        pairs = [compare_rows(run, plain, kind, threshold) for run, plain in itertools.product(rounds, ("A", "B"))]
        rows.append(_detection(f"plain vs {kind[4:]} % slower, same run", pairs))
    return rows


def _detection(label: str, pairs: list) -> dict:
    """A table row from (rows, summary) comparisons of a plain and a slowed run: how many failed at all, and how many
    called the throughput of every batch size a regression."""
    caught = anything = 0
    for result, summary in pairs:
        flagged = {r.batch_size for r in result if r.metric == "Throughput" and r.verdict == "regression"}
        caught += len(flagged) == len({r.batch_size for r in result})
        anything += summary["regressions"] > 0
    return {"pairs": label, "n": len(pairs), "any": anything, "caught": caught}


def _interval(k: int, n: int) -> str:
    from scipy.stats import binomtest

    if n == 0:
        return "-"
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95)
    return f"{100 * ci.low:.0f}-{100 * ci.high:.0f} %"


def history_of_plain_runs(runs: Path, plain: list[str]) -> Path:
    """A history file (``harness.studies.history``) of every plain run, as a nightly's would hold its earlier
    nights; ``compare_runs`` leaves the new run of a pair out of it."""
    from harness.studies import history

    path = runs / "history.jsonl"
    path.unlink(missing_ok=True)
    for run_dir in plain:
        history.append(path, run_dir)
    return path


def measured_drift(runs: Path) -> dict:
    """The run-to-run drift of the plain runs' throughput: the pooled spread of each cell's run medians (log),
    the part of it the repeats explain ((pi / 2) s^2 / r for a median of r repeats spread s), and what is left."""
    import numpy as np

    from harness.results.metrics import metrics_for
    from harness.results.stats import log_spread
    from harness.results.store import read_trials
    from harness.results.tables import cell_values

    rounds = json.loads((runs / "index.json").read_text())["rounds"]
    plain = [read_trials(d[k]) for d in rounds for k in ("A", "B")]
    metric = next(m for m in metrics_for("host") if m.key == "throughput")
    sizes = sorted({r.batch_size for r in plain[0]})
    cells = [[cell_values(run, metric, "planted", bs) for run in plain] for bs in sizes]
    medians = log_spread([[float(np.median(v)) for v in runs_ if v] for runs_ in cells])
    within = log_spread([v for runs_ in cells for v in runs_])
    repeats = float(np.median([len(v) for runs_ in cells for v in runs_]))
    if medians is None or within is None:
        return {}
    explained = MEDIAN_SE * within[0] / repeats ** 0.5
    left = max(0.0, medians[0] ** 2 - explained ** 2) ** 0.5
    return {"runs": len(plain), "repeats": repeats, "medians_pct": 100 * np.expm1(medians[0]),
            "within_pct": 100 * np.expm1(within[0]), "explained_pct": 100 * np.expm1(explained),
            "drift_pct": 100 * np.expm1(left)}


def evaluate(runs: Path, threshold: float, with_history: bool, drift_pct: float = DEFAULT_DRIFT_PCT) -> list[dict]:
    """False-alarm and detection counts over every pair (see the module docstring); ``with_history``: each
    comparison also gets the run-to-run spread of the plain runs; ``drift_pct``: the drift assumed without one."""
    rounds = json.loads((runs / "index.json").read_text())["rounds"]
    plain = [d[k] for d in rounds for k in ("A", "B")]
    history_file = history_of_plain_runs(runs, plain) if with_history else None
    label = " with history" if with_history else f", drift {drift_pct:g} % assumed"

    def compare(a: str, b: str):
        return compare_runs(a, b, threshold, history_file=history_file, drift_pct=drift_pct)

    alarms = sum(compare(a, b)[1]["regressions"] > 0 for a, b in itertools.combinations(plain, 2))
    n_pairs = len(plain) * (len(plain) - 1) // 2
    rows = [{"pairs": f"plain vs plain{label} (false alarms)", "n": n_pairs, "any": alarms, "caught": None,
             "resolvable": compare(plain[0], plain[1])[1].get("resolvable", {})}]
    for kind in ("slow10", "slow30"):
        pairs = [compare(a, b) for a, b in itertools.product(plain, [d[kind] for d in rounds])]
        rows.append(_detection(f"plain vs {kind[4:]} % slower{label}", pairs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="/tmp/compare-runs", help="where the runs go (kept)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", default="32,128")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD_PCT)
    parser.add_argument("--drift-pct", type=float, default=DEFAULT_DRIFT_PCT,
                        help="the run-to-run drift compare assumes without a history (0: the repeats alone)")
    parser.add_argument("--evaluate-only", action="store_true", help="compare the runs already in --runs")
    parser.add_argument("--interleaved", action="store_true",
                        help="one run a round with plain and slowed rows side by side, compared inside the run")
    args = parser.parse_args(argv)
    runs = Path(args.runs)
    if not args.evaluate_only:
        runs.mkdir(parents=True, exist_ok=True)
        collect_runs = collect_interleaved if args.interleaved else collect
        collect_runs(runs, args.rounds, args.repeats, [int(b) for b in args.batch_sizes.split(",")])
    interleaved = json.loads((runs / "index.json").read_text()).get("interleaved", False)
    rows = (evaluate_interleaved(runs, args.threshold) if interleaved else
            evaluate(runs, args.threshold, False, args.drift_pct) + evaluate(runs, args.threshold, True))
    n_rounds = len(json.loads((runs / "index.json").read_text())["rounds"])
    print(f"{n_rounds} rounds of {'one run of 4 rows' if interleaved else '4 runs'}; threshold {args.threshold:g} %\n")
    print("| pairs | n | compare failed (any regression) | 95 % interval | slowed throughput caught at every batch "
          "size | 95 % interval |")
    print("| --- | ---: | ---: | --- | ---: | --- |")
    for row in rows:
        caught = "" if row["caught"] is None else f"{row['caught']}/{row['n']}"
        print(f"| {row['pairs']} | {row['n']} | {row['any']}/{row['n']} ({100 * row['any'] / row['n']:.0f} %) | "
              f"{_interval(row['any'], row['n'])} | {caught} | "
              f"{'' if row['caught'] is None else _interval(row['caught'], row['n'])} |")
    for row in rows:
        if row.get("resolvable", {}).get("Throughput"):
            r = row["resolvable"]["Throughput"]
            spreads = ", ".join(f"{k} {r[k]:.1f} %" for k in ("within_pct", "between_pct", "drift_pct")
                                if r.get(k) is not None)
            print(f"\n{row['pairs']}: the first pair's comparison could resolve throughput changes of "
                  f"{r['pct']:.0f} % or more ({spreads}; {r['repeats']} repeats)")
    drift = {} if interleaved else measured_drift(runs)
    if drift:
        print(f"\nrun-to-run drift of the {drift['runs']} plain runs' throughput: cell medians spread "
              f"{drift['medians_pct']:.1f} %, their {drift['repeats']:g} repeats (spread {drift['within_pct']:.1f} %) "
              f"explain {drift['explained_pct']:.1f} %, the drift beyond them {drift['drift_pct']:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())

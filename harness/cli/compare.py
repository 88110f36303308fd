"""``harness compare BASE NEW`` (or ``BASE --rows A B``): noise-aware verdicts; exit 1 on a regression."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness.cli.common import EXIT_USAGE, summary_console


def add_parser(sub: Any) -> None:
    compare = sub.add_parser("compare", help="compare two runs, or two rows of one run (--rows); exit 1 on a "
                                             "regression beyond the threshold")
    compare.add_argument("base_run", help="the baseline run (with --rows: the one run)")
    compare.add_argument("new_run", nargs="?", help="the new run (not with --rows)")
    compare.add_argument("--rows", nargs=2, metavar=("BASE_ROW", "NEW_ROW"),
                         help="compare two rows of one run, e.g. the baseline and the candidate as two framework "
                              "entries of one spec, interleaved: the machine's run-to-run drift then falls on both")
    compare.add_argument("--threshold", type=float, default=5.0, metavar="PCT",
                         help="percent change that counts as a regression (default 5)")
    compare.add_argument("--alpha", type=float, default=0.05, metavar="P",
                         help="the chance of any false alarm allowed in one comparison of runs of the same code "
                              "(default 0.05)")
    compare.add_argument("--history", metavar="FILE",
                         help="a history file (run --history): the run-to-run spread of its last runs of the spec on "
                              "this device joins the noise")
    compare.add_argument("--history-runs", type=int, default=10, metavar="N",
                         help="how many of the newest history runs (default 10)")
    compare.add_argument("--drift-pct", type=float, default=None, metavar="PCT",
                         help="without a history: the run-to-run drift of throughput assumed between the two runs "
                              "(default 5, measured on a shared 2-core VM; 0: the repeats alone are the noise)")
    compare.add_argument("--out", help="write the Markdown here (default: NEW_RUN/compare-<base run>.md; with --rows "
                                       "RUN/compare-rows.md)")
    compare.set_defaults(handler=handle)


def _usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments themselves, before a run is read (and before compare's statistics are
    imported, about a second: a wrong command line answers at once)."""
    if not 0 < args.alpha < 1:
        return f"--alpha must be between 0 and 1, not {args.alpha:g}"
    if args.rows and (args.new_run or args.history or args.drift_pct is not None):
        return "--rows compares two rows of one run: give one run and no --history or --drift-pct"
    if not args.rows and not args.new_run:
        return "give two runs, or one run and --rows BASE_ROW NEW_ROW"
    if args.drift_pct is not None and args.drift_pct < 0:
        return f"the drift must be 0 or more percent, not {args.drift_pct:g}"
    return None


def handle(args: argparse.Namespace) -> int:
    if (problem := _usage_error(args)) is not None:
        print(f"harness compare: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from rich.table import Table

    from harness.studies.compare import (
        compare_rows,
        compare_runs,
        resolvable_lines,
        to_markdown,
    )

    try:
        if args.rows:
            rows, summary = compare_rows(args.base_run, args.rows[0], args.rows[1], args.threshold, alpha=args.alpha)
            default_out = Path(args.base_run) / "compare-rows.md"
        else:
            rows, summary = compare_runs(args.base_run, args.new_run, args.threshold, alpha=args.alpha,
                                         history_file=args.history, history_runs=args.history_runs,
                                         **({} if args.drift_pct is None else {"drift_pct": args.drift_pct}))
            default_out = Path(args.new_run) / f"compare-{Path(args.base_run).name}.md"
    except (FileNotFoundError, ValueError) as err:
        print(f"harness compare: {err}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out) if args.out else default_out
    out.write_text(to_markdown(rows, summary), encoding="utf-8")
    table = Table(title=f"{summary['base']} -> {summary['new']} (threshold {args.threshold:g}%)")
    for title in ("framework", "batch", "metric", "base", "new", "change %", "noise", "verdict"):
        table.add_column(title, justify="right" if title in ("batch", "base", "new", "change %") else "left")
    for r in rows:
        style = "bold red" if r.verdict == "regression" else None
        table.add_row(r.framework, str(r.batch_size), r.metric, "" if r.base is None else f"{r.base:,.2f}",
                      "" if r.new is None else f"{r.new:,.2f}",
                      "" if r.change_pct is None else f"{r.change_pct:+.1f}", r.noise, r.verdict, style=style)
    summary_console().print(table)
    for missing in summary["missing"]:
        print(f"missing or failed on one side: {missing}")
    for line in resolvable_lines(summary):
        print(line[2:])
    print(f"{summary['regressions']} regression(s); comparison: {out}")
    return 1 if summary["regressions"] else 0

"""``harness report RUN_DIR``: (re)write a run's report; with a second run and ``--html``, both side by side."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness.cli.common import EXIT_USAGE, print_summary, summary_console


def add_parser(sub: Any) -> None:
    report = sub.add_parser("report", help="(re)write report.md, report.html and plots/ of a run directory; with "
                                           "two runs and --html, a page with both side by side")
    report.add_argument("run_dir", help="the run (with a second run: the base)")
    report.add_argument("new_run", nargs="?", help="a second run to set beside the first (needs --html)")
    report.add_argument("--html", action="store_true", help="with two runs: write NEW_RUN/compare-<base>.html")
    report.add_argument("--threshold", type=float, default=5.0, metavar="PCT",
                        help="with two runs: compare's regression threshold (default 5)")
    report.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from harness.results import report

    if args.new_run is not None:
        return _pair(args)
    try:
        data = report.build(args.run_dir)
    except FileNotFoundError as err:
        print(f"harness report: {err}", file=sys.stderr)
        return EXIT_USAGE
    path = report.write(args.run_dir, data)
    print_summary(data, summary_console())
    print(f"report: {path}")
    return 0


def _pair(args: argparse.Namespace) -> int:
    """``harness report BASE NEW --html``: compare's verdicts and both runs side by side in one HTML page."""
    from harness.results.pair import render_pair
    from harness.studies.compare import compare_runs, to_markdown

    if not args.html:
        print("harness report: two runs need --html (a page with both side by side)", file=sys.stderr)
        return EXIT_USAGE
    try:
        rows, summary = compare_runs(args.run_dir, args.new_run, args.threshold)
        page = render_pair(Path(args.run_dir), Path(args.new_run), to_markdown(rows, summary))
    except (FileNotFoundError, ValueError) as err:
        print(f"harness report: {err}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.new_run) / f"compare-{Path(args.run_dir).name}.html"
    out.write_text(page, encoding="utf-8")
    print(f"{summary['regressions']} regression(s); page: {out}")
    return 0

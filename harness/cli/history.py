"""``harness history``: the trend of a metric over the runs in a history file, as a PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness.cli.common import EXIT_USAGE, str_list


def add_parser(sub: Any) -> None:
    history = sub.add_parser("history", help="plot the trend of a metric over the runs in a history file")
    history.add_argument("--file", default="results/history.jsonl", help="default: results/history.jsonl")
    history.add_argument("--metric", default="throughput",
                         help="throughput, seconds_per_epoch, accuracy, memory or util (default throughput)")
    history.add_argument("--frameworks", type=str_list, help="only these frameworks")
    history.add_argument("--batch-sizes", type=lambda t: [int(x) for x in str_list(t)], help="only these sizes")
    history.add_argument("--out", default=None, help="PNG path (default: next to the history file)")
    history.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from harness.studies import history

    try:
        out = history.plot(args.file, args.metric, args.out or Path(args.file).with_suffix(f".{args.metric}.png"),
                           args.frameworks, args.batch_sizes)
    except (ValueError, FileNotFoundError) as err:
        print(f"harness history: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"plot: {out}")
    return 0

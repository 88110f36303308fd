"""``harness max-batch SPEC --framework NAME``: its parser; the command is ``harness.studies.max_batch.command``."""

from __future__ import annotations

import argparse
from typing import Any

from harness.cli.common import OFFLINE_HELP


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive")
    return sizes


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``max-batch SPEC --framework NAME [--memory-limit-mb X] [--margin F] [--data-parallel N] [--run-checks K]
    [--with-dataset] [--out DIR] ...``."""
    tolerance = 0.05  # harness.studies.max_batch.search.DEFAULT_TOLERANCE, not imported to keep startup light
    run_checks = 2  # harness.studies.max_batch.runcheck.RUN_CHECKS
    parser = subparsers.add_parser(
        "max-batch", help="find the largest batch size that fits the memory cap (one worker per probe)",
        description="Probes batch sizes, each in its own worker: two small ones, then where the line peak memory "
                    "= fixed + per-sample x batch through the sizes that fit reaches the cap, narrowing the bracket "
                    "to the limit. The answer is ok in two probes; a size seen both fitting and running out of "
                    "memory is reported as 'fits sometimes', never as the answer. The recommendation keeps a margin "
                    "below it and holds in every run check made of it (the spec's trial as `harness run` runs it), "
                    "searched downward until one holds. Exit 0 with the result, 1 when a probe failed otherwise "
                    "than out of memory, 2 for a bad spec or arguments.")
    parser.add_argument("spec", help="a YAML spec, e.g. specs/max_batch.yaml")
    parser.add_argument("--framework", required=True, help="pytorch, tensorflow, mxnet (or a registered adapter)")
    parser.add_argument("--memory-limit-mb", type=float, help="the cap (MB = 10^6 bytes); default: the spec's "
                                                              "memory_limit_mb, else the device's memory")
    parser.add_argument("--margin", type=_fraction,
                        help="fraction of the limit kept free in the recommendation (default: twice the spread of "
                             "the peak across the answer's probes)")
    parser.add_argument("--tolerance", type=_fraction, default=tolerance,
                        help=f"stop when the bracket is within this fraction (default {tolerance})")
    parser.add_argument("--initial-sizes", type=_sizes,
                        help="small sizes probed first (default: 16 and 64, whose peaks give the fixed and "
                             "per-sample bytes)")
    parser.add_argument("--max-batch", type=int, help="the largest size to try")
    parser.add_argument("--with-dataset", action="store_true",
                        help="probe with the spec's real dataset resident, as in a run (default: synthetic data of "
                             "the dataset's shape, as many samples as a run holds); sizes are then at most the "
                             "training set's")
    parser.add_argument("--data-parallel", type=int, metavar="N",
                        help="the largest per-device batch on N devices (on the CPU N logical devices), each probe "
                             "one data-parallel trial; reports the global batch, N x it (default: the spec's "
                             "data_parallel, else one device)")
    parser.add_argument("--run-checks", type=_count, default=run_checks,
                        help=f"run checks of the recommendation: the spec's trial as `harness run` runs it, each in "
                             f"a fresh worker (default {run_checks}; 0: confirm it in two probes instead)")
    parser.add_argument("--device", help="cpu or cuda:N (default: the spec's device)")
    parser.add_argument("--timeout", type=float, help="seconds per probe (default: the spec's timeout_s)")
    parser.add_argument("--out", default="results", help="folder that receives the run directory (default: results)")
    parser.add_argument("--offline", action="store_true", help=OFFLINE_HELP)
    parser.set_defaults(handler=handle)
    return parser


def handle(args: argparse.Namespace) -> int:
    from harness.cli.common import load_spec
    from harness.studies.max_batch import command

    spec = load_spec(args.spec, offline=args.offline)  # checked, its dataset fetched or decoded, before any probe
    return command.run(args, spec)

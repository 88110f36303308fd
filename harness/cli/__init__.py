"""Command line: ``python -m harness run|report|compare|export|schema|history|env|max-batch|envs`` (also installed as
``harness``). One module per command, each with its parser (``add_parser``) and handler (``handle``); nothing is
computed here. Imports are made inside the handlers so that ``--help`` and a bad argument answer at once.

Exit status: 0 on success (a sweep whose trials failed still succeeds: failures are results); 2 for a bad spec or
bad arguments, with one line on standard error and no traceback; 1 when ``compare`` finds a regression; 3 when a
``run`` had no trial that ended ok and at least one in error, crashed or timeout; 128 + the signal's number when a
run is interrupted (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
"""

from __future__ import annotations

import argparse
import sys

from harness.cli import advise, compare, env, envs, export, history, max_batch, report, run, schema
from harness.cli.common import EXIT_NOTHING_RAN, EXIT_USAGE

__all__ = ["EXIT_NOTHING_RAN", "EXIT_USAGE", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``harness`` argument parser: one subcommand per module of this package, each with its ``handler``."""
    parser = argparse.ArgumentParser(prog="harness", description="Batch-size benchmarks across PyTorch, TensorFlow, "
                                                                 "MXNet and JAX: throughput, utilization, memory, "
                                                                 "accuracy.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (run, report, compare, export, schema, history, env, max_batch, advise, envs):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: sys.argv[1:]), runs the command and returns its exit status."""
    args = build_parser().parse_args(argv)
    from harness.results.schema import SchemaError
    from harness.spec import SpecError

    try:
        return args.handler(args)
    except SpecError as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, SchemaError) as err:  # --resume of a directory that is not a run, or a newer one
        print(f"harness {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException as exc:
        from harness.studies.sweep import Interrupted

        if not isinstance(exc, (KeyboardInterrupt, Interrupted)):
            raise
        return _interrupted(exc)


def _interrupted(exc: BaseException) -> int:
    """Ctrl-C, SIGTERM or SIGHUP during a run: the worker is already gone and run.json says what finished; write the
    report of what finished and exit 128 + the signal's number (130, 143, 129)."""
    import signal
    from pathlib import Path

    from harness.results import report as reports

    signum = getattr(exc, "signum", signal.SIGINT)
    run_dir = getattr(exc, "run_dir", None)
    trials = Path(run_dir) / "trials.jsonl" if run_dir is not None else None
    if run_dir is None or trials is None:
        what = "before the run directory was made: nothing was run"
    elif not trials.exists() or not trials.stat().st_size:
        what = f"before any trial finished: nothing is in {trials} yet; continue with --resume {run_dir}"
    else:
        try:
            what = f"finished trials are in {trials}; report of them: {reports.write(run_dir)}"
        except Exception as err:  # noqa: BLE001 - the interruption is the news, a report failure only a detail
            what = f"finished trials are in {trials}; their report failed ({type(err).__name__}: {err})"
        what += f"; continue with --resume {run_dir}"
    print(f"interrupted by {signal.Signals(signum).name}: {what}", file=sys.stderr)
    return 128 + int(signum)

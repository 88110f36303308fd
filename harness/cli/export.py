"""``harness export RUN_DIR``: a run's tidy tables as CSV, Parquet or JSON, or the run logged to MLflow."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harness.cli.common import EXIT_USAGE


def add_parser(sub: Any) -> None:
    export = sub.add_parser("export", help="a run's tidy tables as CSV, Parquet or JSON files")
    export.add_argument("run_dir")
    export.add_argument("--format", default="csv", help="csv (default), parquet (needs pyarrow) or json")
    export.add_argument("--out", help="folder for the files (default: RUN_DIR/export)")
    export.add_argument("--mlflow", action="store_true", help="log the run to MLflow instead: a parent run for the "
                                                              "sweep, a child run per trial (needs mlflow)")
    export.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else an SQLite "
                                               "store beside the run directories, mlflow.db)")
    export.add_argument("--experiment", help="MLflow experiment (default: the spec's name)")
    export.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from harness.results import export
    from harness.results.data import load_run

    try:
        run = load_run(args.run_dir)
        if args.mlflow:
            from harness.results.mlflow_export import export_run

            done = export_run(run, args.tracking_uri, args.experiment)
            print(f"MLflow experiment {done.experiment_id}, parent run {done.parent_run_id}: {len(done.created)} "
                  f"trial run(s) logged, {len(done.existing)} already there")
            return 0
        paths = export.write(run, args.format, args.out)
    except ValueError as err:  # a format, pyarrow or mlflow missing, a newer schema
        print(f"harness export: {err}", file=sys.stderr)
        return EXIT_USAGE
    for path in paths:
        print(path)
    return 0

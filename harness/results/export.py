"""``harness export RUN --format csv|parquet|json``: a run's tidy tables as files, for tools that do not read the
run directory: ``trials`` (``Run.trials``, one row per trial), ``epochs`` (one row per trial and epoch), ``summary``
(the report's cells, one row per metric, row and batch size) and ``samples`` (every trial's sampler series, one row
per sample, with the trial's ``id`` and the ``phase``).

CSV through pandas' ``to_csv`` (no index); JSON as an array of records (``DataFrame.to_json(orient="records")``,
NaN written as null); Parquet through pyarrow (``DataFrame.to_parquet``), an optional extra: ``pip install -e
.[parquet]``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.results.data import Run

FORMATS = ("csv", "parquet", "json")
TABLES = ("trials", "epochs", "summary", "samples")


def all_samples(run: Run) -> pd.DataFrame:
    """Every trial's samples in one frame, ``id`` first; trials without a samples file (skipped, unsupported, or
    lost) contribute no rows."""
    frames = []
    for trial in run.trials["id"]:
        try:
            frame = run.samples(trial)
        except FileNotFoundError:
            continue
        frames.append(frame.assign(id=trial)[["id", *frame.columns]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["id", "t", "t_s", "phase"])


def tables(run: Run) -> dict[str, pd.DataFrame]:
    return {"trials": run.trials, "epochs": run.epochs, "summary": run.summary(), "samples": all_samples(run)}


def write(run: Run, fmt: str, out: str | Path | None = None) -> list[Path]:
    """Writes each table of ``TABLES`` as ``<out>/<table>.<fmt>`` (``out`` defaults to ``<run>/export``) and
    returns the paths. Raises ValueError for an unknown format and for Parquet without pyarrow (one line saying
    what to install)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError("Parquet needs pyarrow: pip install -e '.[parquet]' (or pip install pyarrow)") from None
    folder = Path(out) if out is not None else run.path / "export"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, frame in tables(run).items():
        path = folder / f"{name}.{fmt}"
        if fmt == "csv":
            frame.to_csv(path, index=False)
        elif fmt == "json":
            frame.to_json(path, orient="records", indent=1)
        else:
            _parquet_ready(frame).to_parquet(path, index=False)
        paths.append(path)
    return paths


def _parquet_ready(frame: pd.DataFrame) -> pd.DataFrame:
    """Parquet needs one type per column: object columns that mix types (``edge``: None or a string) become
    strings, keeping missing values missing."""
    out = frame.copy()
    for column in out.columns:
        if out[column].dtype == object:
            out[column] = out[column].map(lambda v: None if v is None or (isinstance(v, float) and v != v) else str(v))
    return out

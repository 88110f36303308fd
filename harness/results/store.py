"""The run directory: ``run.json``, ``trials.jsonl`` and the raw samples, written so that nothing finished is lost.

Layout of ``results/<UTC time>-<spec name>/``:

- ``run.json``: the spec as run, the environment (see ``harness.measure.machine``), the harness version, the start time.
- ``trials.jsonl``: one JSON object per finished trial (any status), appended, flushed and fsynced before the next
  trial starts. A crash can leave at most a torn last line, which ``read_trials`` ignores.
- ``samples/<trial id>.jsonl``: every sampler sample (``t`` = time.monotonic() seconds, then the metrics), and
  ``events/<trial id>.jsonl``: the worker's events (phases, epochs, result).
- ``report.md`` and ``plots/*.png``: written by ``harness report``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.results.schema import SchemaError, check_version


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True, default=str)


def create_run_dir(root: str | os.PathLike[str], spec_name: str, now: datetime | None = None) -> Path:
    """Creates ``root/<YYYYmmddTHHMMSSZ>-<spec name>`` (with a numeric suffix if that exists) and returns it."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for suffix in ("", *(f"-{i}" for i in range(2, 1000))):
        path = root / f"{stamp}-{spec_name}{suffix}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a run directory for {spec_name} under {root}")


def write_json(path: Path, value: Any) -> None:
    """Writes JSON atomically (a temporary file renamed over the target)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def append_line(path: Path, row: dict[str, Any]) -> None:
    """Appends one JSON line to ``path`` and forces it to disk (flush + fsync) before returning."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(_dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def append_trial(run_dir: Path, record: dict[str, Any]) -> None:
    """Appends one trial record to the run's trials.jsonl, on disk before this returns."""
    append_line(run_dir / "trials.jsonl", record)


def drop_torn_tail(path: Path) -> bool:
    """Repairs the end of a JSON-lines file after a crash, so that appends continue on a clean line: a last line that
    does not parse (a write cut short) is removed; a whole record missing only its newline gets one. Returns True
    when a line was removed."""
    if not path.exists() or not (raw := path.read_bytes()):
        return False
    complete, newline, tail = raw.rpartition(b"\n")
    if not tail:  # the file ends with a newline: check its last line
        complete, newline, tail = complete.rpartition(b"\n")
        ending = b"\n"
    else:
        ending = b""
    try:
        json.loads(tail)
    except ValueError:
        fixed, removed = complete + newline, True
    else:
        fixed, removed = raw + (b"\n" if not ending else b""), False
    if fixed != raw:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(fixed)
        os.replace(tmp, path)
    return removed


def write_lines(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Writes rows as JSON lines (creating the parent folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(_dumps(row) + "\n")


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Reads JSON lines; a torn (unparseable) last line from a crash is ignored, a torn earlier line is an error."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return rows


def read_trials(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The finished trials of a run, in the order they finished. Raises SchemaError (one line) for a record written
    with a newer schema than this harness reads (``harness.results.schema``)."""
    path = Path(run_dir) / "trials.jsonl"
    records = read_lines(path)
    for number, record in enumerate(records, 1):
        check_version(record, f"{path}: record {number} ({record.get('id', '?')})")
    return records


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """run.json of a run directory. Raises FileNotFoundError when it is not a run directory, SchemaError when it was
    written with a newer schema than this harness reads or is not JSON."""
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no run.json)")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise SchemaError(f"{path}: not valid JSON ({err})") from None
    check_version(info, str(path))
    return info

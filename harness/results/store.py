"""The run directory: ``run.json``, ``trials.jsonl`` and the raw samples, written so that nothing finished is lost,
and read back as typed records (``harness.record``) through one loader: ``read_run``, ``read_trials`` and
``read_events`` (``harness.results.data.load_run`` builds its frames on them).

Layout of ``results/<UTC time>-<spec name>/``:

- ``run.json``: a ``RunRecord``: the spec as run, the environment (see ``harness.measure.machine``), the harness
  version, the start time, the sessions; created and changed only through ``RunFile``.
- ``trials.jsonl``: one ``TrialRecord`` per finished trial (any status), appended, flushed and fsynced before the next
  trial starts. A crash can leave at most a torn last line, which ``read_trials`` ignores.
- ``samples/<trial id>.jsonl``: every sampler sample (``t`` = time.monotonic() seconds, then the metrics in the
  sampler's names), and ``events/<trial id>.jsonl``: the worker's events (phases, epochs, result).
- ``report.md`` and ``plots/*.png``: written by ``harness report``.

Records of older schema versions are read through ``harness.record.legacy`` (their names mapped to this version's);
a newer version, or a record that is not one, is a one-line ``SchemaError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harness.record import legacy
from harness.record.events import Event, event_data
from harness.record.run import RunRecord
from harness.record.trial import TrialRecord
from harness.record.version import SchemaError, check_version


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


def append_trial(run_dir: Path, record: TrialRecord) -> None:
    """Appends one trial record to the run's trials.jsonl, on disk before this returns."""
    append_line(run_dir / "trials.jsonl", record.data())


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


def _invalid(where: str, err: ValidationError) -> SchemaError:
    first = err.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(the record)"
    return SchemaError(f"{where}: not a valid record ({err.error_count()} problem(s); {field}: {first['msg']})")


def read_trials(run_dir: str | os.PathLike[str]) -> list[TrialRecord]:
    """The finished trials of a run, in the order they finished, as this version's records (older versions mapped
    by ``harness.record.legacy``). Raises SchemaError (one line) for a record written with a newer schema than this
    harness reads, or one that is not a trial record."""
    path = Path(run_dir) / "trials.jsonl"
    records = []
    for number, data in enumerate(read_lines(path), 1):
        where = f"{path}: record {number} ({data.get('id', '?') if isinstance(data, dict) else '?'})"
        version = check_version(data, where)
        try:
            records.append(legacy.trial(data, version))
        except ValidationError as err:
            raise _invalid(where, err) from None
    return records


def read_run(run_dir: str | os.PathLike[str]) -> RunRecord:
    """run.json of a run directory, as this version's record. Raises FileNotFoundError when it is not a run
    directory, SchemaError when it was written with a newer schema than this harness reads or is not a run.json."""
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no run.json)")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise SchemaError(f"{path}: not valid JSON ({err})") from None
    version = check_version(info, str(path))
    try:
        return legacy.run(info, version)
    except ValidationError as err:
        raise _invalid(str(path), err) from None


def write_events(path: Path, events: Iterable[Event]) -> None:
    """A trial's events as JSON lines (``harness.record.events.event_data``)."""
    write_lines(path, (event_data(event) for event in events))


def read_events(run_dir: str | os.PathLike[str], trial: str) -> list[Event]:
    """The worker's events of one trial (``events/<id>.jsonl``), typed (an older run's names mapped by
    ``harness.record.legacy.event``); raises FileNotFoundError naming the file."""
    path = Path(run_dir) / "events" / f"{trial}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no events for trial {trial}")
    return [legacy.event(row) for row in read_lines(path)]


class RunFile:
    """A run's ``run.json``, created and changed through here only: ``create`` writes the first record, ``update``
    reads the current one, applies a change (a ``RunRecord`` method: ``session``, ``interrupt``, ``resume``,
    ``finish``) and writes the result atomically."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)

    @classmethod
    def create(cls, run_dir: str | os.PathLike[str], record: RunRecord) -> RunFile:
        made = cls(run_dir)
        made._write(record)
        return made

    def read(self) -> RunRecord:
        return read_run(self.run_dir)

    def update(self, change: Callable[[RunRecord], RunRecord]) -> RunRecord:
        record = change(self.read())
        self._write(record)
        return record

    def _write(self, record: RunRecord) -> None:
        write_json(self.run_dir / "run.json", RunRecord.model_validate(record.data()).data())

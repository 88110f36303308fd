"""The schema version of a run directory: ``SCHEMA_VERSION`` (written into run.json and every trial record) and the
check every reader makes (``check_version``).

Versions: 0 is every run written before the schema was versioned (no ``schema_version`` field); 1 added
``schema_version``; 2 types every field the worker writes and puts each unit in its field's name with one suffix
convention (``harness.record.units``). A reader of this harness reads versions 0 to 2, older ones through
``harness.record.legacy`` (the one place that maps old names to new), and refuses a newer one in one line
(``SchemaError``) rather than misreading fields it does not know.
"""

from __future__ import annotations

from typing import Any

#: The version this harness writes (run.json's and each trial record's ``schema_version``).
SCHEMA_VERSION = 2


class SchemaError(ValueError):
    """A run directory this harness cannot read: written by a newer harness, or not a run directory. The message is
    one line naming the file, the version found and what to do."""


def check_version(value: Any, where: str) -> int:
    """The schema version of a run.json or trial record (0 when it has none). Raises SchemaError for a version newer
    than ``SCHEMA_VERSION`` or one that is not a whole number; ``where`` names the file in the message."""
    version = value.get("schema_version", 0) if isinstance(value, dict) else 0
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise SchemaError(f"{where}: schema_version {version!r} is not a version this harness knows")
    if version > SCHEMA_VERSION:
        raise SchemaError(f"{where}: written with schema version {version}; this harness reads versions 0 to "
                          f"{SCHEMA_VERSION}: upgrade the harness (pip install -U) to read it")
    return version

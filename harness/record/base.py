"""The two kinds of record model: ``Strict`` where the harness itself writes every field (the worker's metrics, the
trial record, run.json's own fields: an unknown key is an error, a misspelt one fails the trial that wrote it), and
``Open`` where another layer's data passes through (the sampler's description of its backend, a framework's settings:
the known fields typed, the rest kept as they came)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Every field typed; unknown keys are errors (extra="forbid")."""

    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """Known fields typed; fields another layer adds are kept (extra="allow")."""

    model_config = ConfigDict(extra="allow")

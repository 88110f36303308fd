"""Framework adapters: the registry of their declarations (``adapters.declaration.Declaration``).

Importing this package imports no framework: ``get(name)`` imports an adapter's module only when a trial needs it.
Extra adapters (used by the test suite for fault injection, or by a user's own framework) are registered through the
environment variable ``HARNESS_ADAPTERS``: a comma-separated list of ``name=module:Class``. It is inherited by worker
processes, so the same names resolve there. What a built-in adapter lacks for a trial is decided at plan time from
its declaration; an adapter added through ``HARNESS_ADAPTERS`` is decided in its worker, before ``build``.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from adapters import jax, keras, mxnet, pytorch, tensorflow
from adapters.base import Adapter, DeviceUnavailable, data_parallel_gap, execution_gap, input_gap, support_gap
from adapters.declaration import Declaration

if TYPE_CHECKING:
    from harness.neutral.models import ModelInfo

__all__ = ["Adapter", "BUILTIN", "Declaration", "DeviceUnavailable", "attention", "available_names", "declaration",
           "backends", "get", "records", "unsupported", "with_backend"]

#: The built-in adapters' declarations by name, one line per framework (the order reports list them in).
BUILTIN: dict[str, Declaration] = {d.name: d for d in (
    pytorch.DECLARATION,
    tensorflow.DECLARATION,
    mxnet.DECLARATION,
    jax.DECLARATION,
    *keras.DECLARATIONS,
)}


def records() -> tuple[Declaration, ...]:
    """The built-in adapters' declarations, in the registry's order."""
    return tuple(BUILTIN.values())


def backends(family: str) -> list[str]:
    """The backends the built-in adapters of ``family`` ("keras") run on, in the registry's order; [] for a name that
    is no family."""
    return [record.backend for record in BUILTIN.values() if record.family == family]


def with_backend(family: str, backend: str) -> str | None:
    """The name of the built-in adapter of ``family`` on ``backend`` (``{name: keras, backend: jax}`` ->
    "keras-jax"), or None when there is none."""
    return next((r.name for r in BUILTIN.values() if r.family == family and r.backend == backend), None)


def declaration(name: str) -> Declaration | None:
    """The declaration of the built-in adapter ``name``; None for an unknown name and for a name that
    ``HARNESS_ADAPTERS`` registers (its worker reads its class)."""
    return None if name in _extra() else BUILTIN.get(name)


def attention(name: str) -> str:
    """What the adapter ``name``'s attention keeps (``Adapter.ATTENTION``), without importing its framework: its
    declaration's for a built-in adapter, the contract's default ("unfused") for an adapter of ``HARNESS_ADAPTERS``
    (its worker reads the class itself)."""
    record = declaration(name)
    return record.attention if record is not None else Adapter.ATTENTION


def _extra() -> dict[str, str]:
    extra: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in os.environ.get("HARNESS_ADAPTERS", "").split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ValueError(f"HARNESS_ADAPTERS entry {item!r} is not name=module:Class")
        extra[name.strip()] = target.strip()
    return extra


def _targets() -> dict[str, str]:
    return {**{name: record.adapter for name, record in BUILTIN.items()}, **_extra()}


def available_names() -> list[str]:
    """Names a spec may list under ``frameworks`` (built-in ones first)."""
    return list(_targets())


def get(name: str) -> type[Adapter]:
    """The adapter class for ``name``; imports its module (and so its framework) now. Raises KeyError for an
    unknown name, ImportError when the framework is not installed and TypeError when the target is no Adapter."""
    target = _targets()[name]
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise TypeError(f"{target} is not an Adapter subclass")
    return cls


def unsupported(name: str, info: ModelInfo, precision: str = "fp32", compile: str = "default",
                device: str = "cpu", data_parallel: int = 1, sync_batchnorm: bool = False,
                input: str = "resident") -> str | None:
    """Why the adapter ``name`` cannot train ``info`` in ``precision`` with ``compile`` on ``device``, decided
    without importing its framework, on ``data_parallel`` devices (with ``sync_batchnorm``), fed by ``input``: the
    reason (``adapters.base.support_gap``, then ``execution_gap``, ``data_parallel_gap``, ``input_gap``) for a
    built-in adapter that lacks something, else None (also for an adapter of ``HARNESS_ADAPTERS`` that replaces a
    built-in name or is not one: its worker decides)."""
    record = declaration(name)
    if record is None:
        return None
    return support_gap(name, record.layers, record.tasks, info) or execution_gap(
        name, record.precisions, record.compile_modes, record.default_compile, precision, compile, device,
        record.notes) or data_parallel_gap(record, info, data_parallel, sync_batchnorm, device) or input_gap(
        record, input, data_parallel)

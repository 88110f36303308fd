"""Framework adapters: the registry of their declarations (``adapters.declaration.Declaration``).

Importing this package imports no framework: ``get(name)`` imports an adapter's module only when a trial needs it.
Extra adapters (used by the test suite for fault injection, or by a user's own framework) are registered through the
environment variable ``HARNESS_ADAPTERS``: a comma-separated list of ``name=module:Class``. It is inherited by worker
processes, so the same names resolve there. What an adapter lacks for a trial is decided by
``harness.plan.support`` from its declaration: at plan time for a built-in adapter, in its worker (where its class
is imported) for one added through ``HARNESS_ADAPTERS``.
"""

from __future__ import annotations

import importlib
import os

from adapters import jax, keras, mxnet, pytorch, tensorflow
from adapters.base import Adapter, DeviceUnavailable
from adapters.declaration import Declaration

__all__ = ["Adapter", "BUILTIN", "Declaration", "DeviceUnavailable", "attention", "available_names", "declaration",
           "backends", "declarations", "get", "with_backend"]

#: The built-in adapters' declarations by name, one line per framework (the order reports list them in).
BUILTIN: dict[str, Declaration] = {d.name: d for d in (
    pytorch.DECLARATION,
    tensorflow.DECLARATION,
    mxnet.DECLARATION,
    jax.DECLARATION,
    *keras.DECLARATIONS,
)}


def declarations() -> tuple[Declaration, ...]:
    """The built-in adapters' declarations, in the registry's order."""
    return tuple(BUILTIN.values())


def backends(family: str) -> list[str]:
    """The backends the built-in adapters of ``family`` ("keras") run on, in the registry's order; [] for a name that
    is no family."""
    return [d.family.backend for d in BUILTIN.values() if d.family.name == family]


def with_backend(family: str, backend: str) -> str | None:
    """The name of the built-in adapter of ``family`` on ``backend`` (``{name: keras, backend: jax}`` ->
    "keras-jax"), or None when there is none."""
    return next((d.name for d in BUILTIN.values() if d.family.name == family and d.family.backend == backend), None)


def declaration(name: str) -> Declaration | None:
    """The declaration of the built-in adapter ``name``; None for an unknown name and for a name that
    ``HARNESS_ADAPTERS`` registers (its worker reads its class)."""
    return None if name in _extra() else BUILTIN.get(name)


def attention(name: str) -> str:
    """What the adapter ``name``'s attention keeps (``Capabilities.attention``), without importing its framework: its
    declaration's for a built-in adapter, the contract's default ("unfused") for an adapter of ``HARNESS_ADAPTERS``
    (its worker reads the class itself)."""
    declared = declaration(name)
    return declared.capabilities.attention if declared is not None else "unfused"


def _extra() -> dict[str, str]:
    extra: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in os.environ.get("HARNESS_ADAPTERS", "").split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ValueError(f"HARNESS_ADAPTERS entry {item!r} is not name=module:Class")
        extra[name.strip()] = target.strip()
    return extra


def _targets() -> dict[str, str]:
    return {**{name: declared.adapter for name, declared in BUILTIN.items()}, **_extra()}


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

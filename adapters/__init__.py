"""Framework adapters and their lazy registry.

Importing this package imports no framework: ``get(name)`` imports an adapter's module only when a trial needs it.
Extra adapters (used by the test suite for fault injection, or by a user's own framework) are registered through the
environment variable ``HARNESS_ADAPTERS``: a comma-separated list of ``name=module:Class``. It is inherited by worker
processes, so the same names resolve there.
"""

from __future__ import annotations

import importlib
import os

from adapters.base import Adapter, DeviceUnavailable

__all__ = ["Adapter", "DeviceUnavailable", "available_names", "get", "BUILTIN"]

BUILTIN: dict[str, str] = {
    "pytorch": "adapters.pytorch:PyTorchAdapter",
    "tensorflow": "adapters.tensorflow:TensorFlowAdapter",
    "mxnet": "adapters.mxnet:MXNetAdapter",
    "jax": "adapters.jax:JaxAdapter",
}


def _extra() -> dict[str, str]:
    extra: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in os.environ.get("HARNESS_ADAPTERS", "").split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ValueError(f"HARNESS_ADAPTERS entry {item!r} is not name=module:Class")
        extra[name.strip()] = target.strip()
    return extra


def _targets() -> dict[str, str]:
    return {**BUILTIN, **_extra()}


def available_names() -> list[str]:
    """Names a spec may list under ``frameworks`` (built-in ones first)."""
    return list(_targets())


def get(name: str) -> type[Adapter]:
    """The adapter class for ``name``; imports its module (and so its framework) now. Raises KeyError for an
    unknown name and ImportError when the framework is not installed."""
    target = _targets()[name]
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise TypeError(f"{target} is not an Adapter subclass")
    return cls

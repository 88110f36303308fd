"""Framework adapters and their lazy registry.

Importing this package imports no framework: ``get(name)`` imports an adapter's module only when a trial needs it.
Extra adapters (used by the test suite for fault injection, or by a user's own framework) are registered through the
environment variable ``HARNESS_ADAPTERS``: a comma-separated list of ``name=module:Class``. It is inherited by worker
processes, so the same names resolve there.

``BUILTIN_SUPPORT`` is what each built-in adapter builds (its class's ``SUPPORTED_LAYERS`` and ``SUPPORTED_TASKS``,
kept here too so that a trial it cannot run is decided at plan time without importing the framework; a test reads
the adapters' sources to check that the two agree). An adapter added through ``HARNESS_ADAPTERS`` is decided in its
worker, before ``build``.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from adapters.base import (ALL_LAYERS, ALL_TASKS, BOTH, CUDA, Adapter, DeviceUnavailable, execution_gap,
                           support_gap)

if TYPE_CHECKING:
    from harness.neutral.models import ModelInfo

__all__ = ["Adapter", "BUILTIN", "BUILTIN_ATTENTION", "BUILTIN_EXECUTION", "BUILTIN_SUPPORT", "DeviceUnavailable",
           "PRECISION_NOTES", "attention", "available_names", "get", "unsupported"]

BUILTIN: dict[str, str] = {
    "pytorch": "adapters.pytorch:PyTorchAdapter",
    "tensorflow": "adapters.tensorflow:TensorFlowAdapter",
    "mxnet": "adapters.mxnet:MXNetAdapter",
    "jax": "adapters.jax:JaxAdapter",
}

#: (SUPPORTED_LAYERS, SUPPORTED_TASKS) of each built-in adapter: update it with the adapter's class attributes.
BUILTIN_SUPPORT: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "pytorch": (ALL_LAYERS, ALL_TASKS),
    "tensorflow": (ALL_LAYERS, ALL_TASKS),
    "mxnet": (ALL_LAYERS, ALL_TASKS),
    "jax": (ALL_LAYERS, ALL_TASKS),
}


#: (PRECISIONS, COMPILE_MODES, DEFAULT_COMPILE) of each built-in adapter: update it with the adapter's class
#: attributes (tests/test_support.py checks that they agree).
BUILTIN_EXECUTION: dict[str, tuple[dict[str, frozenset[str]], frozenset[str], str]] = {
    "pytorch": ({"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA}, frozenset({"eager", "compiled"}), "eager"),
    "tensorflow": ({"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA}, frozenset({"eager", "compiled"}),
                   "eager"),
    "mxnet": ({"fp32": BOTH, "fp16": CUDA}, frozenset({"eager", "compiled"}), "compiled"),
    "jax": ({"fp32": BOTH, "tf32": CUDA, "bf16": BOTH, "fp16": CUDA}, frozenset({"compiled"}), "compiled"),
}

#: ATTENTION of each built-in adapter (what its attention keeps for the backward pass, for
#: ``harness.neutral.memory.predict``): update it with the adapter's class attribute (tests/test_support.py checks).
BUILTIN_ATTENTION: dict[str, str] = {"pytorch": "fused", "tensorflow": "unfused", "mxnet": "unfused", "jax": "unfused"}


def attention(name: str) -> str:
    """What the adapter ``name``'s attention keeps (``Adapter.ATTENTION``), without importing its framework: the
    registry's for a built-in adapter, the contract's default ("unfused") for an adapter of ``HARNESS_ADAPTERS``
    (its worker reads the class itself)."""
    if name in BUILTIN_ATTENTION and name not in _extra():
        return BUILTIN_ATTENTION[name]
    return Adapter.ATTENTION


#: Why a built-in adapter does not train in a precision (where the declaration alone would not say): appended to the
#: ``unsupported`` reason, at plan time and in the worker alike (``adapters.base.execution_gap``).
_FP16_NOTE = ("fp16 with dynamic loss scaling is declared for CUDA GPUs only, by the harness's choice: the recipe "
              "exists for Tensor Cores, and a CPU run in fp16 answers no question this tool asks (README, precision)")
PRECISION_NOTES: dict[str, dict[str, str]] = {
    "pytorch": {"fp16": _FP16_NOTE},
    "tensorflow": {"fp16": _FP16_NOTE},
    "jax": {"fp16": _FP16_NOTE},
    "mxnet": {
        "fp16": _FP16_NOTE,
        "bf16": "MXNet 1.9.1 has bfloat16 convolution and dense kernels only in oneDNN, which creates them on "
                "AVX-512 CPUs only (on AVX2: 'could not create a primitive descriptor iterator'), and no bfloat16 dot "
                "or batch_dot on the CPU ('dot only supports float32/float64 for CPU')",
        "tf32": "MXNet 1.9.1 has no TF32 switch; its fp32 on a GPU runs with NVIDIA_TF32_OVERRIDE=0",
    },
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


def unsupported(name: str, info: "ModelInfo", precision: str = "fp32", compile: str = "default",
                device: str = "cpu") -> str | None:
    """Why the adapter ``name`` cannot train ``info`` in ``precision`` with ``compile`` on ``device``, decided
    without importing its framework: the reason (``adapters.base.support_gap``, then ``execution_gap``) for a
    built-in adapter that lacks something, else None (also for an adapter of ``HARNESS_ADAPTERS`` that replaces a
    built-in name or is not one: its worker decides)."""
    if name not in BUILTIN_SUPPORT or name in _extra():
        return None
    layers, tasks = BUILTIN_SUPPORT[name]
    precisions, modes, default = BUILTIN_EXECUTION[name]
    return support_gap(name, layers, tasks, info) or execution_gap(
        name, precisions, dict.fromkeys(modes, ""), default, precision, compile, device, PRECISION_NOTES.get(name))

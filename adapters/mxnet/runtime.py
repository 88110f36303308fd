"""MXNet 1.9.1 imported for the MXNet adapter's modules: import ``mx`` and its submodules from here, never ``mxnet``
first. And what libmxnet read from the environment when it loaded here (its thread counts: ``omp_threads``,
``thread_settings``)."""

from __future__ import annotations

import builtins
import os
import platform
import warnings
from typing import Any

import numpy as np

# What libmxnet saw when it loaded (during the import below): its OpenMP thread count is derived from these once.
_THREAD_ENV = ("OMP_NUM_THREADS", "MXNET_OMP_MAX_THREADS", "MXNET_CPU_WORKER_NTHREADS", "MXNET_ENGINE_TYPE")
_ENV_AT_IMPORT = {key: os.environ.get(key) for key in _THREAD_ENV}
_CPUS_AT_IMPORT = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

# MXNet 1.9.1 is the last release (the project was retired to the Apache Attic in 2023) and it references the numpy
# aliases that numpy 1.24 removed (np.bool, np.int, np.float, np.complex, np.object, np.str) at import time. Restore
# the missing ones, as the builtins they always aliased, before importing it. Probing them warns (FutureWarning on
# numpy 1.25+), hence the filter; importing MXNet itself raises DeprecationWarnings from numpy and distutils.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    for _alias in ("bool", "int", "float", "complex", "object", "str"):
        if not hasattr(np, _alias):
            setattr(np, _alias, getattr(builtins, _alias))
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    from mxnet.contrib import amp
    from mxnet.gluon import nn

__all__ = ["amp", "autograd", "gluon", "inter_op_threads", "mx", "nd", "nn", "omp_threads", "thread_settings"]


def omp_threads() -> int:
    """The OpenMP threads MXNet gives each operator, by its own rule (``OpenMP::OpenMP`` and
    ``GetRecommendedOMPThreadCount`` in src/engine/openmp.cc of MXNet 1.9.1): ``MXNET_OMP_MAX_THREADS`` if set, else
    ``OMP_NUM_THREADS`` if set, else the processor count, halved on x86 (MXNet's guess at hyper-threading)."""
    omp = _ENV_AT_IMPORT["OMP_NUM_THREADS"]
    count = int(omp.split(",")[0]) if omp and omp.split(",")[0].strip().isdigit() else None
    cap = _ENV_AT_IMPORT["MXNET_OMP_MAX_THREADS"]
    if cap and cap.strip().isdigit():
        return int(cap) if count is not None else min(int(cap), _CPUS_AT_IMPORT)
    if count is not None:
        return count
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return max(_CPUS_AT_IMPORT // 2, 1) if x86 else _CPUS_AT_IMPORT


def inter_op_threads() -> int:
    """The engine's worker threads per CPU context, ``MXNET_CPU_WORKER_NTHREADS`` (default 1)."""
    return int(_ENV_AT_IMPORT["MXNET_CPU_WORKER_NTHREADS"] or 1)


def thread_settings() -> dict[str, Any]:
    """The thread variables as libmxnet read them at import, for the record ("" where unset; the engine type's
    default is ThreadedEnginePerDevice)."""
    out: dict[str, Any] = {key: _ENV_AT_IMPORT[key] or "" for key in _THREAD_ENV}
    out["MXNET_ENGINE_TYPE"] = out["MXNET_ENGINE_TYPE"] or "ThreadedEnginePerDevice"
    return out

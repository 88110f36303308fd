"""JAX and optax imported for the JAX adapter's modules (``adapter``, ``neutral``, ``layers``, ``training``,
``inputs``): import them from here, never ``jax`` first, so that XLA's environment is set before JAX reads it.

Design: docs/design/framework-caveats.md#jax (memory and CPU threads).
"""

from __future__ import annotations

import os

from adapters.declaration import append_flags

# Before the import: otherwise JAX maps 75 % of GPU memory at its first use
# (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA's CPU client has no intra-op thread count: with one thread asked for (OMP_NUM_THREADS=1, which the launcher sets
# before this module is imported), Eigen's thread pool is turned off through XLA_FLAGS.
if os.environ.get("OMP_NUM_THREADS") == "1" and "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = append_flags(os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false")

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = ["jax", "jnp", "lax", "one_thread", "optax"]


def one_thread() -> bool:
    """Whether XLA's CPU client runs its ops on one thread (Eigen's pool turned off above)."""
    return "xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", "")

"""harness: train the same model under each framework of the adapters registry (PyTorch, TensorFlow, MXNet, JAX)
across batch sizes, and measure it honestly.

The core package never imports a framework; adapters (the top-level ``adapters`` package) do, in worker processes.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "Run", "load_run", "load_history"]


def __getattr__(name: str):
    """``harness.load_run`` and ``harness.load_history`` (``harness.results.data``), imported only when asked for:
    workers import this package in framework interpreters that need not have pandas."""
    if name in ("load_run", "load_history", "Run"):
        from harness.results import data

        return getattr(data, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")

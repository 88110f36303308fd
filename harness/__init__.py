"""harness: train the same model under each framework of the adapters registry (PyTorch, TensorFlow, MXNet, JAX)
across batch sizes, and measure it honestly.

The core package never imports a framework; adapters (the top-level ``adapters`` package) do, in worker processes.

This module is the public front door for code outside the harness: ``harness.run``, ``harness.max_batch`` and
``harness.advise`` (``harness.api``: the commands from Python), ``harness.load_run``, ``harness.load_history`` and
``harness.Run`` (``harness.results.data``), each imported only when asked for, and ``harness.__version__``. No module of
the harness or of the adapters imports it: they import the module that defines what they need
(``harness.version`` for the version), so this hook, which reaches up to ``harness.results``, closes no import circle
(tests/test_layout.py checks both).
"""

from harness.version import __version__

__all__ = ["__version__", "Run", "advise", "load_history", "load_run", "max_batch", "run"]


def __getattr__(name: str):
    """The public names that are imported only when asked for (PEP 562).

    Workers import this package in framework interpreters that need not have pandas, so nothing above
    ``harness.version`` is imported before a name is asked for.

    Args:
        name: ``run``, ``max_batch`` or ``advise`` (``harness.api``); ``load_run``, ``load_history`` or ``Run``
            (``harness.results.data``).

    Returns:
        The function or class of that name.

    Raises:
        AttributeError: any other name."""
    if name in ("load_run", "load_history", "Run"):
        from harness.results import data

        return getattr(data, name)
    if name in ("run", "max_batch", "advise"):
        from harness import api

        return getattr(api, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")

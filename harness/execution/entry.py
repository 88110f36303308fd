"""How a worker process is started: the command line that runs ``harness.execution.bootstrap.main`` in any
interpreter, and the mark of the environment probe's report: shared by the launcher, the ranks of a data-parallel
trial and the environment probe, none of which imports the bootstrap (which imports the worker)."""

from __future__ import annotations

from collections.abc import Sequence

from harness.spec.frameworks import ROOT

#: The mark of the environment probe's one report line (``harness.execution.environments``).
PROBE_PREFIX = "@harness-probe "
#: What ``-c`` runs in the worker's interpreter: ROOT (the folder holding the harness, its first argument) first on
#: ``sys.path`` (the harness need not be installed there), then the bootstrap, which ends the process through
#: ``os._exit`` (``harness.execution.bootstrap.exit_with``).
BOOTSTRAP = ("import sys; sys.path.insert(0, sys.argv[1]); "
             "from harness.execution.bootstrap import exit_with, main; exit_with(main)")


def worker_command(prefix: Sequence[str]) -> list[str]:
    """The command line of a worker behind ``prefix`` (an interpreter, or a command prefix ending in one):
    ``PREFIX -c BOOTSTRAP ROOT``."""
    return [*prefix, "-c", BOOTSTRAP, str(ROOT)]

"""Who owns the worker processes' starts: ``Workers``, the preloaded parents of forked workers
(``harness.execution.forkserver``), how each trial's worker starts (``start_mode``), the variables the harness sets
for a worker (``worker_settings``, and ``Workers.settings``: the one place that computes them for a trial, so that a
trial and its environment's probe find the same parent), and the probes run in children of those parents
(``Workers.probe_entries``).

Lifetime: explicit. Whoever makes a ``Workers`` closes it (``close``, or ``with``): the sweep makes one for its run
unless one is active already, ``harness max-batch`` one for its search; closing it ends every parent it started. While
it is entered (``with``) it is the *active* owner: ``harness.execution.launcher.run_worker`` forks from the active
owner's parents (or the one it is given); with none active a trial starts cold. The test suite enters one for its
whole session (tests/conftest.py), so that its parents serve every test instead of one sweep each; a sweep inside it
uses that one and leaves it open, except on Ctrl-C or SIGTERM, when every parent ends at once whoever owns it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from harness.execution import forkserver, probes
from harness.plan import Trial
from harness.spec import FrameworkEntry, Spec

__all__ = ["Workers", "active", "owner", "start_mode", "worker_settings"]

_ACTIVE: list[Workers] = []  # the owners entered and not yet left, innermost last
_LOCK = threading.Lock()


def active() -> Workers | None:
    """The innermost ``Workers`` entered (``with``) and not yet left, or None."""
    with _LOCK:
        return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def owner() -> Iterator[Workers]:
    """The active owner (``active``), or, with none, a new ``Workers`` entered for the block and closed at its end:
    what a sweep or a search forks its workers from."""
    current = active()
    if current is not None:
        yield current
        return
    with Workers() as made:
        yield made


def worker_settings(threads: int | None, base: dict[str, str] | None = None,
                    allocator: dict[str, Any] | None = None, framework: str | None = None) -> dict[str, str]:
    """The variables the harness sets for a worker of ``framework`` (an adapter's name): those of its declaration
    (``adapters.declaration``; none for an adapter of HARNESS_ADAPTERS, whose declaration this process never reads)
    and the generic ones any framework reads; with ``framework`` None, every built-in declaration's alike
    (``adapters.declarations``: a benchmark's environment for several). Thread counts (read at import, so the bootstrap
    sets them before any framework is imported: OpenMP's, MKL's, OpenBLAS's and the declaration's
    ``Environment.threads``), the allocator variables a spec sets (its ``Environment.allocator``), the
    declaration's ``Environment.variables`` defaults (a value in ``base`` wins), CUDA_DEVICE_ORDER=PCI_BUS_ID so
    CUDA's device numbers match NVML's (unless ``base`` sets another order), and the extra adapters of
    HARNESS_ADAPTERS. They travel in the payload too, since a container does not inherit the launcher's
    environment."""
    import adapters  # the registry of declarations: imports no framework

    base = dict(os.environ if base is None else base)
    env: dict[str, str] = {}
    allocator = allocator or {}
    if framework is None:
        declared = adapters.declarations()
    else:
        one = adapters.declaration(framework)
        declared = (one,) if one is not None else ()
    for declaration in declared:
        env.update({variable: str(allocator[option])
                    for option, variable in declaration.environment.allocator.items() if allocator.get(option)})
    env["CUDA_DEVICE_ORDER"] = base.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    for declaration in declared:
        env.update({variable: base.get(variable, value)
                    for variable, value in declaration.environment.variables.items()})
    env["PYTHONUNBUFFERED"] = "1"
    if base.get("HARNESS_ADAPTERS"):
        env["HARNESS_ADAPTERS"] = base["HARNESS_ADAPTERS"]
    if threads is not None:
        env.update(dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), str(threads)))
        for declaration in declared:
            env.update({variable: value.replace("{threads}", str(threads))
                        for variable, value in declaration.environment.threads.items()})
    return env


def start_mode(trial: Trial) -> str:
    """How ``trial``'s worker starts when an owner can fork it: "forked" from a preloaded parent when
    ``worker_start: auto``, the platform can, the entry is a plain interpreter (a prefix, a container, cannot receive
    the worker's streams) and the adapter declares ``fork_safe`` (of HARNESS_ADAPTERS: as its probe read it,
    ``probes.declared_fork_safe``); else "cold"."""
    import adapters  # the registry of declarations: imports no framework

    if trial.worker_start != "auto" or trial.command or not forkserver.forkable():
        return "cold"
    declaration = adapters.declaration(trial.framework)
    safe = declaration.start.fork_safe if declaration else probes.declared_fork_safe(trial.framework, trial.python)
    return "forked" if safe else "cold"


class Workers:
    """The preloaded parents one sweep or search forks its workers from (module docstring), at most ``limit`` at once
    (``forkserver.Servers``: one per interpreter, framework, environment and working folder). A context manager: while
    entered it is the active owner (``active``); leaving it closes it."""

    def __init__(self, limit: int = 6) -> None:
        self.servers = forkserver.Servers(limit)

    def __enter__(self) -> Workers:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        self.close()

    @staticmethod
    def settings(trial: Trial, threads: int | None, env: dict[str, str] | None = None) -> dict[str, str]:
        """The variables the harness sets for ``trial``'s worker (``worker_settings`` of its framework, of
        ``threads``, None: no thread counts, and of its allocator) with an executor's ``env`` over them: what its
        parent is keyed by, computed here alone for a trial and for its probe."""
        own = worker_settings(threads, allocator=trial.allocator.model_dump(), framework=trial.framework)
        return {**own, **(env or {})}

    def spawn(self, trial: Trial, settings: dict[str, str], stderr: Any) -> forkserver.Forked:
        """``trial``'s worker forked from its parent (started now if there is none), with ``settings``
        (``Workers.settings``) and standard error ``stderr``. Raises RuntimeError or OSError when it cannot."""
        return self._server(trial, settings).spawn(stderr)

    def _server(self, trial: Trial, settings: dict[str, str]) -> forkserver.Server:
        entry = FrameworkEntry(name=trial.framework, python=trial.python)
        return self.servers.get(entry.argv(), trial.framework, settings)

    def probe_runner(self, trials: list[Trial]) -> Callable[[FrameworkEntry], probes.ProbeRunner | None]:
        """For ``probes.probe_entries``'s ``via``: per framework entry, a runner of its probe in a child of the parent
        its first trial (of ``trials``, the planned ones) will fork from, started now so that the trial finds it;
        None where that trial starts cold. The probe then costs a fork instead of a second interpreter importing
        the framework."""

        def via(entry: FrameworkEntry) -> probes.ProbeRunner | None:
            trial = next((t for t in trials if t.label == entry.row), None)
            if trial is None or start_mode(trial) != "forked":
                return None
            settings = self.settings(trial, trial.threads)

            def run(code: str, args: list[str], timeout_s: float) -> tuple[int, str, str]:
                return self._server(trial, settings).probe(code, args, timeout_s)

            return run

        return via

    def probe_entries(self, spec: Spec, file: str | os.PathLike[str], device: str,
                      trials: list[Trial]) -> list[dict[str, Any]]:
        """``probes.probe_entries`` of ``spec`` for ``device``, each entry's probe in a child of the parent its
        first trial of ``trials`` will fork from (``probe_runner``)."""
        return probes.probe_entries(spec, file, device, via=self.probe_runner(trials))

    def close(self) -> None:
        """Ends every parent (each holds a framework's memory): all told at once, then each waited for. The owner
        can serve again after: a later trial starts a parent anew."""
        self.servers.close()

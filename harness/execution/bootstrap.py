"""How a worker starts in any interpreter, through any command prefix (a venv's python, ``taskset``, ``env``,
``docker run -i``, ``apptainer exec``, ``srun``): nothing but standard input, standard output and standard error
cross the prefix, so nothing else is relied on. The launcher runs ``PREFIX -c BOOTSTRAP ROOT``
(``harness.execution.entry``); ``main`` is the
worker's entry point (its docstring lists its steps: ``take_stdout``, the payload, ``watch_stdin`` and
``die_with_parent``, the trial). Imports only the standard library: it runs before the payload's environment is set.

Design: docs/guide/environments.md (the worker protocol across prefixes and containers).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn, TextIO

EXIT_ORPHANED = 70  # the launcher went away (standard input closed) before the trial ended


def take_stdout() -> TextIO:
    """A line-buffered text stream on the process's original standard output; fd 1 (and so ``sys.stdout`` and any C
    library's printf) now writes to standard error."""
    events = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    return events


def watch_stdin() -> threading.Thread:
    """A daemon thread that reads standard input to its end, then kills this process group (or this process where
    it leads no group)."""

    def orphaned() -> None:
        try:
            if os.getpgid(0) == os.getpid():
                os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(EXIT_ORPHANED)

    def watch() -> None:
        # The raw descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader aborts the
        # interpreter's shutdown ("could not acquire lock ... at interpreter shutdown").
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        orphaned()

    thread = threading.Thread(target=watch, name="harness-stdin-watch", daemon=True)
    thread.start()
    return thread


def die_with_parent(parent: int) -> bool:
    """Linux: SIGKILL this process when the thread that started it dies (prctl PR_SET_PDEATHSIG; man 2 prctl), when
    ``parent`` (the launcher's pid) is this process's parent; behind a prefix that stays (a wrapper script), in a
    container or behind a remote shell, only the standard-input watch (``watch_stdin``) reaches back to the launcher.
    True when it was set."""
    if os.getppid() != parent:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(EXIT_ORPHANED)
    return True


def exit_with(entry: Callable[[], int]) -> NoReturn:
    """Runs ``entry`` and ends the process with the status it returns (1 when it raised: the traceback on standard
    error; a ``SystemExit``'s code), through ``os._exit`` once standard output and error are flushed: a worker's
    events and a server's announcement are written by then, and what the interpreter's shutdown would add is only
    the frameworks' own teardown (module finalizers, ``atexit`` handlers: 0.2-2.3 CPU-s for JAX, PyTorch and
    TensorFlow on this project's CPU VM), which the launcher would otherwise wait for. ``atexit`` handlers of the
    harness that must run wrap ``os._exit`` (``harness.execution.limits``). The cold worker, the forked one and the
    fork server end so (``harness.execution.entry.BOOTSTRAP``, ``harness.execution.forkserver``)."""
    code = 1
    try:
        code = entry()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on standard error, the trial's log
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main() -> int:
    """The worker's entry point, called by ``BOOTSTRAP``, which puts ROOT (the folder that holds the harness) first
    on ``sys.path``, so the harness need not be installed in that interpreter. Returns the exit status. It

    1. keeps the real standard output for events and points file descriptor 1 at standard error, so whatever the
       framework prints (from Python or from C) goes to the log, never into the event stream; each event is one line
       ``harness.execution.protocol.EVENT_PREFIX`` + JSON and any other line on standard output (a wrapper's own
       chatter) is logged, not parsed;
    2. reads the payload (``harness.execution.protocol.Payload``), one JSON line, from standard input, and sets the
       environment variables it carries (thread counts, allocator settings, HARNESS_ADAPTERS) before numpy or any
       framework is imported: a container started by ``docker run`` does not inherit the launcher's environment; and
       pins the process to the payload's ``cpus`` (a parallel run's core set) the same way, before any thread exists;
    3. watches standard input, which the launcher keeps open: end of file means the launcher is gone (killed, or its
       machine's job cancelled), and the worker then kills its process group at once instead of training on (on
       Linux the kernel also kills it when its parent dies: PR_SET_PDEATHSIG, ``die_with_parent``);
    4. runs the trial (``harness.execution.worker.run``)."""
    events = take_stdout()
    line = sys.stdin.readline()
    if not line.strip():
        print("harness worker: no payload on standard input", file=sys.stderr)
        return 2
    payload = json.loads(line)
    os.environ.update({str(k): str(v) for k, v in (payload.get("env") or {}).items()})
    if payload.get("cpus") and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, payload["cpus"])  # before any framework starts a thread: they inherit the mask
    die_with_parent(int(payload.get("launcher_pid") or -1))
    watch_stdin()
    from harness.execution.worker import Events, run

    return run(payload, Events(events))

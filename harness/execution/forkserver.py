"""Fresh worker processes without the interpreter's and the framework's start-up: one preloaded parent per environment
that forks a child per trial.

The parent (``serve``, started behind the entry's interpreter like a worker, with the worker's environment) imports
what every worker of that framework imports, the harness's worker side and the adapter's module (so the framework),
and nothing more: no device is touched, no CUDA context made, no model built, no framework thread pool started by the
harness (a library's own pool started at import, OpenBLAS's for one, is re-created after fork by its own
``pthread_atfork`` handlers). For each trial it receives the worker's three standard streams over a Unix socket
(``SCM_RIGHTS``), forks, and the child becomes the trial's worker exactly as a cold start would be from the bootstrap
on (``harness.execution.bootstrap.main``): its own process and session, its own allocator and device state, the
payload read from its standard input. The parent reaps its children and reports each one's exit status back; it is
single-threaded, so that forking copies no lock another thread holds. It dies when the launcher that started it goes
(its standard input closes).

Which trials fork: those of a framework whose declaration says its imports are safe to fork from
(``Start.fork_safe``), run by a plain interpreter (no command prefix: a container cannot receive the streams),
on Linux; every other trial, and every trial of a spec with ``worker_start: cold``, starts cold. The record says which
(``TrialRecord.start``). Design and the isolation tests: docs/design/timing.md#where-a-trials-time-goes.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness.execution.entry import ROOT

#: What ``-c`` runs in the entry's interpreter to start a server: ROOT first on ``sys.path``, then ``serve``, ended
#: through ``os._exit`` as a worker is (``harness.execution.bootstrap.exit_with``: the preloaded framework's teardown
#: skipped).
SERVER = ("import sys; sys.path.insert(0, sys.argv[1]); "
          "from harness.execution.bootstrap import exit_with; from harness.execution.forkserver import serve; "
          "exit_with(lambda: serve(sys.argv[2], sys.argv[3]))")
READY_TIMEOUT_S = 300.0  # importing a framework can take a while on a loaded machine


def serve(socket_path: str, framework: str) -> int:
    """The parent's loop, in the entry's interpreter: preload, announce ``ready <pid>`` on standard output, then fork
    a child per connection until standard input closes (the launcher is gone: every child still running is killed).
    Returns the exit status."""
    import importlib

    import adapters
    import harness.execution.worker  # noqa: F401 - the worker side: numpy, pydantic, the harness's modules

    cls = adapters.get(framework)  # the adapter's module, and so the framework; nothing is made of it
    for module in cls.declaration.start.preload:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(0, selectors.EVENT_READ, "launcher")
    os.write(1, f"ready {os.getpid()}\n".encode())
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.data == "launcher":
                if not os.read(0, 4096):  # the launcher is gone: so are the trials it started here
                    for pid in children:
                        _kill(pid)
                    _remove_folder(socket_path)
                    return 0
                continue
            conn, _ = listener.accept()
            kind, fds, _, _ = socket.recv_fds(conn, 1024, 3)
            pid = os.fork()
            if pid == 0:
                _child(fds, [listener, conn], selector, kind == b"probe")  # never returns
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"pid {pid}\n".encode())
            except OSError:  # that launcher hung up before the answer: its child (no payload read yet, so no
                os.kill(pid, signal.SIGKILL)  # process of its own) goes, and the server serves on
            children[pid] = conn  # reaped below either way
        while children:  # reap: each child's exit status goes back to its launcher
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                conn = children.pop(pid)
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the launcher stopped waiting for it
                conn.close()


def _remove_folder(socket_path: str) -> None:
    """The server's folder (its socket and log, made by ``Server``) removed, by whichever side ends last: the server
    when its launcher is gone (a launcher killed by SIGKILL, by a cancelled job or the OOM killer, never closes it),
    ``Server.close`` otherwise (a server that died first cannot). Whatever is gone already is skipped."""
    folder = Path(socket_path).parent
    for path in (folder / "server.sock", folder / "server.log"):
        try:
            path.unlink()
        except OSError:
            pass
    try:
        folder.rmdir()
    except OSError:
        pass


def _child(fds: list[int], close: list[socket.socket], selector: selectors.BaseSelector, probe: bool = False) -> None:
    """In the forked child: a session of its own (the launcher kills the trial's process group), the trial's
    streams on 0, 1 and 2, default signal handling, then the bootstrap's ``main`` (or, for ``probe``,
    ``_run_probe``); exits without returning to the parent's loop (``bootstrap.exit_with``: ``os._exit``, the
    parent's finalizers are not the child's)."""
    from harness.execution import bootstrap

    def start() -> int:
        os.setsid()
        selector.close()
        for sock in close:
            sock.close()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        return _run_probe() if probe else bootstrap.main()

    bootstrap.exit_with(start)


def _run_probe() -> int:
    """In a forked child: the environment probe (``harness.execution.probes.PROBE``) as ``-c CODE ARGS...``
    would run it, from the request line on standard input (JSON: ``code``, ``argv``); its report goes to standard
    output. What it queries (a GPU, a model of your own) touches this child only, never the parent."""
    request = json.loads(sys.stdin.readline())
    sys.argv = ["-c", *request["argv"]]
    exec(compile(request["code"], "<probe>", "exec"), {"__name__": "__main__"})
    return 0


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Forked:
    """A child of a server, as the launcher sees it: what it needs of ``subprocess.Popen`` (``pid``, ``returncode``,
    ``poll``, ``wait``, ``stdin``, ``stdout``). Its exit status comes from the server, which reaped it (negative:
    killed by that signal, as Popen reports it)."""

    def __init__(self, conn: socket.socket, pid: int, stdin: Any, stdout: Any):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
            self._read(0.5 if left is None else min(left, 0.5))
        return self.returncode

    def _read(self, timeout: float) -> None:
        self._conn.settimeout(timeout if timeout > 0 else 0.0)
        try:
            chunk = self._conn.recv(4096)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the server went away without a status: the child was killed with it
            self.returncode = -signal.SIGKILL
            return
        self._buffer += chunk
        for line in self._buffer.split(b"\n"):
            if line.startswith(b"exit "):
                self.returncode = int(line.split()[1])
                self._conn.close()


class Server:
    """One preloaded parent (``serve``) behind ``argv`` (an interpreter) for ``framework``, started with ``env``
    (the worker's environment: thread counts and allocator settings are read when the framework is imported, so a
    server serves only trials of the same environment). Raises RuntimeError when it does not become ready."""

    def __init__(self, argv: list[str], framework: str, env: dict[str, str]):
        self.folder = tempfile.mkdtemp(prefix="harness-fork-")
        self.socket_path = str(Path(self.folder) / "server.sock")
        self.log = open(Path(self.folder) / "server.log", "w+b")
        self.proc = subprocess.Popen([*argv, "-c", SERVER, str(ROOT), self.socket_path, framework],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env={**os.environ, **env}, start_new_session=True)
        assert self.proc.stdout is not None
        line, _ = _read(self.proc.stdout, READY_TIMEOUT_S, line=True)
        if not line.startswith(b"ready "):
            self.log.seek(0)  # before close, which closes the log
            last = next((x for x in reversed(self.log.read().decode(errors="replace").splitlines()) if x.strip()), "")
            self.close()
            raise RuntimeError(f"the fork server for {framework} did not start: {last[:300]}")

    def spawn(self, stderr: Any, kind: bytes = b"trial") -> Forked:
        """A forked worker whose standard error is ``stderr`` (a file); its standard input and output are new
        pipes, whose other ends are returned as ``Forked.stdin`` (bytes, write) and ``Forked.stdout`` (read).
        ``kind`` b"probe": the child runs a probe request (``probe``) instead of a trial."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket_path)
            socket.send_fds(conn, [kind], [stdin_r, stdout_w, stderr.fileno()])
            line = b""
            while not line.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    raise RuntimeError("the fork server closed the connection before forking")
                line += chunk
        except BaseException:
            conn.close()
            for fd in (stdin_r, stdin_w, stdout_r, stdout_w):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, stdout_w):  # the child's ends: it holds them now
                try:
                    os.close(fd)
                except OSError:
                    pass
        pid = int(line.split()[1])
        return Forked(conn, pid, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"))

    def probe(self, code: str, argv: list[str], timeout_s: float) -> tuple[int, str, str]:
        """Runs ``code`` (a script that reads ``sys.argv[1:]``, the environment probe) in a forked child with
        ``argv``, as ``python -c code *argv`` would, but without the interpreter's and the framework's start-up.
        Returns its exit status, standard output and standard error (text). Raises subprocess.TimeoutExpired (the
        child killed) after ``timeout_s`` seconds, RuntimeError or OSError when the server cannot fork."""
        with tempfile.TemporaryFile() as err:
            child = self.spawn(err, b"probe")
            assert child.stdin is not None and child.stdout is not None
            try:
                child.stdin.write((json.dumps({"code": code, "argv": argv}) + "\n").encode())
                child.stdin.close()
                out, ended = _read(child.stdout, timeout_s)
                if not ended:
                    raise subprocess.TimeoutExpired("the probe", timeout_s)
                status = child.wait(timeout=max(1.0, timeout_s))
            except BaseException:
                _kill(child.pid)
                raise
            finally:
                child.stdout.close()
            err.seek(0)
            return status, out.decode(errors="replace"), err.read().decode(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def end(self) -> None:
        """Tells the server to end (its standard input closed: it kills the children still running and exits) without
        waiting for it: ``close`` waits."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        """Ends the server (``end``) and waits for it, at most 10 s before it is killed."""
        self.end()
        try:
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            _kill(self.proc.pid)
            self.proc.wait()
        self.log.close()
        _remove_folder(self.socket_path)  # already gone if the server removed it


#: Variables left out of a server's key: they change while a process runs and mean nothing to a worker (pytest
#: names the test running in PYTEST_CURRENT_TEST).
UNKEYED_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


class Servers:
    """The servers of one owner (``harness.execution.workers.Workers``), one per (interpreter, framework,
    environment, working folder), started on first use and ended by ``close`` (the owner's). The key holds the
    whole environment a server starts with (this process's, then the launcher's settings) and the working folder,
    since its children inherit both: a changed variable or folder gets a new server. At most ``limit`` run at once
    (each holds a framework's memory): starting one more ends the least recently used. Thread-safe: parallel
    executors launch from threads."""

    def __init__(self, limit: int = 6) -> None:
        self._servers: dict[str, Server] = {}
        self._lock = threading.Lock()
        self.limit = limit

    def get(self, argv: list[str], framework: str, env: dict[str, str]) -> Server:
        """The running server for this key, started now if there is none (or it died). Raises RuntimeError."""
        environment = {k: v for k, v in {**os.environ, **env}.items() if k not in UNKEYED_VARIABLES}
        key = json.dumps([argv, framework, sorted(environment.items()), os.getcwd()])
        ended: list[Server] = []
        with self._lock:
            server = self._servers.pop(key, None)
            if server is None or not server.alive():
                if server is not None:
                    ended.append(server)
                while len(self._servers) >= self.limit:
                    ended.append(self._servers.pop(next(iter(self._servers))))
                server = Server(argv, framework, env)
            self._servers[key] = server  # the most recently used last
        for old in ended:
            old.close()
        return server

    def close(self) -> None:
        """Ends every server, all told at once, then each waited for."""
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.end()
        for server in servers:
            server.close()


def forkable() -> bool:
    """Whether this platform can fork workers from a server (Linux: fork, Unix sockets, passing descriptors)."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(os, "fork")


def _read(stream: Any, timeout_s: float, line: bool = False) -> tuple[bytes, bool]:
    """What ``stream`` gives until it closes or, for ``line``, through the first newline (read a byte at a time, so
    nothing after it is taken), and whether that end came within ``timeout_s`` seconds (False: what came before the
    deadline)."""
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while not (line and out.endswith(b"\n")):
            left = deadline - time.monotonic()
            if left <= 0:
                return out, False
            if selector.select(timeout=left):
                chunk = os.read(stream.fileno(), 1 if line else 65536)
                if not chunk:
                    break
                out += chunk
    finally:
        selector.close()
    return out, True

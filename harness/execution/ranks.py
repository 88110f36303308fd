"""The ranks of a multi-process data-parallel trial (one process per device, ``DataParallelism.kind ==
"processes"``): rank 0 is the worker the launcher started; it starts ranks 1..N-1 in its own interpreter with the
environment torchrun gives each rank (https://docs.pytorch.org/docs/stable/elastic/run.html#environment-variables),
and watches them: a rank that exits early or reports an error ends the whole trial. Standard library only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

#: The variables torchrun sets for each rank; ``rank_environment`` sets them all.
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "HARNESS_RANK_OF")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous port, ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of ``world`` processes on one node (the rendezvous at 127.0.0.1:
    ``port``), and ``HARNESS_RANK_OF`` ("rank/world") by which the harness's worker knows it is a rank it started."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
            "HARNESS_RANK_OF": f"{rank}/{world}"}


def this_rank() -> tuple[int, int] | None:
    """(rank, world) when this process is a rank started by ``Ranks`` (``HARNESS_RANK_OF``), else None."""
    value = os.environ.get("HARNESS_RANK_OF")
    if not value:
        return None
    rank, _, world = value.partition("/")
    return int(rank), int(world)


@dataclass
class RankFailure:
    """A rank that ended the trial: its rank, exit status (None: still running when it reported) and the last
    error event it printed (a ``harness.execution.protocol.Error`` record), if any."""

    rank: int
    returncode: int | None
    error: dict[str, Any] | None = None


@dataclass
class Ranks:
    """Ranks 1..world-1, started by rank 0 (``start``). Each runs ``argv`` with its ``rank_environment``, reads
    ``stdin_line`` (the payload) on standard input, which stays open so that a rank ends itself when rank 0 is gone
    (``harness.execution.bootstrap.watch_stdin``), and writes its events to standard output, read here.

    on_failure: called once, from a watcher thread, with the first rank that exits non-zero or reports an error
    event: the caller ends the trial (reports it, then kills the process group).
    """

    argv: Sequence[str]
    world: int
    stdin_line: str
    on_failure: Callable[[RankFailure], None]
    port: int = field(default_factory=free_port)
    env: dict[str, str] | None = None
    procs: dict[int, subprocess.Popen[str]] = field(default_factory=dict)
    _failed: bool = False
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        """Starts ranks 1..world-1 and a watcher thread per rank."""
        base = dict(os.environ if self.env is None else self.env)
        for rank in range(1, self.world):
            proc = subprocess.Popen(list(self.argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env={**base, **rank_environment(rank, self.world, self.port)})
            assert proc.stdin is not None
            proc.stdin.write(self.stdin_line.rstrip("\n") + "\n")
            proc.stdin.flush()
            self.procs[rank] = proc
            thread = threading.Thread(target=self._watch, args=(rank, proc), name=f"harness-rank-{rank}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _watch(self, rank: int, proc: subprocess.Popen[str]) -> None:
        error = None
        assert proc.stdout is not None
        for line in _lines(proc.stdout):
            record = _event(line)
            if record is not None and record.get("event") == "error":
                error = record
                break
        code = proc.wait() if error is None else proc.poll()
        if error is not None or code:
            self._fail(RankFailure(rank, code, error))

    def _fail(self, failure: RankFailure) -> None:
        with self._lock:
            if self._failed:
                return
            self._failed = True
        self.on_failure(failure)

    def close(self, timeout_s: float = 60.0) -> None:
        """After rank 0's training ended well, before it reports: waits up to ``timeout_s`` for the other ranks to end
        (an interpreter with a framework loaded takes about a second to exit, more on a loaded machine) and for their
        watchers, so a rank that failed ends the trial (``on_failure``) before rank 0 reports a result; then kills
        what is left, no longer a failure."""
        end = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for thread in self._threads:
            thread.join(timeout=max(0.0, end - time.monotonic()))
        with self._lock:
            self._failed = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _lines(stream: IO[str]) -> Any:
    while True:
        line = stream.readline()
        if not line:
            return
        yield line


def _event(line: str) -> dict[str, Any] | None:
    from harness.execution.protocol import EVENT_PREFIX

    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        record = json.loads(line[len(EVENT_PREFIX):])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None

"""harness.execution.bootstrap.exit_with: how a cold worker, a forked one and a fork server end: with the status
their entry returns, their output flushed, and without the interpreter's shutdown (the frameworks' finalizers and
atexit handlers), except what wraps ``os._exit`` (the memory report of harness.execution.limits)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.spec import ROOT

#: An atexit handler that says so when the interpreter shuts down normally (it must not, under exit_with).
PRELUDE = ("import atexit, os, sys; sys.path.insert(0, sys.argv[1])\n"
           "from harness.execution.bootstrap import exit_with\n"
           "atexit.register(lambda: print('atexit ran', flush=True))\n")


def _end(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + body, str(ROOT)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("body, status, stderr", [
    ("def entry():\n    print('result', end='')\n    sys.stderr.write('log')\n    return 7\n", 7, "log"),
    ("def entry():\n    raise ValueError('boom')\n", 1, "ValueError: boom"),
    ("def entry():\n    raise SystemExit(3)\n", 3, ""),
    ("def entry():\n    raise SystemExit()\n", 0, ""),
    ("def entry():\n    raise SystemExit('why')\n", 1, ""),
])
def test_the_process_ends_with_the_entrys_status_its_streams_flushed_and_no_shutdown(body, status, stderr):
    proc = _end(body + "exit_with(entry)\n")
    assert proc.returncode == status, proc.stderr
    assert "atexit ran" not in proc.stdout, proc.stdout  # the interpreter's shutdown was skipped
    assert stderr in proc.stderr
    if status == 7:  # written without a newline into buffered streams: flushed before os._exit
        assert (proc.stdout, proc.stderr) == ("result", "log")


def test_a_wrapped_os_exit_still_runs():
    """What must run at a worker's exit wraps ``os._exit`` (harness.execution.limits's memory report): exit_with
    looks ``os._exit`` up when it ends, so the wrapper runs, and then the process ends with the entry's status."""
    proc = _end("real = os._exit\n"
                "def reporting(status):\n    print('reported', status, flush=True)\n    real(status)\n"
                "os._exit = reporting\n"
                "exit_with(lambda: 5)\n")
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "reported 5\n"

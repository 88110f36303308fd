"""Fixtures of the sampler's tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture
def tree():
    """A real process with a child, as (pid, child pid): a worker's process tree (a worker and a rank it started)."""
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(c.pid, flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    yield proc.pid, child
    os.kill(child, 9)
    proc.kill()
    proc.wait()

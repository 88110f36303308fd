"""The host backend (psutil) on real processes: a live tree is read, an exited one gives no reading."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from harness.measure.host import HostBackend

NO_READING = {"cpu_percent": None, "rss_bytes": None, "rss_anon_bytes": None}


def test_a_live_worker_is_read_and_an_exited_one_gives_no_reading_not_zero():
    """A sample after the worker has exited (a short trial's deferred end sample) must not enter the windows'
    peaks as 0 bytes, neither while the process is a zombie (its /proc entry reads 0 bytes) nor once it is reaped:
    on 2026-11-27 such samples made the nightly compare see a 0 MB memory peak."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(30 << 20); sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    backend = HostBackend()
    try:
        backend.attach(proc.pid)
        live = backend.sample()
        assert live["rss_bytes"] > 0 and 0 < live["rss_anon_bytes"] <= live["rss_bytes"]
        assert live["cpu_percent"] is not None and live["cpu_percent"] >= 0
        proc.stdin.close()  # the child exits; not waited for, it stays a zombie
        deadline = time.monotonic() + 30
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert backend.sample() == NO_READING
    finally:
        proc.kill()
        proc.wait()
    assert backend.sample() == NO_READING
    backend.close()

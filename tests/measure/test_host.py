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
        time.sleep(0.06)  # a CPU figure needs MIN_RATE_S since its base
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


def test_cpu_use_is_never_a_rate_over_a_few_milliseconds():
    """Linux counts CPU time in 10 ms ticks: a rate over 1.2 ms read 875.8 % on 2 cores (2026-11-28). Samples
    closer than MIN_RATE_S to their base have no CPU figure, and the next one covers the whole time since; every
    figure agrees with the process's own CPU time and stays within what the machine's cores can do."""
    from harness.measure.host import MIN_RATE_S

    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    backend = HostBackend()
    try:
        time.sleep(0.2)
        backend.attach(proc.pid)
        t0, cpu0 = time.monotonic(), sum(psutil.Process(proc.pid).cpu_times()[:2])
        quick = [backend.sample()["cpu_percent"] for _ in range(20)]  # well under MIN_RATE_S apart
        assert quick == [None] * 20
        time.sleep(0.3)
        t1, cpu1 = time.monotonic(), sum(psutil.Process(proc.pid).cpu_times()[:2])
        figure = backend.sample()["cpu_percent"]
        expected = 100 * (cpu1 - cpu0) / (t1 - t0)  # ~100, less on a loaded machine
        assert figure is not None and abs(figure - expected) < 20, (figure, expected)
        assert figure <= 100 * psutil.cpu_count() + 100 * 0.01 / MIN_RATE_S
    finally:
        proc.kill()
        proc.wait()

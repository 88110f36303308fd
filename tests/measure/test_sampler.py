"""The sampler thread and its statistics: the host backend (psutil) on a real busy process, phase statistics over
timed windows, stopping, and samples taken at the windows' edges."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil
import pytest

from harness.measure import host as host_module
from harness.measure.energy import throttle_summary
from harness.measure.host import HostBackend
from harness.measure.sampler import DEFAULT_INTERVAL_S, MIN_EDGE_GAP_S, Sampler, interval_warning
from harness.measure.windows import phase_stats

BUSY = "import time\nx = bytearray(80_000_000)\nend = time.time() + 30\nwhile time.time() < end: pass\n"



def test_host_backend_lists_the_process_tree_at_most_once_per_refresh_period(monkeypatch):
    """Listing children walks /proc; between refreshes a sample reads only the known processes, and a child that
    appears is counted from the next refresh on."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    child = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        listed = []
        real = host_module.process_tree

        def counting(pid):
            listed.append(pid)
            return real(pid) + ([psutil.Process(child.pid)] if len(listed) > 1 else [])  # the child "appears" later

        monkeypatch.setattr(host_module, "process_tree", counting)
        backend = HostBackend(tree_refresh_s=0.3)
        backend.attach(parent.pid)
        time.sleep(0.5)  # the child allocates its 80 MB meanwhile
        first = [backend.sample() for _ in range(5)]  # the first lists again (0.3 s passed), the rest reuse it
        assert len(listed) == 2
        assert all(s["rss_bytes"] > 80e6 for s in first)  # parent + child
        time.sleep(0.1)
        backend.sample()
        assert len(listed) == 2
    finally:
        for proc in (parent, child):
            proc.kill()
            proc.wait()


def _cpu_seconds(pid):
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_host_backend_sees_a_busy_process_and_its_memory():
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        sampler = Sampler(HostBackend(), interval_s=0.05)
        time.sleep(0.5)  # let it allocate
        sampler.start(proc.pid)
        time.sleep(0.2)
        cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(1.0)
        cpu1, t1 = _cpu_seconds(proc.pid), time.monotonic()
        sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    samples = sampler.samples
    assert len(samples) >= 10
    stamps = [s["t"] for s in samples]
    assert stamps == sorted(stamps)
    stats = phase_stats(samples, [(t0, t1)])
    # one core spinning: ~100%, less on a loaded machine; the sampler must agree with the process's own CPU time
    expected = 100 * (cpu1 - cpu0) / (t1 - t0)
    assert expected > 20 and abs(stats["cpu_percent"]["mean"] - expected) < 20, (stats["cpu_percent"], expected)
    assert stats["rss_bytes"]["max"] > 80e6
    assert len(sampler.call_seconds) == len(samples) and all(0 <= c < 1 for c in sampler.call_seconds)


def test_phase_stats_only_counts_samples_inside_windows():
    samples = [{"t": float(t), "x": float(t)} for t in range(10)]
    stats = phase_stats(samples, [(2.0, 4.0), (8.0, 8.5)])
    assert stats["x"] == {"mean": (2 + 3 + 4 + 8) / 4, "median": 3.5, "max": 8.0, "count": 4, "scope": "windows"}
    assert phase_stats(samples, [(20.0, 21.0)])["x"] == {"mean": None, "median": None, "max": None, "count": 0,
                                                         "scope": "none"}


def test_phase_stats_falls_back_to_the_span_when_windows_are_shorter_than_the_interval():
    samples = [{"t": float(t), "x": float(t)} for t in range(10)]
    stats = phase_stats(samples, [(2.1, 2.2), (4.5, 4.6), (6.1, 6.3)])  # no sample inside any window
    assert stats["x"] == {"mean": 4.5, "median": 4.5, "max": 6.0, "count": 4, "scope": "span"}  # t = 3, 4, 5, 6


def test_phase_stats_leaves_out_the_counter_and_the_bitmask():
    samples = [{"t": float(t), "x": 1.0, "energy_mj": 1000 * t, "throttle_reasons": 4} for t in range(5)]
    assert set(phase_stats(samples, [(0.0, 4.0)])) == {"x"}


def test_throttle_summary_shares_each_reason():
    samples = [{"t": 1.0, "throttle_reasons": 0x4}, {"t": 2.0, "throttle_reasons": 0x4 | 0x40},
               {"t": 3.0, "throttle_reasons": 0x0}, {"t": 4.0, "throttle_reasons": None},
               {"t": 9.0, "throttle_reasons": 0x8}]  # outside the window
    summary = throttle_summary(samples, [(0.5, 4.5)])
    assert summary == {"count": 3, "scope": "windows", "any_mask": 0x44,
                       "share": {"sw_power_cap": 2 / 3, "hw_thermal_slowdown": 1 / 3}}
    assert throttle_summary([{"t": 1.0, "x": 1.0}], [(0.0, 2.0)]) is None


@pytest.mark.serial  # a bound on stop's wall time: alone, so that no test beside it stretches it
def test_sampler_stops_within_an_interval_even_with_a_slow_backend():
    class Slow(HostBackend):
        def sample(self):
            time.sleep(0.2)
            return {"cpu_percent": 1.0}

    sampler = Sampler(Slow(), interval_s=0.5)
    sampler.start(1)
    time.sleep(0.3)
    started = time.monotonic()
    assert sampler.stop() is True
    assert time.monotonic() - started < 0.5 + 0.2 + 0.1


@pytest.mark.serial  # a bound on stop's wall time (its join timeout): alone, for the same reason
def test_stop_while_a_backend_call_blocks_is_bounded_and_drops_the_late_sample():
    release = threading.Event()
    entered = threading.Event()

    class Stuck(HostBackend):
        def sample(self):
            entered.set()
            release.wait(10)
            return {"cpu_percent": 1.0}

    sampler = Sampler(Stuck(), interval_s=0.05)
    sampler.start(1)
    assert entered.wait(2)
    started = time.monotonic()
    assert sampler.stop(join_timeout_s=0.3) is False  # the call is still blocked: stop gives up
    assert 0.25 < time.monotonic() - started < 0.6
    assert "abandoned" in sampler.errors[-1]
    before = len(sampler.samples)
    release.set()  # the call returns after stop(): its sample must not land in the finished run
    sampler._thread.join(2)
    assert not sampler._thread.is_alive() and len(sampler.samples) == before == 0


def test_sampler_survives_a_backend_that_raises():
    class Broken(HostBackend):
        def sample(self):
            raise RuntimeError("driver went away")

    sampler = Sampler(Broken(), interval_s=0.05)
    sampler.start(1)
    time.sleep(0.2)
    sampler.stop()
    assert sampler.samples and sampler.errors[0] == "RuntimeError: driver went away"


def test_interval_warning_below_50_ms_only():
    assert interval_warning(DEFAULT_INTERVAL_S) is None and interval_warning(0.05) is None
    assert interval_warning(None) is None
    warning = interval_warning(0.01)
    assert warning is not None and "\n" not in warning and warning.startswith("0.01 s is below 50 ms")


# --- edge samples -------------------------------------------------------------------------------------------------

def test_poke_takes_a_tagged_sample_at_once():
    """A poke is sampled as soon as the sampler's thread runs, not at the next periodic sample: with periodic samples
    60 s apart, the tagged sample arrives (waited for, not timed) long before the next one is due."""
    sampler = Sampler(HostBackend(), interval_s=60.0)
    sampler.start(1)
    deadline = time.monotonic() + 30
    while not sampler.samples and time.monotonic() < deadline:  # the first periodic sample, at the start
        time.sleep(0.01)
    time.sleep(0.05)  # more than MIN_EDGE_GAP_S after it
    poked_at = time.monotonic()
    sampler.poke("end")
    while not any(s.get("edge") == "end" for s in sampler.samples) and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    edges = [s for s in sampler.samples if s.get("edge") == "end"]
    periodic = [s for s in sampler.samples if "edge" not in s]
    assert len(edges) == 1 and len(periodic) == 1, sampler.samples  # no periodic sample came between
    assert poked_at <= edges[0]["t"] < periodic[0]["t"] + 60.0
    assert "cpu_percent" in edges[0]


def test_pokes_closer_than_the_minimum_gap_are_dropped_and_a_dropped_end_is_deferred():
    sampler = Sampler(HostBackend(), interval_s=10.0)
    sampler.start(1)
    time.sleep(0.1)
    sampler.poke("start")
    sampler.poke("end")  # a window of almost no time: the end sample waits for the gap to pass
    sampler.poke("start")  # the next window opens at once: dropped
    sampler.poke("end")  # merges into the deferred end sample
    time.sleep(MIN_EDGE_GAP_S + 0.05)
    sampler.poke("start")  # far enough from the last edge sample: taken
    time.sleep(0.05)
    sampler.stop()
    assert [s.get("edge") for s in sampler.samples] == [None, "start", "end", "start"]
    start, end = sampler.samples[1]["t"], sampler.samples[2]["t"]
    assert MIN_EDGE_GAP_S - 0.002 <= end - start < MIN_EDGE_GAP_S + 0.03
    assert sampler.dropped_pokes == 3


def test_edge_samples_decide_membership():
    samples = [{"t": 1.0, "x": 100.0},             # before the window
               {"t": 2.01, "edge": "start", "x": 50.0},  # baseline: describes the time before the window
               {"t": 2.5, "x": 7.0},
               {"t": 3.02, "edge": "end", "x": 9.0},     # taken just after the end: describes the window
               {"t": 3.3, "x": 100.0},
               {"t": 4.0, "edge": "end", "x": 1.0}]      # an end sample too late for the window
    stats = phase_stats(samples, [(2.0, 3.0)])
    assert stats["x"]["count"] == 2 and stats["x"]["mean"] == 8.0 and stats["x"]["scope"] == "windows"


def test_edge_sampling_measures_a_window_shorter_than_the_interval():
    """A real busy process, a 0.3 s window, a 10 s interval: the end-edge sample alone describes the window."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        sampler = Sampler(HostBackend(), interval_s=10.0)
        time.sleep(0.3)
        sampler.start(proc.pid)
        time.sleep(0.05)
        start, cpu0 = time.monotonic(), _cpu_seconds(proc.pid)
        sampler.poke("start")
        time.sleep(0.3)
        end, cpu1 = time.monotonic(), _cpu_seconds(proc.pid)
        sampler.poke("end")
        time.sleep(0.05)
        sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    stats = phase_stats(sampler.samples, [(start, end)])
    assert stats["cpu_percent"]["count"] == 1 and stats["cpu_percent"]["scope"] == "windows"
    expected = 100 * (cpu1 - cpu0) / (end - start)  # ~100, less on a loaded machine
    assert expected > 20 and abs(stats["cpu_percent"]["mean"] - expected) < 25, (stats["cpu_percent"], expected)



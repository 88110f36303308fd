"""Workers forked from a preloaded parent per environment (harness.execution.forkserver) are fresh trials as cold-
started ones are: the same losses and accuracy from the same weights and batches, resident memory within noise; a
trial that runs out of memory, is killed or hangs leaves the next one of the same parent untouched; a data-parallel
trial's ranks start; a spec's ``worker_start: cold`` and a framework not declared fork-safe start cold; the record
says which path each trial took and where its time went. A GPU test checks that the parent never makes a CUDA
context."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from harness.execution import forkserver, launcher, probes, workers
from harness.execution.protocol import Payload
from harness.plan import checked_spec, plan
from harness.record.events import Ready
from harness.results import store
from harness.spec import FrameworkEntry
from harness.studies import sweep
from tests.helpers import ROOT, base_spec, report_text

ENVS = {fw: str(ROOT / "envs" / fw / "bin" / "python") for fw in ("pytorch", "tensorflow", "mxnet", "jax")}


def _run(tmp_path, name, **changes):
    data = base_spec(**{"frameworks": [{"name": fw, "python": python} for fw, python in ENVS.items()],
                        "batch_sizes": [64], "epochs": 2, "cpu_threads": 1, **changes})
    spec = checked_spec(data, tmp_path / f"{name}.yaml")
    run_dir = sweep.run_spec(spec, tmp_path / name)
    return {r.framework: r for r in store.read_trials(run_dir)}, run_dir


def test_a_forked_trial_trains_as_a_cold_one_in_every_framework(tmp_path, monkeypatch):
    """... and its environment's probe, run in a child of the parent the trial then forks from, reports what a
    fresh interpreter's probe reports."""
    asked: dict[str, list] = {"server": [], "cold": []}
    trials_from = []
    real_probe, real_spawn, real_run = forkserver.Server.probe, forkserver.Server.spawn, probes.subprocess.run

    def server_probe(self, code, args, timeout_s):
        asked["server"].append(self.proc.pid)
        return real_probe(self, code, args, timeout_s)

    def spawn(self, stderr, kind=b"trial"):
        if kind == b"trial":
            trials_from.append(self.proc.pid)
        return real_spawn(self, stderr, kind)

    def cold_probe(argv, *args, **kwargs):
        if probes._probe_code() in argv:
            asked["cold"].append(argv[0])
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(forkserver.Server, "probe", server_probe)
    monkeypatch.setattr(forkserver.Server, "spawn", spawn)
    monkeypatch.setattr(probes.subprocess, "run", cold_probe)
    monkeypatch.setattr(probes, "_CACHE", {})  # each run probes: none answered from an earlier one
    # both JAX trials compile their programs: one read from the tests' shared cache (tests/conftest.py) would leave
    # the compiler's memory out of the RSS compared below (CI: forked 176 MB, cold 132 MB after the forked one filled
    # the cache)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    forked, forked_dir = _run(tmp_path, "forked")
    assert len(asked["server"]) == len(ENVS) and asked["cold"] == [], asked
    assert sorted(trials_from) == sorted(asked["server"])  # each trial forked from the parent its probe ran in
    monkeypatch.setattr(probes, "_CACHE", {})
    cold, cold_dir = _run(tmp_path, "cold", worker_start="cold")
    assert len(asked["server"]) == len(ENVS) and sorted(asked["cold"]) == sorted(ENVS.values()), asked
    probed = [store.read_run(d).model_dump(mode="json")["frameworks"] for d in (forked_dir, cold_dir)]
    assert probed[0] == probed[1] and all(e["versions"] and e["packages"] for e in probed[0])
    for framework in ENVS:
        a, b = forked[framework], cold[framework]
        assert (a.status, b.status) == ("ok", "ok"), (a.reason, b.reason)
        assert (a.start, b.start) == ("forked", "cold"), framework
        # equal to float32 rounding: oneDNN may pick another kernel for another buffer alignment, so even two cold
        # TensorFlow trials now and then differ in a loss's last bit (seen once in ~10 runs, 1 ulp of the sum)
        assert [e.train_loss for e in a.metrics.epochs] == pytest.approx([e.train_loss for e in b.metrics.epochs],
                                                                         rel=1e-6), framework
        assert a.metrics.test_accuracy == b.metrics.test_accuracy, framework
        assert a.metrics.test_loss == pytest.approx(b.metrics.test_loss, rel=1e-6), framework
        # the report's CPU memory, anonymous RSS: the same process, as far as memory goes (the whole RSS is not: a
        # forked child faults in only the library pages it touches). Within 1 % on an idle machine (three runs, every
        # framework); JAX's varies with the load on the machine beside it: forked 176 MB, cold 198 MB in a fresh
        # clone's make test (2026-11-27), 182-187 MB both ways when idle; the others stayed within 0.5 %.
        rss_a, rss_b = a.sampler.stats["rss_anon_bytes"].max, b.sampler.stats["rss_anon_bytes"].max
        assert abs(rss_a / rss_b - 1) < (0.2 if framework == "jax" else 0.1), (framework, rss_a, rss_b)
        # what forking saves: the interpreter and the framework's import, not the trial's own work
        assert a.phases.import_s < 0.1 < b.phases.import_s, (framework, a.phases, b.phases)
        assert a.phases.total_s == pytest.approx(a.wall_s, abs=0.5)
    # the report says which path each row took
    for run_dir, path in ((forked_dir, "forked"), (cold_dir, "cold")):
        text = report_text(run_dir)
        assert all(f"| {title} | {path} | 1 |" in text for title in ("PyTorch", "TensorFlow", "MXNet", "JAX")), text


def _payload(tmp_path, **changes):
    data = {"frameworks": [{"name": "pytorch", "python": ENVS["pytorch"]}], "batch_sizes": [32], "epochs": 1,
            "cpu_threads": 1, **changes}
    spec = checked_spec(base_spec(**data), tmp_path / "s.yaml")
    (trial,) = plan(spec, "cpu")
    return Payload(trial=trial)


def test_an_oom_a_kill_and_a_hang_leave_the_next_forked_trial_untouched(tmp_path):
    """One parent serves every trial below: one runs out of memory under a cap, one is killed once ready, one is
    stopped at its timeout; each is recorded as what it was, and a trial after each trains as the first did."""
    payload = _payload(tmp_path)
    first = launcher.run_worker(payload, 120, None, "cpu", threads=1)
    assert (first.status, first.start) == ("ok", "forked"), first.reason
    # a dense layer of 3072 x 8000 weights, ~98 MB per copy: does not fit 150 MB at any batch size
    capped = _payload(tmp_path, memory_limit_mb=150, dataset={"name": "synthetic", "shape": [32, 32, 3], "classes": 10},
                      model={"layers": [{"type": "flatten"}, {"type": "dense", "units": 8000},
                                        {"type": "dense", "units": 10}]})
    oom = launcher.run_worker(capped, 120, None, "cpu", threads=1)
    assert (oom.status, oom.start) == ("oom", "forked"), oom.reason

    def kill_when_ready(event):
        if isinstance(event, Ready):
            os.kill(started.pop(), signal.SIGKILL)

    started = []
    original = launcher.forkserver.Server.spawn

    def spawn(self, stderr):
        child = original(self, stderr)
        started.append(child.pid)
        return child

    launcher.forkserver.Server.spawn = spawn
    try:
        killed = launcher.run_worker(payload, 120, None, "cpu", threads=1, on_event=kill_when_ready)
    finally:
        launcher.forkserver.Server.spawn = original
    assert (killed.status, killed.start) == ("crashed", "forked") and "SIGKILL" in killed.reason, killed.reason
    # 500 epochs take minutes: stopped at its timeout, its group killed
    hung = launcher.run_worker(_payload(tmp_path, epochs=500), 1.0, None, "cpu", threads=1)
    assert hung.status == "timeout", hung.reason
    after = launcher.run_worker(payload, 120, None, "cpu", threads=1)
    assert (after.status, after.start) == ("ok", "forked"), after.reason
    # the same training as the first trial's, to float32 rounding (see the every-framework test: 1.8867884982715954
    # against 1.886788715015758 was seen, a few ulps of a float32 sum)
    assert after.result().metrics.epochs[0].train_loss == pytest.approx(first.result().metrics.epochs[0].train_loss,
                                                                        rel=1e-6)
    workers.active().close()


def test_a_probe_the_parent_cannot_answer_runs_in_a_fresh_interpreter(monkeypatch):
    """A runner that fails (the parent did not start: the framework does not import there) or answers without a
    report: the probe starts the entry's interpreter as before, and that report is the one given."""
    entry = FrameworkEntry(name="pytorch", python=ENVS["pytorch"])
    monkeypatch.setattr(probes, "_CACHE", {})
    cold = probes.probe(entry)

    def failing(code, args, timeout_s):
        raise RuntimeError("the fork server for pytorch did not start: ModuleNotFoundError")

    for via in (failing, lambda code, args, timeout_s: (0, "no report\n", ""), lambda *_: None):
        monkeypatch.setattr(probes, "_CACHE", {})
        assert probes.probe(entry, via=via) == cold


def test_a_data_parallel_trial_forks_rank_0_and_starts_its_ranks(tmp_path):
    spec = checked_spec(base_spec(frameworks=[{"name": "pytorch", "python": ENVS["pytorch"]}], batch_sizes=[32],
                                  epochs=1, cpu_threads=2, data_parallel=2), tmp_path / "s.yaml")
    (record,) = store.read_trials(sweep.run_spec(spec, tmp_path / "runs"))
    assert (record.status, record.start, record.data_parallel) == ("ok", "forked", 2), record.reason
    assert record.settings["data_parallel"]["world_size"] == 2


def test_what_starts_cold(tmp_path, fault_adapter, monkeypatch):
    """A spec asking for cold starts, an adapter of HARNESS_ADAPTERS no probe has read, a command prefix: cold."""
    monkeypatch.setattr(probes, "_FORK_SAFE", {})
    assert workers.start_mode(_payload(tmp_path, worker_start="cold").trial) == "cold"
    assert workers.start_mode(_payload(tmp_path).trial) == "forked"
    spec = checked_spec(base_spec(frameworks=[fault_adapter]), tmp_path / "f.yaml")
    (trial,) = plan(spec, "cpu")
    assert workers.start_mode(trial) == "cold"
    prefixed = checked_spec(base_spec(frameworks=[{"name": "pytorch", "command": ["env", "{python}"]}]),
                            tmp_path / "p.yaml")
    (trial,) = plan(prefixed, "cpu")
    assert workers.start_mode(trial) == "cold"


def test_an_adapter_of_harness_adapters_forks_once_its_probe_has_read_its_declaration(tmp_path, monkeypatch,
                                                                                      fault_adapter):
    """HARNESS_ADAPTERS adapters are imported only in their workers' interpreters: cold until the entry's probe has
    read the class's ``Start.fork_safe`` there; then a declared fork-safe one (the fault adapter) forks, one
    that does not declare it (the data-parallel fault adapter) stays cold. A sweep probes first, so its trials fork
    and train as cold ones do."""
    from tests.fakes.fault_adapter import DATA_PARALLEL_REGISTRATION, REGISTRATION

    monkeypatch.setenv("HARNESS_ADAPTERS", f"{REGISTRATION},{DATA_PARALLEL_REGISTRATION}")
    monkeypatch.setattr(probes, "_CACHE", {})
    monkeypatch.setattr(probes, "_FORK_SAFE", {})
    specs, payloads = {}, {}
    for name in ("fault", "fault_dp"):
        specs[name] = checked_spec(base_spec(frameworks=[name], batch_sizes=[16, 32], epochs=2), tmp_path / f"{name}.y")
        payloads[name] = Payload(trial=plan(specs[name], "cpu")[0])
        assert workers.start_mode(payloads[name].trial) == "cold"  # nothing is known of its class yet
        probes.probe(FrameworkEntry(name=name))
    assert workers.start_mode(payloads["fault"].trial) == "forked"
    assert workers.start_mode(payloads["fault_dp"].trial) == "cold"
    spec = specs["fault"]
    forked = store.read_trials(sweep.run_spec(spec, tmp_path / "forked"))
    cold = store.read_trials(sweep.run_spec(spec.model_copy(update={"worker_start": "cold"}), tmp_path / "cold"))
    assert [(r.status, r.start) for r in forked] == [("ok", "forked")] * 2, [r.reason for r in forked]
    assert [(r.status, r.start) for r in cold] == [("ok", "cold")] * 2, [r.reason for r in cold]
    for a, b in zip(forked, cold):
        assert [e.train_loss for e in a.metrics.epochs] == [e.train_loss for e in b.metrics.epochs]
        assert a.metrics.test_accuracy == b.metrics.test_accuracy
        # the fault adapter's import is a few milliseconds either way (its parent preloads no framework): what
        # forking saves is the interpreter's start, which import_s alone left to the machine's noise (CI 2026-11-28:
        # forked 39 ms, cold 9 ms)
        assert a.phases.start_s + a.phases.import_s < b.phases.start_s + b.phases.import_s


@pytest.mark.gpu
def test_the_parent_never_makes_a_cuda_context(tmp_path, monkeypatch):
    """On a GPU: NVML lists no process of the parent's pid on any device after the environment's probe asked about
    cuda:0 in a child of it and a forked trial trained on cuda:0 (each child has its own context, gone with it)."""
    import pynvml

    # a GPU box has no envs/: there the interpreter that runs the tests holds PyTorch (scripts/gpu-check.sh)
    python = ENVS["pytorch"] if os.path.exists(ENVS["pytorch"]) else sys.executable
    spec = checked_spec(base_spec(frameworks=[{"name": "pytorch", "python": python}], batch_sizes=[32],
                                  epochs=1, device="cuda:0"), tmp_path / "s.yaml")
    (trial,) = plan(spec, "cuda:0")
    monkeypatch.setattr(probes, "_CACHE", {})
    entry = FrameworkEntry(name="pytorch", python=python)
    with workers.Workers() as owner:
        info = probes.probe(entry, device="cuda:0", via=owner.probe_runner([trial])(entry))
        assert info.get("device_problem") is None and len(owner.servers._servers) == 1, info.get("device_problem")
        outcome = launcher.run_worker(Payload(trial=trial), 300, None, "cuda:0")
        assert (outcome.status, outcome.start) == ("ok", "forked"), outcome.reason
        parents = {server.proc.pid for server in owner.servers._servers.values()}
        pynvml.nvmlInit()
        try:
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                users = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
                assert not users & parents, (index, users, parents)
        finally:
            pynvml.nvmlShutdown()


def test_a_jax_compilation_cache_is_an_option_the_report_records(tmp_path, monkeypatch):
    """Off by default; with ``compilation_cache`` the trials share JAX's persistent cache: the first fills it, the
    second's first step reads its programs instead of compiling them, and the record and report say so; one the
    environment sets (as tests/conftest.py does for the tests) is recorded and reported too."""
    from_tests = os.environ["JAX_COMPILATION_CACHE_DIR"]
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    cache = tmp_path / "cache"
    records, run_dir = _run(tmp_path, "cached", frameworks=[{"name": "jax", "python": ENVS["jax"]}], epochs=1,
                            repeats=2, compilation_cache=str(cache))
    first, second = sorted((r for r in store.read_trials(run_dir)), key=lambda r: r.repeat)
    assert (first.status, second.status) == ("ok", "ok")
    assert first.settings["compilation_cache_dir"] == str(cache) and any(cache.iterdir())
    assert second.metrics.first_step_s < 0.7 * first.metrics.first_step_s, (first.phases, second.phases)
    assert f"JAX's persistent cache in `{cache}`" in report_text(run_dir)
    plain, plain_dir = _run(tmp_path, "plain", frameworks=[{"name": "jax", "python": ENVS["jax"]}], epochs=1)
    assert plain["jax"].settings["compilation_cache_dir"] is None
    assert "persistent cache" not in report_text(plain_dir)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", from_tests)
    shared, shared_dir = _run(tmp_path, "shared", frameworks=[{"name": "jax", "python": ENVS["jax"]}], epochs=1)
    assert shared["jax"].settings["compilation_cache_dir"] == from_tests
    assert f"JAX's persistent cache in `{from_tests}`" in report_text(shared_dir)


def test_the_parents_end_with_their_owner_and_a_changed_environment_gets_its_own(tmp_path, monkeypatch,
                                                                                fault_adapter):
    """A sweep with no active owner makes its own and ends its parents at its end; inside an active owner (the test
    session's, tests/conftest.py) the next sweep forks from the same parent, a changed variable (its children would
    inherit it) starts another, and closing the owner ends them all. (The fault adapter's parents: what a parent's
    life is does not depend on the framework it holds.)"""
    assert workers.active() is not None  # tests/conftest.py's, for the session
    spec = checked_spec(base_spec(frameworks=[fault_adapter], batch_sizes=[16], epochs=1, cpu_threads=1),
                        tmp_path / "s.yaml")
    made = []
    original = forkserver.Server.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(forkserver.Server, "__init__", record)
    monkeypatch.setattr(workers, "_ACTIVE", [])  # no owner active: the sweep makes its own
    (alone,) = {r.start for r in store.read_trials(sweep.run_spec(spec, tmp_path / "a"))}
    assert alone == "forked" and made and not any(server.alive() for server in made)
    with workers.Workers() as owner:
        sweep.run_spec(spec, tmp_path / "b")
        (first,) = owner.servers._servers.values()
        sweep.run_spec(spec, tmp_path / "c")
        assert list(owner.servers._servers.values()) == [first] and first.alive()
        monkeypatch.setenv("HARNESS_TEST_MARKER", "changed")
        records = {r.start for r in store.read_trials(sweep.run_spec(spec, tmp_path / "d"))}
        assert records == {"forked"} and len(owner.servers._servers) == 2
    assert owner.servers._servers == {} and not first.alive() and workers.active() is None
    assert launcher.run_worker(Payload(trial=plan(spec, "cpu")[0]), 60, None, "cpu").start == "cold"  # no owner


def test_at_most_limit_parents_run_the_least_recently_used_ends_first(fault_adapter):
    from harness.execution import forkserver

    servers = forkserver.Servers(limit=1)
    argv = [sys.executable]
    try:
        a = servers.get(argv, fault_adapter, {"A": "1"})
        assert servers.get(argv, fault_adapter, {"A": "1"}) is a
        b = servers.get(argv, fault_adapter, {"A": "2"})
        assert b is not a and b.alive() and not a.alive() and list(servers._servers.values()) == [b]
    finally:
        servers.close()


def test_a_parent_whose_launcher_is_gone_removes_its_folder(fault_adapter):
    """A launcher killed by SIGKILL closes no server: the parent sees its standard input end, kills its children and
    removes its folder (socket and log) from the temporary directory itself; one ended by ``close`` leaves none."""
    from pathlib import Path

    from harness.execution import forkserver

    gone = forkserver.Server([sys.executable], fault_adapter, {})
    closed = forkserver.Server([sys.executable], fault_adapter, {})
    try:
        assert Path(gone.socket_path).exists() and Path(closed.socket_path).exists()
        gone.proc.stdin.close()  # what the launcher's death does, without its close()
        assert gone.proc.wait(timeout=30) == 0
        assert not Path(gone.folder).exists()
        closed.close()
        assert not Path(closed.folder).exists()
    finally:
        gone.close()
        closed.close()


def test_a_launcher_that_hangs_up_before_the_fork_is_answered_costs_one_child_not_the_parent(fault_adapter):
    """A launcher can die between sending its request and reading the child's pid (seen: a parent ended by
    BrokenPipeError and left its folder): the parent kills that child, answers the next request and serves on. The
    parent is stopped (SIGSTOP) while the request is sent and the connection closed, so its answer always meets a
    closed peer."""
    import select
    import socket
    import tempfile

    from harness.execution import forkserver

    server = forkserver.Server([sys.executable], fault_adapter, {})
    try:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            with tempfile.TemporaryFile() as err:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(server.socket_path)  # queued by the kernel while the parent is stopped
                socket.send_fds(conn, [b"trial"], [stdin_r, stdout_w, err.fileno()])
                conn.close()
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        for fd in (stdin_r, stdout_w):
            os.close(fd)
        status, out, _ = server.probe("import sys; print('still serving', sys.argv[1])", ["yes"], 60)
        assert (status, out) == (0, "still serving yes\n") and server.alive()
        # the abandoned child is gone: nothing holds its standard output open any more
        assert select.select([stdout_r], [], [], 10)[0] and os.read(stdout_r, 100) == b""
        for fd in (stdin_w, stdout_r):
            os.close(fd)
        server.log.seek(0)
        assert b"Traceback" not in server.log.read()
    finally:
        server.close()

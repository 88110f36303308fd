"""Shared fixtures: specs written to temporary files, the fault adapter's registration, the framework environments,
and one real run that the results-as-data and report.html tests read; the order of the parallel part. What test
modules share besides fixtures is in tests/helpers.py."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.neutral.data import cache_folder  # noqa: E402
from tests.fakes.fault_adapter import REGISTRATION  # noqa: E402
from tests.helpers import base_spec, made_once  # noqa: E402

# OpenMP threads that finish a parallel region sleep at once instead of spinning for the next one (libgomp's default,
# OMP_WAIT_POLICY unset, spins a while: https://gcc.gnu.org/onlinedocs/libgomp/OMP_005fWAIT_005fPOLICY.html; Intel's
# runtime: KMP_BLOCKTIME). On this 2-core machine, with two test processes side by side and each starting workers, a
# spinning thread takes the core another process needs: tests/adapters/test_train_loss.py and
# test_mxnet_data_parallel.py took 45 s instead of 65-71 s with it (2 interleaved repeats each, 2026-11-26). No test
# times a step against a figure; a run records both variables (harness.measure.machine.ENVIRONMENT).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KMP_BLOCKTIME", "0")
# Ctrl-C as a terminal sends it: a suite started in the background by a script (`cmd &` without job control) inherits
# SIGINT ignored (POSIX), and every process it starts would too (an ignored signal stays ignored across exec), so the
# interruption tests' SIGINT would reach nothing. Python's own handler again here: the children then start with the
# default (a handler is reset at exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# JAX's persistent compilation cache for every process the tests start (the suites in envs/jax and envs/keras-jax,
# trials, probes; https://docs.jax.dev/en/latest/persistent_compilation_cache.html): XLA compiling the same programs
# again in each fresh process is most of the JAX tests' time (tests/adapters/jax_suite.py: 45-63 s with an empty
# cache, 11 s with a filled one, 2026-11-26). Every program whatever its compile time or size. Beside the harness's
# other caches (``harness.neutral.data.cache_folder``: $HARNESS_DATA, else ~/.cache/harness), not in the checkout, so
# that a fresh clone does not compile again what an earlier run of the suite on this machine compiled
# (tests/adapters/test_jax.py: 59 and 80 CPU-s with an empty cache, 38 and 37 with the filled one, 2 interleaved
# pairs, 2026-11-29), as TorchInductor's cache (/tmp/torchinductor_<user>) and uv's already are. What is cached is
# XLA's executable for a program, keyed by the program, the XLA version and its flags, so a test gets the executable
# it would compile, whichever checkout filled it. A trial records the directory (its settings'
# compilation_cache_dir); tests/execution/test_forkserver.py checks the harness's own default without.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_folder() / "xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# ... and what is compiled is compiled quickly: XLA's CPU backend at LLVM optimization level 0 (XLA's debug option
# xla_backend_optimization_level; the programs are the same HLO with the same buffers, only their machine code is
# less optimized): tests/adapters/jax_suite.py with an empty cache 49 -> 32 CPU-s (2026-11-26, one run each). No test
# times a JAX step against a figure; a JAX trial records its XLA_FLAGS (its settings). XLA_FLAGS of yours win.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

#: Test modules that run alone, after the parallel part of ``make test`` (pytest-xdist, ``-m "not serial"``): they
#: time the loop's windows (timing): a test running beside them would change what they measure. A single test of
#: that kind elsewhere carries ``@pytest.mark.serial`` itself, saying why: one-second deadlines on killed processes
#: (interruptions), trial timeouts (launcher), planted slowdowns judged against noise (nightly). Ray instances and
#: pinned cores (scale_out) run in the parallel part: they check statuses, cells and placements, not times. Memory
#: caps are per process (RLIMIT_DATA) and compare's runs are constructed, so the max-batch searches and compare run
#: there too.
SERIAL_MODULES = frozenset({"test_timing"})

#: The parallel part's longest files, longest first (their seconds in the parallel part of make test on this 2-core
#: VM, 2026-11-27, in brackets; the JAX files' with XLA's cache empty and keras-torch's with TorchInductor's, as in a
#: fresh clone): xdist hands whole files to its workers in collection order (``--dist loadfile
#: --no-loadscope-reorder`` in the Makefile), so starting the long ones first keeps one of them from running alone at
#: the end.
LONGEST_FIRST = ("execution/test_scale_out.py",  # ~103: Ray instances and pinned pairs, much of it waiting
                 "execution/test_forkserver.py",  # ~91: every framework forked and cold
                 "adapters/test_keras_torch.py",  # ~83: its suite (TorchInductor compiling C++) and scenarios
                 "studies/test_maxbatch.py",  # ~83: four real-cap searches, three at a time
                 "studies/test_nightly.py",  # ~70 of it in the parallel part, the nightly script's test included
                 "adapters/test_jax.py",  # ~69: its suite and scenarios in envs/jax (XLA's cache empty at first)
                 "adapters/test_keras_jax.py",  # ~64: its suite and scenarios in envs/keras-jax
                 "studies/test_advise.py",  # ~59 (2026-11-29): two real advise runs, one with --validate
                 "adapters/test_keras_tensorflow.py",  # ~55
                 "adapters/test_gradient_norms.py",  # ~50 (2026-11-29): seven drivers, one per environment
                 "execution/test_environments.py",  # ~47
                 "adapters/test_pytorch_data_parallel.py",  # ~45
                 "test_gpu_check.py",  # ~41
                 "results/test_results_data.py",  # ~34
                 "adapters/test_tensorflow_data_parallel.py",  # ~34
                 "execution/test_data_parallel.py",  # ~31
                 "adapters/test_keras_native.py",  # ~29: a model of your own in the three Keras environments
                 "test_end_to_end.py",  # ~27: the four frameworks in their environments, then augmentation
                 "results/test_report.py",  # ~26
                 "execution/test_input_pipeline.py",  # ~23: eight trials reading an image folder
                 "studies/test_maxbatch_runs.py")  # ~22


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the items of ``SERIAL_MODULES`` ``serial`` (before ``-m`` selects), and puts the files of
    ``LONGEST_FIRST`` first, in its order (the rest keep theirs)."""
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def position(item):
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=position)  # stable: within a file and among the rest, the collection order stays


@pytest.fixture(scope="session", autouse=True)
def fork_parents():
    """The owner of the preloaded parents of forked workers for the whole pytest process
    (``harness.execution.workers.Workers``, active while the session runs): its parents serve every test instead of
    one sweep or search each (importing a framework costs seconds, paid once per process); a parent's key holds the
    environment and folder, so a test that changes either gets its own. Closed at the session's end. None in a
    framework's environment (tests/adapters' suites), which lacks the harness's side of the launcher."""
    try:
        from harness.execution.workers import Workers
    except ImportError:
        yield None
        return
    with Workers() as workers:
        yield workers


@pytest.fixture(scope="session")
def envs():
    """{framework: its envs/ python}, made when missing (kept when up to date: see environments.create)."""
    from harness.execution import environments

    return {fw: str(environments.create(fw, ROOT / "envs")[0]) for fw in ("pytorch", "tensorflow", "mxnet", "jax")}


@pytest.fixture
def write_spec(tmp_path):
    """write_spec(dict) -> path of a YAML file holding it."""

    def write(data, name="spec.yaml"):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        return path

    return write


@pytest.fixture
def fault_adapter(monkeypatch):
    """Registers the fault adapter (inherited by worker processes through the environment)."""
    monkeypatch.setenv("HARNESS_ADAPTERS", REGISTRATION)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return "fault"


@pytest.fixture(scope="session")
def real_run(tmp_path_factory):
    """One real run: PyTorch, batch sizes 32 and 64, 2 repeats, 2 epochs, in fp32 and in fp16, which the PyTorch
    adapter does not run on a CPU (recorded unsupported, no worker): a run with trials that have no samples. Made once
    for every worker (``made_once``); each worker gets its own copy."""
    from harness.plan import checked_spec
    from harness.results import report
    from harness.studies import sweep

    def make(folder: Path) -> None:
        spec = checked_spec(base_spec(name="data", batch_sizes=[32, 64], repeats=2, epochs=2,
                                      variants={"precision": ["fp32", "fp16"]}, sampler={"interval_s": 0.05}),
                            folder / "s.yaml")
        report.write(sweep.run_spec(spec, folder / "runs"))

    (made,) = (made_once(tmp_path_factory, "real_run", make) / "runs").iterdir()
    copy_dir = tmp_path_factory.mktemp("data") / made.name
    shutil.copytree(made, copy_dir)
    return copy_dir

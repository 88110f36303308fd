"""Shared fixtures: specs written to temporary files, the fault adapter's registration, and one real run that the
results-as-data and report.html tests read."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fakes.fault_adapter import REGISTRATION  # noqa: E402

TINY_CNN = [
    {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
    {"type": "maxpool2d", "pool_size": 2},
    {"type": "flatten"},
    {"type": "dense", "units": 10},
]

BASE_SPEC = {
    "name": "t",
    "frameworks": ["pytorch"],
    "model": {"layers": TINY_CNN},
    "dataset": {"name": "digits"},
    "batch_sizes": [32],
    "epochs": 1,
    "warmup_steps": 1,
    "optimizer": {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9},
    "cpu_threads": 1,
    "timeout_s": 120,
}


#: Test modules that run alone, after the parallel part of ``make test`` (pytest-xdist, ``-m "not serial"``): they pin
#: cores or start Ray with a CPU count (scale_out), hold one-second deadlines on killed processes (interruptions), cap
#: memory near each framework's limit with four searches at once (maxbatch), or judge planted slowdowns and timeouts
#: against timing noise (compare, nightly, launcher, timing): a test running beside them would change what they
#: measure.
SERIAL_MODULES = frozenset({"test_scale_out", "test_interruptions", "test_maxbatch", "test_compare", "test_nightly",
                            "test_launcher", "test_timing"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the items of ``SERIAL_MODULES`` ``serial`` (before ``-m`` selects)."""
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


def base_spec(**changes):
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(changes)
    return spec


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
    adapter does not run on a CPU (recorded unsupported, no worker): a run with trials that have no samples."""
    from harness.plan import checked_spec
    from harness.results import report
    from harness.studies import sweep

    tmp = tmp_path_factory.mktemp("data")
    spec = checked_spec(base_spec(name="data", batch_sizes=[32, 64], repeats=2, epochs=2,
                                  variants={"precision": ["fp32", "fp16"]}, sampler={"interval_s": 0.05}),
                        tmp / "s.yaml")
    run_dir = sweep.run_spec(spec, tmp / "runs")
    report.write(run_dir)
    return run_dir

"""What test modules share besides fixtures (tests/conftest.py holds those): the base spec, the folder made once for
every xdist worker, a trial for the shared loop alone, run options from flat data, trial records and run directories
built by hand, a run's report text, the rendered-report comparison, fake workers for the max-batch search, and
process helpers for runs that are started or killed. The adapter tests' kit is tests/adapters/kit.py; no test module
imports another."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

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


def base_spec(**changes):
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(changes)
    return spec


def made_once(tmp_path_factory: pytest.TempPathFactory, key: str, make: Callable[[Path], object]) -> Path:
    """A folder that ``make(folder)`` fills once per ``pytest`` command, however many xdist workers ask for it: the
    first to ask makes it under a file lock, the others wait for it (the pattern of pytest-xdist's documentation,
    "Making session-scoped fixtures execute only once"). Readers that write into it must take a copy."""
    from filelock import FileLock  # not in envs/jax, whose suite loads this file too

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' base folders share this parent
    folder = base / "made-once" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not (folder.parent / f"{key}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder.parent / f"{key}.done").touch()
    return folder


# -- the shared loop and an adapter's options ------------------------------------------------------------

def loop_trial(batch_size: int, timing: dict[str, Any] | Any, accumulation_steps: int = 1,
               **fields: Any) -> Any:
    """A ``Trial`` with ``batch_size`` as its micro-batch and the samples per step the plan would compute; the
    fields the loop does not read get placeholders."""
    from harness.plan import Trial
    from harness.spec import TimingSpec

    defaults: dict[str, Any] = {"id": "t-bs0-r0", "framework": "test", "repeat": 0, "device": "cpu", "threads": 1,
                                "seed": 0, "epochs": 1, "warmup_steps": 0, "learning_rate": 0.01}
    return Trial(**{**defaults, **fields}, micro_batch_size=batch_size, accumulation_steps=accumulation_steps,
                 samples_per_step=batch_size * accumulation_steps, timing=TimingSpec.model_validate(timing))


def run_options(options: dict[str, Any]) -> Any:
    """``adapters.base.RunOptions`` from flat test data: an ``AllocatorSpec`` field goes to ``allocator``."""
    from adapters.base import RunOptions
    from harness.spec import AllocatorSpec

    allocator = {k: v for k, v in options.items() if k in AllocatorSpec.model_fields}
    return RunOptions(**{k: v for k, v in options.items() if k not in allocator}, allocator=AllocatorSpec(**allocator))


# -- trial records and run directories built by hand ----------------------------------------------------------------

def record(framework, batch_size, repeat=0, status="ok", throughput=100.0, accuracy=0.5, backend="host", **extra):
    """A trial record's data as trials.jsonl holds it (schema version 2)."""
    stats = ({"cpu_pct": {"mean": 90.0, "max": 100.0, "count": 3, "scope": "windows"},
              "rss_bytes": {"mean": 4e8, "max": 5e8, "count": 3, "scope": "windows"}} if backend == "host" else
             {"gpu_util_pct": {"mean": 40.0, "max": 60.0, "count": 5, "scope": "windows"},
              "process_memory_bytes": {"mean": 6e8, "max": 7e8, "count": 5, "scope": "windows"},
              "device_memory_used_bytes": {"mean": 9e8, "max": 1e9, "count": 5, "scope": "windows"}})
    metrics = {} if status != "ok" else {
        "throughput_samples_per_s": throughput, "epoch_time_s": 1000 / throughput,
        "step_time_median_s": batch_size / throughput, "step_time_p90_s": 1.1 * batch_size / throughput,
        "test_accuracy": accuracy, "final_train_loss": 0.3, "achieved_flops_per_s": throughput * 1e9,
        "measured_samples": 10_000, "data_bytes": 2_000_000,
        "memory": {"allocator_peak_bytes": 300_000_000} if backend == "nvml" else {}}
    rec = {"schema_version": 2, "id": f"{framework}-bs{batch_size}-r{repeat}", "framework": framework,
           "label": framework, "batch_size": batch_size, "repeat": repeat,
           "device": "cuda:0" if backend == "nvml" else "cpu", "status": status,
           "reason": "" if status == "ok" else "CUDA out of memory", "wall_s": 1.0, "metrics": metrics,
           "sampler": {"backend": backend, "stats": stats, **({"name": "NVIDIA H100 80GB HBM3"} if backend == "nvml"
                                                               else {})}}
    rec.update(extra)
    return rec


def make_run(tmp_path, records, frameworks=("pytorch", "mxnet"), batch_sizes=(8, 16), epochs=10):
    """A run directory of ``records`` (``record``'s data) under ``tmp_path/run``, with a run.json of the spec's
    essentials; the report's and the readers' tests write and read it."""
    from harness.record import TrialRecord
    from harness.results import store

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = {"name": "t", "frameworks": list(frameworks), "batch_sizes": list(batch_sizes), "epochs": epochs,
            "warmup_steps": 5, "seed": 0, "cpu_threads": 1, "dataset": {"name": "digits"},
            "optimizer": {"name": "sgd", "learning_rate": 0.01, "momentum": 0.9, "weight_decay": 0.0},
            "sampler": {"interval_s": 0.1}, "timing": {"window": "auto"}}
    device = "cuda:0" if records and records[0]["device"].startswith("cuda") else "cpu"
    store.write_json(run_dir / "run.json", {"schema_version": 2, "spec": spec, "device": device,
                                              "planned_trials": [r["id"] for r in records],
                                              "environment": {}, "started": "now", "finished": "later"})
    for rec in records:
        store.append_trial(run_dir, TrialRecord.model_validate(rec))
    return run_dir


def repeated_run(path, throughput, repeats=3, accuracy=lambda fw, bs, r: 0.9, frameworks=("pytorch", "mxnet"),
                 batch_sizes=(8, 16, 32, 64)):
    """A run directory whose cell (fw, bs), repeat r has throughput(fw, bs, r) (compare's and history's tests)."""
    from harness.record import TrialRecord
    from harness.results import store

    path.mkdir(parents=True)
    records = [record(fw, bs, r, throughput=throughput(fw, bs, r), accuracy=accuracy(fw, bs, r))
               for r in range(repeats) for fw in frameworks for bs in batch_sizes]
    spec = {"name": "t", "frameworks": list(frameworks), "batch_sizes": list(batch_sizes)}
    store.write_json(path / "run.json", {"spec": spec, "device": "cpu", "environment": {},
                                         "planned_trials": [r["id"] for r in records]})
    for rec in records:
        store.append_trial(path, TrialRecord.model_validate(rec))
    return path


# -- report.md against report.html ------------------------------------------------------------------------------------

class _Rendered(HTMLParser):
    """The text of every heading and every table cell of an HTML page (plots' SVG left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.cells: list[str] = []
        self._text: list[str] | None = None
        self._svg = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._svg += tag == "svg"
        if tag in ("td", "th", "h1", "h2", "h3", "h4"):
            self._text = []

    def handle_endtag(self, tag: str) -> None:
        self._svg -= tag == "svg"
        if tag in ("td", "th", "h1", "h2", "h3", "h4") and self._text is not None:
            (self.cells if tag in ("td", "th") else self.headings).append(" ".join("".join(self._text).split()))
            self._text = None

    def handle_data(self, data: str) -> None:
        if self._text is not None and not self._svg:
            self._text.append(data)


def report_text(run_dir: Path) -> str:
    """report.md's text for ``run_dir`` without drawing its figures: ``report.render_markdown``, the sections
    ``report.write`` renders into report.md (about 2 CPU-s less a run). For tests of what the report says; the
    figures, and a report written whole, are tested where they are the subject (tests/results/test_plots.py,
    test_report_html.py, test_report.py, test_launcher.py, test_records.py and every CLI run)."""
    from harness.results.data import load_run
    from harness.results.report import render_markdown

    return render_markdown(load_run(run_dir).data)


def same_content(markdown: str, page: str) -> tuple[list[str], list[str]]:
    """The headings and table cells of ``markdown`` that ``page`` lacks (the plots section is PNG links only)."""
    seen = _Rendered()
    seen.feed(page)
    markdown = markdown.split("\n## Plots\n")[0]
    headings = [line.lstrip("#").strip() for line in markdown.splitlines() if line.startswith("#")]
    cells = [" ".join(cell.replace("`", "").replace("\\*", "*").split()) for line in markdown.splitlines()
             if line.startswith("| ") and not line.startswith("| ---") for cell in line[2:-2].split(" | ")]
    html_cells = {cell.replace("|", "/") for cell in seen.cells}  # Markdown writes a | in a cell as /
    return [h for h in headings if h not in seen.headings], sorted({c for c in cells if c not in html_cells})


# -- fake workers for the max-batch search ---------------------------------------------------------------------------

class FakeOutcome:
    """What find_max_batch reads of a launcher Outcome, for the search-logic tests (test_maxbatch and
    test_maxbatch_runs)."""

    def __init__(self, status, peak=None, reason=""):
        from harness.record.events import MemoryPeak

        self.status, self.reason, self.wall_seconds, self.log_tail, self.sampler = status, reason, 0.0, "", {}
        self.events = [MemoryPeak(peak_bytes=round(peak), source="test")] if peak is not None else []

    def result(self):
        return None


def is_run_check(payload):
    """A run check's trial (harness.studies.max_batch.runcheck) has its epochs cut to RUN_STEPS steps or more; a
    probe's are whole or cut to fewer (``probe.probe_shape``: PROBE_STEPS, or one with the dataset)."""
    from harness.studies.max_batch.probe import PROBE_STEPS

    return (payload.trial.max_steps_per_epoch or 0) > PROBE_STEPS


def simulate_workers(monkeypatch, fits, peak=lambda b: 50e6 + 1e6 * b, payloads=None, runs=None, run_fits=None,
              run_peak=None):
    """Replaces the worker: fits(b) says whether per-device batch size b fits this time. Returns the sizes probed,
    in order. Run checks go to ``runs`` (their sizes) and ``run_fits``/``run_peak`` (default: fits and peak), and
    are not in the sizes returned nor in ``payloads``."""
    from harness.studies.max_batch import search

    sizes = []

    def fake_run_worker(payload, timeout_s, interval_s, device, threads=None, on_event=None):
        b = payload.trial.per_device_batch_size
        run = is_run_check(payload)
        if run and runs is not None:
            runs.append(b)
        elif not run:
            sizes.append(b)
            if payloads is not None:
                payloads.append(payload)
        ok, size_peak = (run_fits or fits, run_peak or peak) if run else (fits, peak)
        return FakeOutcome("ok", size_peak(b)) if ok(b) else FakeOutcome("oom", reason="RuntimeError: out of memory")

    monkeypatch.setattr(search, "run_worker", fake_run_worker)
    return sizes


# -- processes of runs started, interrupted and resumed -------------------------------------------------------------

def start_run(spec, out, cwd, extra_env=None):
    """``harness run`` of ``spec`` in a process of its own (stdout and stderr piped), to interrupt."""
    env = {**os.environ, **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-m", "harness", "run", str(spec), "--out", str(out), "--no-progress"],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def data_parallel_env(tmp_path, **extra):
    """The environment of a run of the data-parallel fault adapter (its ranks record their pids in the folder
    returned first)."""
    from tests.fakes.fault_adapter import DATA_PARALLEL_REGISTRATION, REGISTRATION

    pids = tmp_path / "pids"
    pids.mkdir()
    return pids, {"HARNESS_ADAPTERS": f"{REGISTRATION},{DATA_PARALLEL_REGISTRATION}", "PYTHONPATH": str(ROOT),
                  "HARNESS_FAULT_PIDS": str(pids), **extra}


def ranks_gone(pid_files, within_s=1.0):
    """True when every recorded rank process has ended within ``within_s``."""
    import psutil

    pids = [int(p.name.rsplit("-", 1)[1]) for p in pid_files]
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            return True
        time.sleep(0.05)
    return False


def skip_probes(monkeypatch: Any) -> None:
    """No framework entry's interpreter is probed in a sweep (``harness.execution.probes.probe_entries``, whether the
    sweep calls it itself or through its ``Workers``): run.json records no environments."""
    from harness.execution import probes
    from harness.studies import sweep

    def none(spec: Any, file: Any, device: str = "cpu", via: Any = None) -> list[dict[str, Any]]:
        return []

    monkeypatch.setattr(sweep, "probe_entries", none)
    monkeypatch.setattr(probes, "probe_entries", none)

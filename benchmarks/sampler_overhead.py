"""What does the sampler cost the training it watches? Throughput of real worker trials with the sampler at the
default interval, at 10 ms, and with no sampler at all, interleaved in one run.

For each framework and batch size (the tiny CNN on digits, the test suite's model), two uncounted calibration trials
without a sampler pick the number of epochs that gives about ``--target-seconds`` of timed training. Then, for each
repeat, every (framework, batch size, configuration) runs once, round-robin; the order of the configurations rotates
from one repeat to the next, so none always runs first. Each sampled trial is compared with the unsampled trial of
the same repeat (paired ratios), and the table shows the median ratio with its min..max over repeats.

    .venv/bin/python benchmarks/sampler_overhead.py                        # pytorch, batch 16 and 256, 5 repeats
    .venv/bin/python benchmarks/sampler_overhead.py --frameworks all --repeats 3
    .venv/bin/python benchmarks/sampler_overhead.py --device cuda:0        # on a GPU machine: the NVML backend
    python3 benchmarks/sampler_overhead.py --device cuda:0 --frameworks pytorch,jax --python jax=/opt/jax/bin/python \
        --json overhead.json                                               # workers in other interpreters; JSON too

Without a GPU the sampler runs its host backend (psutil); with ``--device cuda:N`` it runs NVML. The sampler is a
thread in the launcher's process, so what it can cost the worker is CPU time (and, with NVML, driver calls); the
worker's own threads default to every available CPU, as in a real sweep. A ratio below 1 is a slowdown. Defaults take
about three minutes on two CPU cores (each worker start costs seconds: importing the framework dominates);
``--frameworks all`` about three times that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.execution.launcher import run_worker  # noqa: E402
from harness.execution.protocol import Payload  # noqa: E402
from harness.measure.sampler import DEFAULT_INTERVAL_S  # noqa: E402
from harness.plan import available_cpus, plan  # noqa: E402
from harness.record import TrialMetrics  # noqa: E402
from harness.spec import Spec  # noqa: E402

FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax")
TINY_CNN = [
    {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
    {"type": "maxpool2d", "pool_size": 2},
    {"type": "flatten"},
    {"type": "dense", "units": 10},
]
TRAIN_SAMPLES = 1438  # digits: 1797 images, 80 % for training (harness.neutral.datasets)


PYTHONS: dict[str, str] = {}  # framework -> the interpreter its workers run in (--python); default: this one


def make_spec(framework: str, batch_size: int, epochs: int, threads: int, device: str) -> Spec:
    entry: Any = {"name": framework, "python": PYTHONS[framework]} if framework in PYTHONS else framework
    return Spec.model_validate({
        "name": "sampler-overhead", "frameworks": [entry], "model": {"layers": TINY_CNN},
        "dataset": {"name": "digits"}, "batch_sizes": [batch_size], "epochs": epochs, "warmup_steps": 2,
        "optimizer": {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9}, "cpu_threads": threads,
        "device": device, "timeout_s": 600,
    })


def run_trial(framework: str, batch_size: int, epochs: int, threads: int, device: str,
              interval: float | None) -> dict[str, Any]:
    """One real worker trial; its throughput and what the sampler reported."""
    spec = make_spec(framework, batch_size, epochs, threads, device)
    (trial,) = plan(spec, device)  # one framework, one batch size, one repeat
    outcome = run_worker(Payload(trial=trial), spec.timeout_s, interval, device, threads)
    result = outcome.result()
    metrics = result.metrics if result is not None else TrialMetrics()
    return {"status": outcome.status, "reason": outcome.reason, "throughput": metrics.throughput_samples_per_s,
            "measured_seconds": metrics.measured_s, "samples": len(outcome.samples),
            "backend": outcome.sampler.get("backend"),
            "cost_s": (outcome.sampler.get("sample_cost_s") or {}).get("median"),
            "busy_s": (outcome.sampler.get("sample_cost_s") or {}).get("total"), "wall_s": outcome.wall_seconds}


def calibrate(framework: str, batch_size: int, threads: int, device: str, target_s: float) -> int:
    """Epochs for about ``target_s`` seconds of timed training, from the faster of two short unsampled trials (a
    momentary load elsewhere on the machine slows one down; the faster one errs towards enough epochs)."""
    throughput = 0.0
    for _ in range(2):
        probe = run_trial(framework, batch_size, 3, threads, device, None)
        if probe["status"] != "ok":
            raise RuntimeError(f"{framework} batch {batch_size}: calibration trial {probe['status']}: "
                               f"{probe['reason']}")
        throughput = max(throughput, probe["throughput"])
    per_epoch = (TRAIN_SAMPLES // batch_size) * batch_size / throughput
    return int(min(500, max(3, math.ceil(target_s / per_epoch))))


def label(interval: float | None) -> str:
    return "none" if interval is None else f"{interval * 1e3:g} ms"


def summarize(runs: dict[tuple[str, int, float | None], list[dict[str, Any]]], intervals: list[float],
              cells: list[tuple[str, int]], epochs: dict[tuple[str, int], int]) -> str:
    """The Markdown table: one row per framework, batch size and sampled interval."""
    lines = ["| framework | batch | epochs | interval | throughput/s (no sampler, median) "
             "| ratio sampled/none (median) | min..max | repeats | samples/trial | backend call (median ms) "
             "| sampler busy (% of one core) |",
             "| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for framework, batch in cells:
        base = runs[(framework, batch, None)]
        base_ok = [r["throughput"] for r in base if r["status"] == "ok"]
        for interval in intervals:
            sampled = runs[(framework, batch, interval)]
            ratios = [s["throughput"] / b["throughput"] for s, b in zip(sampled, base)
                      if s["status"] == b["status"] == "ok"]
            counts = [s["samples"] for s in sampled if s["status"] == "ok"]
            costs = [s["cost_s"] for s in sampled if s["status"] == "ok" and s["cost_s"] is not None]
            busy = [100 * s["busy_s"] / s["wall_s"] for s in sampled if s["status"] == "ok" and s["busy_s"]]
            spread = f"{min(ratios):.3f}..{max(ratios):.3f}" if ratios else "n/a"
            lines.append(
                f"| {framework} | {batch} | {epochs[(framework, batch)]} | {label(interval)} "
                f"| {np.median(base_ok) if base_ok else math.nan:,.0f} "
                f"| {np.median(ratios) if ratios else math.nan:.3f} | {spread} | {len(ratios)} "
                f"| {np.median(counts) if counts else math.nan:.0f} "
                f"| {np.median(costs) * 1e3 if costs else math.nan:.2f} "
                f"| {np.median(busy) if busy else math.nan:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", default="pytorch",
                        help="comma-separated, from pytorch,tensorflow,mxnet,jax, or 'all' (default: pytorch)")
    parser.add_argument("--batch-sizes", default="16,256", help="a small and a large batch (default: 16,256)")
    parser.add_argument("--intervals", default=f"{DEFAULT_INTERVAL_S},0.01",
                        help=f"sampled intervals in seconds, compared with no sampler (default: {DEFAULT_INTERVAL_S},"
                             f"0.01)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds over every configuration (default: 5)")
    parser.add_argument("--target-seconds", type=float, default=1.5,
                        help="timed training per trial, set through the epoch count (default: 1.5)")
    parser.add_argument("--threads", type=int, default=None, help="worker CPU threads (default: every available CPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default: cpu)")
    parser.add_argument("--python", action="append", default=[], metavar="FRAMEWORK=PYTHON",
                        help="the interpreter a framework's workers run in (default: this one); repeatable")
    parser.add_argument("--json", metavar="FILE", help="also write the table's cells as JSON")
    parser.add_argument("--epochs", type=int, help="epochs per trial, instead of calibrating to --target-seconds")
    args = parser.parse_args(argv)
    for item in args.python:
        name, _, python = item.partition("=")
        if not python:
            parser.error(f"--python takes FRAMEWORK=PYTHON, not {item!r}")
        PYTHONS[name] = python

    frameworks = list(FRAMEWORKS) if args.frameworks == "all" else args.frameworks.split(",")
    unknown = set(frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown framework(s): {', '.join(sorted(unknown))}")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    intervals = [float(i) for i in args.intervals.split(",")]
    configs: list[float | None] = [None, *intervals]
    threads = args.threads or available_cpus()
    cells = list(itertools.product(frameworks, batches))
    started = time.monotonic()
    load_before = os.getloadavg()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    epochs = {}
    for framework, batch in cells:
        epochs[(framework, batch)] = args.epochs or calibrate(framework, batch, threads, args.device,
                                                              args.target_seconds)
        log(f"calibrated {framework} batch {batch}: {epochs[(framework, batch)]} epochs")
    runs: dict[tuple[str, int, float | None], list[dict[str, Any]]] = {
        (f, b, c): [] for f, b in cells for c in configs}
    backends = set()
    for repeat in range(args.repeats):
        for framework, batch in cells:
            shift = repeat % len(configs)
            for config in configs[shift:] + configs[:shift]:
                run = run_trial(framework, batch, epochs[(framework, batch)], threads, args.device, config)
                runs[(framework, batch, config)].append(run)
                if config is not None:
                    backends.add(run["backend"])
                note = "" if run["status"] == "ok" else f" ({run['reason'][:120]})"
                log(f"repeat {repeat + 1}/{args.repeats} {framework} bs {batch} sampler {label(config)}: "
                    f"{run['status']}, {run['throughput'] or 0:,.0f} samples/s over "
                    f"{run['measured_seconds'] or 0:.2f} s{note}")
    print(f"Sampler overhead: device {args.device}, sampler backend {', '.join(sorted(map(str, backends)))}, "
          f"worker threads {threads}, {available_cpus()} CPUs, {args.repeats} repeats, "
          f"{time.monotonic() - started:.0f} s in all")
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}: other load on the machine shows up as noise")
    print("ratio = throughput with the sampler / throughput without it in the same repeat (below 1: slower); "
          "sampler busy = time inside backend calls / the trial's wall time (the CPU the sampler thread needs, "
          "whatever else runs on the machine)\n")
    print(summarize(runs, intervals, cells, epochs))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "repeats": args.repeats, "threads": threads,
                                               "backends": sorted(map(str, backends)),
                                               "cells": cells_json(runs, intervals, cells)}, indent=2))
    return 0


def cells_json(runs: dict[tuple[str, int, float | None], list[dict[str, Any]]], intervals: list[float],
               cells: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """One entry per framework, batch size and sampled interval: the paired ratios (sampled / none, per repeat),
    their median, and the trials that did not end ok."""
    out = []
    for framework, batch in cells:
        base = runs[(framework, batch, None)]
        for interval in intervals:
            sampled = runs[(framework, batch, interval)]
            ratios = [s["throughput"] / b["throughput"] for s, b in zip(sampled, base)
                      if s["status"] == b["status"] == "ok"]
            out.append({"framework": framework, "batch_size": batch, "interval_s": interval, "ratios": ratios,
                        "median_ratio": float(np.median(ratios)) if ratios else None,
                        "failed": [f"{r['status']}: {r['reason']}" for r in base + sampled if r["status"] != "ok"]})
    return out


if __name__ == "__main__":
    sys.exit(main())

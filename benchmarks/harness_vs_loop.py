"""How close does the harness come to a hand-written loop? Per framework and batch size, the throughput of a real
harness trial divided by that of the framework's idiomatic training loop, same model, data, batch size, optimizer,
threads and warm-up, interleaved over several repeats (issue 12, item 3: the goal is a median ratio >= 0.97 for every
framework at batch 64 and 512 on the CPU; on a GPU, ``--device cuda:N``, for PyTorch and JAX).

What runs, for each repeat, framework and batch size, back to back (which one goes first alternates, so drift of the
machine hits both):

- the harness: one trial exactly as a user's run makes it. The spec (default ``specs/quick.yaml``: the CNN on digits,
  one intra-op thread, each framework in its own ``envs/<framework>`` interpreter) with only the framework, the batch
  size, the epochs and the device (``--device``: cpu by default) overridden goes through ``harness.plan.load`` and
  ``harness.plan.plan``, and the trial through ``harness.execution.launcher.run_worker``: a fresh worker process, the
  spec's sampler watching it (psutil on the CPU, NVML on a GPU), the spec's timing (``timing``: whatever the harness
  does by default; ``--timing`` overrides it). Its ``throughput`` metric is read: samples per second over the timed
  windows, warm-up excluded.
- the loop: ``benchmarks/idiomatic_loops.py`` in the same interpreter on the same device, with the environment the
  launcher gives a worker (``worker_settings`` of the trial's threads, on a GPU as on the CPU): the same model built
  natively from the same initial weights, the data and every step's batch indices resident on the device, the spec's
  warm-up steps untimed, then every other step timed with one sync at each edge. PyTorch eager; TensorFlow the faster
  of a ``tf.function`` step loop and Keras ``fit`` (per repeat); MXNet hybridized Gluon with autograd and
  ``Trainer``; JAX a ``jax.jit`` update step with optax. See that module's docstring.

Both time the same steps (Keras ``fit`` also its warm-up's worth) of the same number of epochs, chosen per batch size
so that a measurement covers at least ``--min-steps`` steps and ``--min-samples`` samples (about two seconds here;
digits has 1438 training images: 22 steps per epoch at batch 64, 2 at batch 512), unless ``--epochs`` fixes it.
Both evaluate the test set once, after the last epoch (the harness through ``evaluate_every``, so its timed windows
run on across epochs as the loop's clock does); ``--evaluate-every 1`` gives the harness a user's default instead, an
evaluation after every epoch, whose windows then end with every epoch: at batch 512 on digits, windows of 2 steps,
each starting with the device's queue empty.

    .venv/bin/python benchmarks/harness_vs_loop.py                  # all four, batch 64 and 512, 5 repeats
    .venv/bin/python benchmarks/harness_vs_loop.py --frameworks tensorflow,mxnet --repeats 3 --out /tmp/hvl.json
    .venv/bin/python benchmarks/harness_vs_loop.py --timing '{"window": "step"}'   # another timing than the spec's
    python3 benchmarks/harness_vs_loop.py --device cuda:0 --frameworks pytorch,jax \
        --python pytorch=python3 --python jax=python3 --repeats 3 --min-steps 300   # on a GPU machine

On a GPU (``--device cuda:N``) PyTorch's and JAX's loops put the model, the data and every step's indices on that
GPU and sync it at the timed edges (``torch.cuda.synchronize``, ``block_until_ready``); TensorFlow and MXNet are not
run there (their GPU builds are not on the GPU machines): each of their cells is recorded ``skipped`` with the
reason, and nothing starts for it. Threads are the trial's, for the worker and the loop alike (``worker_settings`` of
them, ``--threads`` of the loop): on the CPU the spec's ``cpu_threads``; on a GPU every available CPU, the harness's
default for a spec without ``cpu_threads`` (quick.yaml's one thread is sized for a 2-core VM, and would turn on the
JAX adapter's single-thread XLA CPU flags); ``--cpu-threads`` sets them on either. ``--python FRAMEWORK=PATH``
replaces the interpreter (and any command prefix) of a framework's entry in the spec for both sides: a GPU machine
has no ``envs/``, its one ``python3`` holds PyTorch and JAX.

``--harness`` runs more than one harness trial in every repeat, each changing one thing of a user's run
(``VARIANTS``: the sampler off, the worker started cold instead of forked from a preloaded parent), all in the
rotating order with the loop: ``--harness unsampled,sampled,unsampled-cold`` splits a gap to the loop between the
sampler and the worker's start within the same repeats. A second table then gives each variant's paired ratio to
the loop and to the first variant.

Reading it: ``ratio`` is harness / loop throughput within one repeat (paired); the table gives its median and
min..max over repeats, the median throughputs of both, the loop variant that was fastest, the test accuracy of both
(equal, or nearly, when both trained the same model on the same batches: a check of the comparison, not a result) and
whether the goal holds (median ratio >= 0.97). A ratio below 1 is the harness's cost: its per-step work (the
adapter's step, the shared loop, the syncs of its timed windows) and the sampler. The noise of a shared machine
shows as a wide min..max; the load averages before and after are printed. Each (framework, batch size) costs about
two worker starts (seconds each: importing the framework dominates) plus twice the timed training; the defaults
take about 15 minutes on two CPU cores. Raw results (every run, its settings and versions) go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.idiomatic_loops import DEVICE, device_refusal  # noqa: E402
from harness import plan as plan_module  # noqa: E402
from harness.execution.launcher import run_worker, worker_settings  # noqa: E402
from harness.execution.protocol import Payload  # noqa: E402
from harness.execution.workers import Workers, start_mode  # noqa: E402
from harness.neutral import datasets  # noqa: E402
from harness.plan import available_cpus  # noqa: E402
from harness.record import TrialMetrics  # noqa: E402
from harness.spec import Spec, as_entry  # noqa: E402

FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax")
GOAL = 0.97
#: The harness trials a repeat can run beside the loop (``--harness``): name -> (the spec's sampler on, the spec's
#: ``worker_start`` replaced by this where not None). "sampled" is a user's run; the others each change one thing.
VARIANTS: dict[str, tuple[bool, str | None]] = {"sampled": (True, None), "unsampled": (False, None),
                                                "sampled-cold": (True, "cold"), "unsampled-cold": (False, "cold")}


def load_spec(path: str, framework: str, batch_size: int, epochs: int, timing: dict[str, Any] | None,
              evaluate_every: int | None = None, device: str = "cpu",
              pythons: dict[str, str] | None = None, cpu_threads: int | None = None) -> Spec:
    """The spec file with only the framework, batch size, epochs, repeats (1), device (``device``: "cpu" or
    "cuda:N") and evaluation (``evaluate_every``: None = after the last epoch only, as the loop evaluates)
    overridden, and ``timing`` and ``cpu_threads`` where given; validated and checked as ``harness run`` does.
    ``pythons``: framework -> interpreter, which replaces the interpreter (and any command prefix) of that
    framework's entry."""
    overrides: dict[str, Any] = {"frameworks": [framework], "batch_sizes": [batch_size], "epochs": epochs,
                                 "repeats": 1, "device": device, "evaluate_every": evaluate_every or epochs}
    if timing is not None:
        overrides["timing"] = timing
    if cpu_threads is not None:
        overrides["cpu_threads"] = cpu_threads
    spec = plan_module.load(path, overrides)
    if not pythons:
        return spec
    entries = []
    for entry in (as_entry(item) for item in spec.frameworks):
        python = pythons.get(entry.row, pythons.get(entry.name))
        entries.append(entry if python is None else entry.model_copy(update={"python": python, "command": None}))
    return spec.model_copy(update={"frameworks": entries})


def run_harness(spec: Spec, sampler: bool, device: str = "cpu") -> dict[str, Any]:
    """One real harness trial (plan -> run_worker, a fresh worker) on ``device`` (the spec's, which the sampler
    watches too); its throughput and what goes with it."""
    (trial,) = plan_module.plan(spec, device)
    interval = spec.sampler.interval_s if sampler else None
    payload = Payload(trial=trial)
    outcome = run_worker(payload, spec.timeout_s, interval, device, trial.threads)
    result = outcome.result()
    metrics = result.metrics if result is not None else TrialMetrics()
    return {"status": outcome.status, "reason": outcome.reason, "throughput": metrics.throughput_samples_per_s,
            "measured_steps": metrics.measured_steps, "measured_seconds": metrics.measured_s,
            "step_time_median_s": metrics.step_time_median_s, "test_accuracy": metrics.test_accuracy,
            "final_train_loss": metrics.final_train_loss, "timed_windows": metrics.timed_windows,
            "timing_window": metrics.timing_window, "wall_s": outcome.wall_seconds,
            "threads": trial.threads, "device": trial.device, "python": plan_module.entry_for(spec, trial.label).argv(),
            "timing": spec.timing.model_dump(mode="json"),
            "trial": {k: v for k, v in payload.model_dump(mode="json")["trial"].items()
                      if k not in ("python", "command")},
            "sampler_interval_s": interval, "start": start_mode(payload.trial)}


def run_loop(spec: Spec, spec_path: str, framework: str, batch_size: int, epochs: int,
             threads: int, device: str = "cpu") -> dict[str, Any]:
    """``benchmarks.idiomatic_loops`` on ``device`` in the framework entry's interpreter, with the worker's thread
    environment (``worker_settings`` of ``threads``, the trial's)."""
    entry = plan_module.entry_for(spec, framework)
    argv = [*entry.argv(), "-m", "benchmarks.idiomatic_loops", "--framework", framework,
            "--batch-size", str(batch_size), "--epochs", str(epochs), "--spec", spec_path,
            "--warmup-steps", str(spec.warmup_steps), "--threads", str(threads), "--seed", str(spec.seed),
            "--device", device]
    env = {**os.environ, **worker_settings(threads, allocator=spec.allocator.model_dump(mode="json"))}
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=spec.timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"no exit within {spec.timeout_s:g} s", "throughput": None}
    wall = time.monotonic() - started
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "error", "reason": f"exit {proc.returncode}: {tail[:300]}", "throughput": None}
    out = json.loads(lines[-1])
    best = out["variants"][out["best"]]
    return {"status": "ok", "reason": "", **out, "test_accuracy": best["test_accuracy"],
            "timed_steps": best["timed_steps"], "wall_s": wall, "python": entry.argv()}


def skipped_run(framework: str, batch_size: int, epochs: int, reason: str) -> dict[str, Any]:
    """The record of a cell that does not run on this device (``idiomatic_loops.device_refusal``): both sides
    ``skipped`` with the reason, no process started."""
    side = {"status": "skipped", "reason": reason, "throughput": None}
    return {"repeat": None, "framework": framework, "batch_size": batch_size, "epochs": epochs, "order": [],
            "harness": dict(side), "loop": dict(side), "ratio": None}


def auto_epochs(n_train: int, batch_size: int, warmup: int, min_steps: int, min_samples: int) -> int:
    """Epochs for at least ``min_steps`` timed steps and ``min_samples`` timed samples at ``batch_size``."""
    steps_per_epoch = n_train // batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"batch size {batch_size} exceeds the {n_train} training samples")
    steps = max(min_steps + warmup, math.ceil(min_samples / batch_size) + warmup)
    return max(1, math.ceil(steps / steps_per_epoch))


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}..{max(values):.3f}" if values else "n/a"


def summarize(runs: list[dict[str, Any]], cells: list[tuple[str, int]]) -> tuple[str, list[dict[str, Any]]]:
    """The Markdown table and its rows (one per framework and batch size)."""
    lines = [("| framework | batch | epochs | timed steps | harness samples/s | loop samples/s | loop (fastest) "
              "| ratio harness/loop | min..max | repeats | test acc harness / loop | goal >= 0.97 |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | --- | --- |"]
    rows = []
    for framework, batch in cells:
        cell = [r for r in runs if r["framework"] == framework and r["batch_size"] == batch]
        skipped = next((r["loop"]["reason"] for r in cell if r["loop"]["status"] == "skipped"), None)
        if skipped is not None:
            rows.append({"framework": framework, "batch_size": batch, "epochs": cell[0]["epochs"],
                         "ratio_median": None, "ratio_min": None, "ratio_max": None, "repeats": 0,
                         "harness_throughput_median": None, "loop_throughput_median": None, "loop_fastest": "n/a",
                         "goal_met": None, "failures": [], "skipped": skipped})
            lines.append(f"| {framework} | {batch} | {cell[0]['epochs']} |  |  |  |  |  |  | 0 |  | "
                         f"skipped: {skipped} |")
            continue
        ok = [r for r in cell if r["harness"]["status"] == "ok" and r["loop"]["status"] == "ok"]
        ratios = [r["ratio"] for r in ok]
        harness_tp = [r["harness"]["throughput"] for r in ok]
        loop_tp = [r["loop"]["throughput"] for r in ok]
        bests = [r["loop"]["best"] for r in ok]
        fastest = ", ".join(f"{name} {bests.count(name)}/{len(bests)}" for name in sorted(set(bests))) or "n/a"
        median = _median(ratios)
        failed = [f"{side} {r[side]['status']}: {r[side]['reason'][:80]}" for r in cell for side in ("harness", "loop")
                  if r[side]["status"] != "ok"]
        goal = "n/a" if not ratios else ("yes" if median >= GOAL else "NO")
        row = {"framework": framework, "batch_size": batch, "epochs": cell[0]["epochs"] if cell else None,
               "ratio_median": median, "ratio_min": min(ratios) if ratios else None,
               "ratio_max": max(ratios) if ratios else None, "repeats": len(ratios),
               "harness_throughput_median": _median(harness_tp), "loop_throughput_median": _median(loop_tp),
               "loop_fastest": fastest, "goal_met": None if not ratios else median >= GOAL, "failures": failed}
        rows.append(row)
        steps = ok[0]["harness"]["measured_steps"] if ok else "n/a"
        acc = (f"{_median([r['harness']['test_accuracy'] for r in ok]):.4f} / "
               f"{_median([r['loop']['test_accuracy'] for r in ok]):.4f}") if ok else "n/a"
        spread = _spread(ratios)
        lines.append(f"| {framework} | {batch} | {row['epochs']} | {steps} | {row['harness_throughput_median']:,.0f} "
                     f"| {row['loop_throughput_median']:,.0f} | {fastest} | {median:.3f} | {spread} | {len(ratios)} "
                     f"| {acc} | {goal} |")
        for failure in failed:
            lines.append(f"|  |  |  |  |  |  |  |  |  |  |  | failed: {failure} |")
    return "\n".join(lines), rows


def gpu_threads(device: str, cpu_threads: int | None) -> int | None:
    """The ``cpu_threads`` override: ``--cpu-threads`` where given; on a GPU else every available CPU, what a spec
    without ``cpu_threads`` gives a trial (the harness's default: the spec's one thread is sized for a 2-core CPU
    machine, and would put XLA's single-thread CPU flags on a GPU run); on the CPU else None (the spec's)."""
    if cpu_threads is not None or not device.startswith("cuda"):
        return cpu_threads
    return available_cpus()


def measure(args: argparse.Namespace, framework: str, batch: int, epochs: int, timing: dict[str, Any] | None,
            device: str, pythons: dict[str, str], repeat: int, index: int, log: Any) -> dict[str, Any]:
    """One repeat of one cell: each harness variant (``args.harness``, ``VARIANTS``) and the loop back to back, the
    order rotated from one repeat and cell to the next, on ``device``, with the trial's threads for all. The record's
    ``harness`` and ``ratio`` are the first variant's; ``variants`` and ``ratios`` hold every variant's."""
    spec = load_spec(args.spec, framework, batch, epochs, timing, args.evaluate_every, device, pythons,
                     gpu_threads(device, args.cpu_threads))
    threads = spec.cpu_threads or available_cpus()  # the trial's (harness.plan.plan), on a GPU as on the CPU
    sides = [*args.harness, "loop"]
    shift = (repeat + index) % len(sides)
    order = sides[shift:] + sides[:shift]
    run: dict[str, Any] = {"repeat": repeat, "framework": framework, "batch_size": batch, "epochs": epochs,
                           "order": order, "variants": {}}
    for side in order:
        if side == "loop":
            run["loop"] = run_loop(spec, args.spec, framework, batch, epochs, threads, device)
        else:
            sampler, start = VARIANTS[side]
            variant = spec if start is None else spec.model_copy(update={"worker_start": start})
            run["variants"][side] = run_harness(variant, sampler, device)
    lp = run["loop"]
    run["ratios"] = {name: (h["throughput"] / lp["throughput"] if h["status"] == lp["status"] == "ok" else None)
                     for name, h in run["variants"].items()}
    first = args.harness[0]
    run["harness"], run["ratio"] = run["variants"][first], run["ratios"][first]
    h = run["harness"]
    detail = (f"ratio {run['ratio']:.3f} (harness {h['throughput']:,.0f}, loop {lp['throughput']:,.0f} "
              f"samples/s, {lp['best']})" if run["ratio"] is not None else
              f"harness {h['status']} {h['reason'][:100]}; loop {lp['status']} {lp['reason'][:100]}")
    others = ", ".join(f"{name} {ratio:.3f}" for name, ratio in run["ratios"].items()
                       if name != first and ratio is not None)
    log(f"repeat {repeat + 1}/{args.repeats} {framework} bs {batch} ({order[0]} first): {detail}"
        + (f"; {others}" if others else ""))
    return run


def summarize_variants(runs: list[dict[str, Any]], cells: list[tuple[str, int]],
                       variants: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The harness variants side by side (``--harness`` with more than one): per cell and variant, the paired
    ratio to the loop and to the first variant (within a repeat, both ok), each as median and min..max over
    repeats. With ``unsampled,sampled`` the second's ratio to the first is what the sampler costs the trial."""
    reference = variants[0]
    lines = [f"| framework | batch | harness | samples/s | ratio to loop | min..max | ratio to {reference} | min..max "
             "| repeats |", "| --- | ---: | --- | ---: | ---: | --- | ---: | --- | ---: |"]
    rows = []
    for framework, batch in cells:
        cell = [r for r in runs if r["framework"] == framework and r["batch_size"] == batch and "ratios" in r]
        for name in variants:
            ok = [r["variants"][name]["throughput"] for r in cell if r["variants"][name]["status"] == "ok"]
            to_loop = [r["ratios"][name] for r in cell if r["ratios"][name] is not None]
            to_first = [r["variants"][name]["throughput"] / r["variants"][reference]["throughput"] for r in cell
                        if r["variants"][name]["status"] == r["variants"][reference]["status"] == "ok"]
            row = {"framework": framework, "batch_size": batch, "variant": name, "throughput_median": _median(ok),
                   "loop_ratio_median": _median(to_loop), "loop_ratio_min": min(to_loop, default=None),
                   "loop_ratio_max": max(to_loop, default=None), "reference": reference,
                   "reference_ratio_median": _median(to_first), "reference_ratio_min": min(to_first, default=None),
                   "reference_ratio_max": max(to_first, default=None), "repeats": len(to_loop)}
            rows.append(row)
            lines.append(f"| {framework} | {batch} | {name} | {row['throughput_median']:,.0f} | "
                         f"{row['loop_ratio_median']:.3f} | {_spread(to_loop)} | {row['reference_ratio_median']:.3f} "
                         f"| {_spread(to_first)} | {len(to_loop)} |")
    return "\n".join(lines), rows


def parse_pythons(parser: argparse.ArgumentParser, items: list[str],
                  frameworks: tuple[str, ...] = FRAMEWORKS) -> dict[str, str]:
    """``--python FRAMEWORK=PYTHON`` items as {framework: interpreter}, a path (not a bare name looked up in PATH)
    made absolute: the benchmarks start their processes with the repository as the working directory. A missing
    ``=`` or a framework not in ``frameworks`` is a usage error (``parser.error``: exit 2)."""
    pythons: dict[str, str] = {}
    for item in items:
        name, _, python = item.partition("=")
        if not python:
            parser.error(f"--python takes FRAMEWORK=PYTHON, not {item!r}")
        if name not in frameworks:
            parser.error(f"--python {item}: unknown framework {name!r}; expected one of {', '.join(frameworks)}")
        pythons[name] = str(Path(python).absolute()) if os.sep in python else python
    return pythons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quick.yaml"),
                        help="model, dataset, optimizer, threads, warm-up, timing, sampler and interpreters "
                             "(default: specs/quick.yaml)")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated (default: all four)")
    parser.add_argument("--batch-sizes", default="64,512", help="default: 64,512")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of every measurement (default: per batch size, see --min-steps/--min-samples)")
    parser.add_argument("--min-steps", type=int, default=100, help="timed steps at least (default: 100)")
    parser.add_argument("--min-samples", type=int, default=60000,
                        help="timed samples at least, about 2 s here (default: 60000)")
    parser.add_argument("--timing", default=None,
                        help="JSON that replaces the spec's timing block, e.g. '{\"window\": \"step\"}' "
                             "(default: the spec's, i.e. what a user's run does)")
    parser.add_argument("--evaluate-every", type=int, default=None,
                        help="the harness evaluates after every k-th epoch (default: after the last only, as the loop "
                             "does, so both do the same work; 1 shows what per-epoch evaluation costs the timing)")
    parser.add_argument("--no-sampler", action="store_true",
                        help="run the harness trials without the sampler (default: the spec's sampler, as in a run); "
                             "the same as --harness unsampled")
    parser.add_argument("--harness", default=None,
                        help="comma-separated harness trials to run beside the loop in every repeat, each changing "
                             f"one thing of a user's run: {', '.join(VARIANTS)} (default: sampled); the first is the "
                             "main table's, the others are compared with it and with the loop (e.g. "
                             "unsampled,sampled,unsampled-cold: what the sampler and what a forked start cost)")
    parser.add_argument("--out", default=None,
                        help="raw results as JSON (default: results/harness_vs_loop-<UTC time>.json)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda:N: the harness trial, its sampler and the loop (cuda means "
                             "cuda:0; on a GPU PyTorch and JAX only, the other cells are recorded skipped)")
    parser.add_argument("--python", action="append", default=[], metavar="FRAMEWORK=PYTHON",
                        help="the interpreter of a framework's worker and loop, instead of its spec entry's "
                             "(e.g. pytorch=python3 on a machine without envs/); repeatable")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="intra-op CPU threads of the worker and the loop (default: the spec's cpu_threads on the "
                             "CPU; on a GPU every available CPU, the harness's default for a spec without it)")
    args = parser.parse_args(argv)
    if args.harness is not None and args.no_sampler:
        parser.error("--no-sampler and --harness: give one (--no-sampler is --harness unsampled)")
    args.harness = (args.harness or ("unsampled" if args.no_sampler else "sampled")).split(",")
    unknown = [name for name in args.harness if name not in VARIANTS]
    if unknown or len(set(args.harness)) < len(args.harness):
        parser.error(f"--harness takes distinct names of {', '.join(VARIANTS)}, not {', '.join(args.harness)}")

    frameworks = args.frameworks.split(",")
    unknown = set(frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown framework(s): {', '.join(sorted(unknown))}")
    device = "cuda:0" if args.device == "cuda" else args.device
    if not DEVICE.fullmatch(device):
        parser.error(f"--device is cpu or cuda:N, not {args.device!r}")
    pythons = parse_pythons(parser, args.python)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    timing = json.loads(args.timing) if args.timing else None
    if args.cpu_threads is not None and args.cpu_threads < 1:
        parser.error(f"--cpu-threads must be at least 1, not {args.cpu_threads}")
    base = load_spec(args.spec, frameworks[0], batches[0], 1, timing, device=device, pythons=pythons,
                     cpu_threads=gpu_threads(device, args.cpu_threads))
    n_train = len(datasets.load(base.dataset, seed=base.seed).y_train)
    epochs = {b: args.epochs or auto_epochs(n_train, b, base.warmup_steps, args.min_steps, args.min_samples)
              for b in batches}
    cells = list(itertools.product(frameworks, batches))
    out_path = Path(args.out) if args.out else (
        ROOT / "results" / f"harness_vs_loop-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json")
    started = time.monotonic()
    load_before = os.getloadavg()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    runs: list[dict[str, Any]] = []
    refused = {cell: reason for cell in cells if (reason := device_refusal(cell[0], device)) is not None}
    for (framework, batch), reason in refused.items():
        runs.append(skipped_run(framework, batch, epochs[batch], reason))
        log(f"{framework} bs {batch} skipped: {reason}")
    with Workers():  # the preloaded parents of forked workers, ended after the last (each holds a framework's memory)
        for repeat in range(args.repeats):
            for index, (framework, batch) in enumerate(cells):
                if (framework, batch) not in refused:
                    runs.append(measure(args, framework, batch, epochs[batch], timing, device, pythons, repeat,
                                        index, log))

    table, rows = summarize(runs, cells)
    variant_table, variant_rows = summarize_variants(runs, cells, args.harness) if len(args.harness) > 1 else ("", [])
    load_after = os.getloadavg()
    timing_text = json.dumps(timing) if timing is not None else f"the spec's ({json.dumps(base.timing.model_dump())})"
    print(f"Harness vs idiomatic loop: spec {args.spec}, device {device}, "
          f"{base.cpu_threads or available_cpus()} intra-op thread(s), {available_cpus()} CPUs, timing {timing_text}, "
          f"sampler {base.sampler.interval_s:g} s, harness trials {', '.join(args.harness)}, "
          f"warm-up {base.warmup_steps} step(s), "
          "harness evaluation "
          f"{f'every {args.evaluate_every} epoch(s)' if args.evaluate_every else 'after the last epoch'}, "
          f"{args.repeats} repeats, {time.monotonic() - started:.0f} s in all")
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}: other load on the machine shows up as noise")
    print("ratio = harness throughput / loop throughput in the same repeat (below 1: the harness is slower); "
          f"goal: median >= {GOAL}\n")
    print(table)
    if variant_table:
        print(f"\nThe harness trials side by side (ratio to {args.harness[0]}: paired within a repeat)\n")
        print(variant_table)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "spec": args.spec, "device": device, "pythons": pythons, "threads": base.cpu_threads or available_cpus(),
        "frameworks": frameworks, "batch_sizes": batches, "repeats": args.repeats,
        "epochs": {str(b): e for b, e in epochs.items()}, "timing_override": timing,
        "sampler": VARIANTS[args.harness[0]][0], "harness_variants": args.harness, "variant_summary": variant_rows,
        "evaluate_every": args.evaluate_every,
        "cpus": available_cpus(), "load_before": load_before, "load_after": load_after, "goal": GOAL,
        "summary": rows, "runs": runs}, indent=1, default=str))
    print(f"\nraw results: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

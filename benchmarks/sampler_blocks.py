"""What does the sampler cost the training it watches, measured inside one training process? Blocks of the same
steps, timed with the sampler on and off in turn, compared pair by pair.

``benchmarks/sampler_overhead.py`` compares whole trials with and without the sampler; identical trials differ by 6
to 40 % on a shared machine and by up to 20 % on a GPU (docs/findings/2026-11-26-gpu-run.md), so a cost of 0.5 %
(the goal) cannot show there. Here the differences between processes are gone: one process trains throughout, and
only the sampler changes between its blocks.

What runs, per framework (PyTorch and JAX: the adapters of ``benchmarks/step_host_costs.py``, driven directly on the
spec's model and data, default ``specs/quick.yaml``):

- a training process in the framework's interpreter (the spec entry's, or ``--python``) with the worker's
  environment (``harness.execution.launcher.worker_settings`` of the trial's threads); after a warm-up it sizes a
  block to about ``--block-seconds`` (from a run of at least a quarter of that) and then times blocks of that many
  steps on request, each synced at both edges (``Adapter.wait``), its epochs' batches made before the clock (as the
  harness's loop stages them);
- this process stands where the launcher stands: before each block it starts the harness's own sampler
  (``harness.measure.sampler.Sampler`` with ``make_backend`` of the device: NVML on a GPU, psutil on the CPU) watching
  the training process at ``--interval`` (the spec's), or leaves it off, and stops it after the block.

Blocks come in pairs, one sampled and one not, in the order ABBA (on-off, off-on, ...), after one unrecorded pair;
each pair gives one ratio, sampled / unsampled throughput (below 1: a slowdown). The table gives the median ratio, its
min..max, a 95 % bootstrap confidence interval of the median (``scipy.stats.bootstrap``) and a verdict against the
goal (at most 0.5 % slower): met when the interval lies above 0.995, not met when below it, else inconclusive; and how
many samples a sampled block held, the backend's median call time and the sampler thread's busy share of a core.

    .venv/bin/python benchmarks/sampler_blocks.py --frameworks pytorch                 # the CPU: psutil
    python3 benchmarks/sampler_blocks.py --device cuda:0 --python pytorch=python3 --python jax=python3 --out /tmp/sb

Prints the table and writes ``sampler_blocks.json`` (every block) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL = 0.995  # the sampler may cost at most 0.5 % of throughput (issue 39)
FRAMEWORKS = ("pytorch", "jax")


def train(args: argparse.Namespace) -> int:
    """The training process (``--train``): one JSON line ``{"pid", "steps"}`` when ready, then one ``{"seconds"}``
    line per ``block`` line read from standard input, until ``end`` or end of input."""
    from benchmarks.step_host_costs import Bench

    bench = Bench(args.frameworks, args.spec, args.device, args.batch_size, threads=args.threads)
    bench.staged_steps(args.warmup_steps)  # compilation, autotuning, the allocator's first blocks
    steps = args.min_steps
    while (seconds := bench.staged_steps(steps)) < args.block_seconds / 4 and steps < 1_000_000:
        steps *= 2  # until a run is long enough to size a block from
    per_step = seconds / steps
    steps = max(args.min_steps, math.ceil(args.block_seconds / per_step))
    print(json.dumps({"pid": os.getpid(), "steps": steps, "per_step_s": per_step}), flush=True)
    for line in sys.stdin:
        if line.strip() != "block":
            break
        print(json.dumps({"seconds": bench.staged_steps(steps)}), flush=True)
    return 0


def order(pairs: int) -> list[bool]:
    """Sampled (True) or not for each block: one unrecorded pair, then ``pairs`` pairs in ABBA order."""
    out = [True, False]
    for pair in range(pairs):
        out += [True, False] if pair % 2 == 0 else [False, True]
    return out


def confidence(ratios: list[float]) -> tuple[float, float]:
    """The 95 % bootstrap confidence interval of the median of ``ratios`` (scipy.stats.bootstrap, percentile)."""
    from scipy import stats

    if len(set(ratios)) < 2:
        return ratios[0], ratios[0]
    options = {"confidence_level": 0.95, "method": "percentile", "n_resamples": 2000}
    try:
        result = stats.bootstrap((np.asarray(ratios),), np.median, rng=np.random.default_rng(0), **options)
    except TypeError:  # scipy before 1.15 names it random_state
        result = stats.bootstrap((np.asarray(ratios),), np.median, random_state=np.random.default_rng(0), **options)
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def verdict(low: float, high: float) -> str:
    return "met" if low >= GOAL else ("not met" if high < GOAL else "inconclusive")


def measure(framework: str, python: list[str], args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """The blocks of one framework: its training process, sampled in turn by a sampler in this process."""
    from harness.execution.launcher import worker_settings
    from harness.measure.sampler import Sampler, make_backend

    argv = [*python, str(Path(__file__).resolve()), "--train", "--frameworks", framework, "--spec", args.spec,
            "--device", args.device, "--batch-size", str(args.batch_size), "--block-seconds",
            str(args.block_seconds), "--min-steps", str(args.min_steps), "--warmup-steps", str(args.warmup_steps),
            "--threads", str(threads)]
    env = {**os.environ, **worker_settings(threads)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    backend, note = make_backend(args.device)
    blocks: list[dict[str, Any]] = []
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the training process exited ({proc.wait()}) before it was ready")
        ready = json.loads(line)
        for sampled in order(args.pairs):
            sampler = Sampler(backend, args.interval) if sampled else None
            if sampler is not None:
                sampler.start(ready["pid"])
            started = time.monotonic()
            proc.stdin.write("block\n")
            proc.stdin.flush()
            reply = proc.stdout.readline()
            wall = time.monotonic() - started
            if sampler is not None:
                sampler.stop()
            if not reply:
                raise RuntimeError(f"the training process exited ({proc.wait()}) inside a block")
            block: dict[str, Any] = {"sampled": sampled, "seconds": json.loads(reply)["seconds"], "wall_s": wall}
            if sampler is not None:
                block.update(samples=len(sampler.samples), errors=sampler.errors[:3],
                             call_s=float(np.median(sampler.call_seconds)) if sampler.call_seconds else None,
                             busy_s=float(np.sum(sampler.call_seconds)))
            blocks.append(block)
        proc.stdin.write("end\n")
        proc.stdin.flush()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        backend.close()
    return {"framework": framework, "steps_per_block": ready["steps"], "per_step_s": ready["per_step_s"],
            "backend": backend.name, "backend_note": note, "blocks": blocks, **summarize(blocks, ready["steps"])}


def summarize(blocks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The pairs' ratios (sampled / unsampled throughput: unsampled seconds over sampled), the first pair left out."""
    pairs = [blocks[i:i + 2] for i in range(2, len(blocks) - 1, 2)]
    ratios = [next(b for b in pair if not b["sampled"])["seconds"] / next(b for b in pair if b["sampled"])["seconds"]
              for pair in pairs]
    sampled = [b for b in blocks[2:] if b["sampled"]]
    low, high = confidence(ratios)
    calls = [b["call_s"] for b in sampled if b["call_s"] is not None]
    return {"pairs": len(ratios), "ratios": ratios, "ratio_median": float(np.median(ratios)),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "ci95": [low, high], "verdict": verdict(low, high),
            "samples_per_block": float(np.median([b["samples"] for b in sampled])),
            "call_ms": float(np.median(calls)) * 1e3 if calls else None,
            "busy_percent": 100 * sum(b["busy_s"] for b in sampled) / sum(b["wall_s"] for b in sampled),
            "unsampled_step_us": float(np.median([b["seconds"] for b in blocks[2:] if not b["sampled"]])) / steps * 1e6}


def table(results: list[dict[str, Any]], interval: float) -> str:
    lines = ["| framework | backend | steps/block | step (us, unsampled) | ratio sampled/unsampled (median) | min..max "
             f"| 95 % CI | pairs | goal >= {GOAL} | samples/block | call (ms) | sampler busy (% of a core) |",
             "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['framework']} | failed: {r['error']} |  |  |  |  |  |  |  |  |  |  |")
            continue
        call = f"{r['call_ms']:.2f}" if r["call_ms"] is not None else "n/a"
        lines.append(f"| {r['framework']} | {r['backend']} ({interval * 1e3:g} ms) | {r['steps_per_block']} "
                     f"| {r['unsampled_step_us']:,.0f} | {r['ratio_median']:.4f} | {r['ratio_min']:.3f}.."
                     f"{r['ratio_max']:.3f} | {r['ci95'][0]:.4f}..{r['ci95'][1]:.4f} | {r['pairs']} | {r['verdict']} "
                     f"| {r['samples_per_block']:g} | {call} | {r['busy_percent']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quick.yaml"))
    parser.add_argument("--frameworks", default="pytorch,jax", help="comma-separated: pytorch, jax")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=10, help="recorded pairs of blocks (default 10)")
    parser.add_argument("--block-seconds", type=float, default=1.0, help="a block's length, about (default 1)")
    parser.add_argument("--min-steps", type=int, default=20, help="steps of a block at least (default 20)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="untimed steps before anything (default 20)")
    parser.add_argument("--interval", type=float, default=None, help="the sampler's, s (default: the spec's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="the training process's CPU threads (default: the spec's cpu_threads on the CPU, every "
                             "available CPU on a GPU, as harness_vs_loop)")
    parser.add_argument("--python", action="append", default=[], metavar="FRAMEWORK=PYTHON",
                        help="the training process's interpreter instead of the spec entry's; repeatable")
    parser.add_argument("--out", default=None, help="folder for sampler_blocks.json")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train:
        return train(args)

    from benchmarks.harness_vs_loop import parse_pythons
    from harness import plan as plan_module

    frameworks = args.frameworks.split(",")
    if unknown := sorted(set(frameworks) - set(FRAMEWORKS)):
        parser.error(f"--frameworks: {', '.join(unknown)} not one of {', '.join(FRAMEWORKS)}")
    if args.pairs < 2 or args.block_seconds <= 0:
        parser.error("--pairs must be at least 2 and --block-seconds above 0")
    pythons = parse_pythons(parser, args.python, FRAMEWORKS)
    spec = plan_module.load(args.spec)
    args.interval = args.interval or spec.sampler.interval_s
    threads = args.threads or (spec.cpu_threads if args.device == "cpu" and spec.cpu_threads
                               else plan_module.available_cpus())
    results = []
    for framework in frameworks:
        python = [pythons[framework]] if framework in pythons else plan_module.entry_for(spec, framework).argv()
        try:
            results.append(measure(framework, python, args, threads))
        except Exception as exc:  # noqa: BLE001 - one framework's failure must leave the other's figures
            results.append({"framework": framework, "error": f"{type(exc).__name__}: {exc}"})
        print(f"{framework}: " + json.dumps({k: v for k, v in results[-1].items() if k not in ("blocks", "ratios")}),
              file=sys.stderr, flush=True)
    print(f"Sampler on/off in alternate blocks of one training process: spec {args.spec}, device {args.device}, "
          f"batch {args.batch_size}, {threads} thread(s), {args.pairs} pairs (ABBA) of about {args.block_seconds:g} s "
          f"blocks\n")
    print(table(results, args.interval))
    folder = Path(args.out) if args.out else Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sampler_blocks.json").write_text(json.dumps(
        {"spec": args.spec, "device": args.device, "batch_size": args.batch_size, "threads": threads,
         "interval_s": args.interval, "pairs": args.pairs, "block_seconds": args.block_seconds, "goal": GOAL,
         "results": results}, indent=1), encoding="utf-8")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

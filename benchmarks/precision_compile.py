"""What precision and compilation buy, per framework: throughput ratios bf16 / fp32 and compiled / eager, and the
seconds the first step takes (compilation included), measured with real harness trials side by side.

For each repeat, framework and batch size, the four combinations fp32-eager, fp32-compiled, bf16-eager and
bf16-compiled run back to back, each a real harness trial (``harness.plan`` -> ``run_worker``: a fresh worker, the
spec's sampler and timing), in an order that rotates from repeat to repeat so that drift of the machine spreads
over all four. The ratios are paired within a repeat (bf16-eager / fp32-eager, compiled-fp32 / eager-fp32); the table
gives their median and min..max over the repeats, the median throughputs and the median first-step seconds of
each combination. A combination the framework cannot run (JAX has no eager mode; a precision the device lacks) is
``unsupported``, reported as such. "eager" and "compiled" mean each framework's own modes (the adapters'
``COMPILE_MODES``: PyTorch eager / torch.compile; TensorFlow tf.function / with XLA; MXNet imperative / hybridized;
JAX jit only).

    .venv/bin/python benchmarks/precision_compile.py                      # every framework, batch 64 and 512, 3 repeats
    .venv/bin/python benchmarks/precision_compile.py --frameworks pytorch,tensorflow --repeats 5 --out /tmp/pc.json
    .venv/bin/python benchmarks/precision_compile.py --device cuda:0      # the same on a GPU (add --precision fp16)

Reading it: a ratio above 1 is a speed-up. On a CPU without native bf16 matrix units, bf16 often runs slower (the
conversions cost more than the narrower arithmetic saves); on a GPU with Tensor Cores it should be several times
faster. Each trial's first step is reported apart (its compile seconds) and is never inside its throughput. The
noise of a shared machine shows as a wide min..max: single repeats on the 2-core development VM swing by 25 %.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness import plan as plan_module  # noqa: E402
from harness.execution.launcher import run_worker  # noqa: E402
from harness.execution.protocol import Payload  # noqa: E402
from harness.record import TrialMetrics  # noqa: E402

FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax")
MODES = ("eager", "compiled")


def run_trial(spec_path: str, framework: str, batch_size: int, precision: str, mode: str, epochs: int,
              device: str) -> dict[str, Any]:
    """One harness trial of the spec with the framework, batch size, precision, mode, epochs and device set; the
    plan-time decision first (an unsupported combination starts no worker)."""
    spec = plan_module.load(spec_path, {"frameworks": [framework], "batch_sizes": [batch_size], "epochs": epochs,
                                        "repeats": 1, "device": device, "precision": precision, "compile": mode,
                                        "variants": None})
    reason = plan_module.unsupported_reason(spec, framework, device=device)
    if reason is not None:
        return {"status": "unsupported", "reason": reason, "throughput": None, "first_step_seconds": None}
    (trial,) = plan_module.plan(spec, device)
    outcome = run_worker(Payload(trial=trial), spec.timeout_s, spec.sampler.interval_s, device,
                         trial.threads)
    result = outcome.result()
    metrics = result.metrics if result is not None else TrialMetrics()
    return {"status": outcome.status, "reason": outcome.reason, "throughput": metrics.throughput_samples_per_s,
            "first_step_seconds": metrics.first_step_s, "test_accuracy": metrics.test_accuracy,
            "measured_steps": metrics.measured_steps, "wall_s": outcome.wall_seconds}


def _stats(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{np.median(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def summarize(runs: list[dict[str, Any]], low: str) -> str:
    """The Markdown table: one row per framework and batch size."""
    lines = [f"| framework | batch | {low} / fp32 (eager) | compiled / eager (fp32) | samples/s fp32 eager | "
             f"fp32 compiled | {low} eager | {low} compiled | first step s (fp32 eager / compiled) | repeats |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for framework, batch in sorted({(r["framework"], r["batch_size"]) for r in runs},
                                   key=lambda k: (FRAMEWORKS.index(k[0]) if k[0] in FRAMEWORKS else 99, k[1])):
        cell = [r for r in runs if r["framework"] == framework and r["batch_size"] == batch]
        by_repeat: dict[int, dict[tuple[str, str], dict[str, Any]]] = {}
        for r in cell:
            by_repeat.setdefault(r["repeat"], {})[(r["precision"], r["mode"])] = r["result"]

        def ratios(a: tuple[str, str], b: tuple[str, str],
                   by_repeat: dict[int, dict[tuple[str, str], dict[str, Any]]] = by_repeat) -> list[float]:
            return [rep[a]["throughput"] / rep[b]["throughput"] for rep in by_repeat.values()
                    if rep.get(a, {}).get("throughput") and rep.get(b, {}).get("throughput")]

        def median_of(key: tuple[str, str], field: str,
                      by_repeat: dict[int, dict[tuple[str, str], dict[str, Any]]] = by_repeat) -> str:
            values = [rep[key][field] for rep in by_repeat.values() if rep.get(key, {}).get(field)]
            if values:
                return f"{np.median(values):,.1f}" if field == "throughput" else f"{np.median(values):.2f}"
            statuses = {rep[key]["status"] for rep in by_repeat.values() if key in rep}
            return "/".join(sorted(statuses)) or "n/a"

        lines.append(
            f"| {framework} | {batch} | {_stats(ratios((low, 'eager'), ('fp32', 'eager')))} | "
            f"{_stats(ratios(('fp32', 'compiled'), ('fp32', 'eager')))} | "
            + " | ".join(median_of((p, m), "throughput") for p in ("fp32", low) for m in MODES)
            + f" | {median_of(('fp32', 'eager'), 'first_step_seconds')} / "
              f"{median_of(('fp32', 'compiled'), 'first_step_seconds')} | {len(by_repeat)} |")
    reasons = sorted({f"{r['framework']} {r['precision']} {r['mode']}: {r['result']['reason']}" for r in runs
                      if r["result"]["status"] != "ok"})
    return "\n".join(lines + ([""] + [f"- not ok: {reason}" for reason in reasons] if reasons else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quick.yaml"), help="default: specs/quick.yaml")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated (default: all four)")
    parser.add_argument("--batch-sizes", default="64,512", help="default: 64,512")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default: 3)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per trial (default: 4)")
    parser.add_argument("--precision", default="bf16", help="the low precision against fp32 (default: bf16)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default: cpu)")
    parser.add_argument("--out", default=None, help="raw results as JSON")
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    combos = [(p, m) for p in ("fp32", args.precision) for m in MODES]
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    for repeat in range(args.repeats):
        for framework, batch in itertools.product(frameworks, sizes):
            shift = repeat % len(combos)
            for precision, mode in combos[shift:] + combos[:shift]:
                result = run_trial(args.spec, framework, batch, precision, mode, args.epochs, args.device)
                runs.append({"repeat": repeat, "framework": framework, "batch_size": batch, "precision": precision,
                             "mode": mode, "result": result})
                tp = result["throughput"]
                print(f"[{time.monotonic() - started:7.1f} s] repeat {repeat + 1}/{args.repeats} {framework} bs "
                      f"{batch} {precision} {mode}: {result['status']}"
                      + (f" {tp:,.0f} samples/s, first step {result['first_step_seconds']:.2f} s" if tp else
                         f" ({result['reason'][:100]})"), file=sys.stderr, flush=True)
    table = summarize(runs, args.precision)
    print(f"\nratios paired within a repeat; median (min..max) over {args.repeats} repeat(s); device {args.device}\n")
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2, default=str) + "\n")
        print(f"\nraw results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does ``harness advise`` pick a batch size that reaches the target as fast as an exhaustive search would, and for
how much less compute (issue 56)?

For one framework entry of a spec, interleaved over ``--rounds``: ``harness advise SPEC --objective time`` (no
``--validate``), the command a user runs, then the exhaustive sweep: every candidate size advise measured x ``--seeds``
seeds trained until the target test accuracy (``stop_at_target``, the spec's learning-rate rule, up to
``--max-epochs``), the seconds of timed training to the target read from each trial (``time_to_target.training_s``).
Printed: per size the median and range over seeds of the seconds to target and the share of seeds that reached it;
advise's pick against the exhaustive best (the ratio of their medians, goal <= 1.25), its predicted seconds beside the
measured; and the compute each spent (workers' wall seconds summed: advise's run directories against the sweep's).

    .venv/bin/python benchmarks/advise_vs_sweep.py --spec specs/quick.yaml --framework pytorch --target 0.95
    .venv/bin/python benchmarks/advise_vs_sweep.py --json /tmp/advise_vs_sweep.json
    .venv/bin/python benchmarks/advise_vs_sweep.py --spec specs/own_model.yaml --target 0.97 \
        --set learning_rate_scaling=sqrt --set base_batch_size=64 --set cpu_threads=1

Each round's advise and sweep write their run directories under a temporary folder (``--out`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def worker_seconds(folder: Path) -> float:
    """The summed wall seconds of every trial under ``folder`` (each run directory's trials.jsonl)."""
    total = 0.0
    for trials in folder.rglob("trials.jsonl"):
        total += sum(json.loads(line).get("wall_s") or 0.0 for line in trials.read_text().splitlines() if line)
    return total


def run_advise(args: argparse.Namespace, out: Path, validate: bool = False) -> dict[str, Any]:
    """``harness advise`` as a user runs it (with ``--validate`` where asked): its advice.json, wall seconds and
    workers' seconds."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "harness", "advise", args.spec, "--framework", args.framework,
                           "--objective", "throughput,time", "--target-accuracy", str(args.target), "--repeats",
                           str(args.repeats), "--out", str(out)] + (["--validate"] if validate else []),
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"advise failed ({done.returncode}): {done.stderr[-2000:]}")
    folder = next(out.glob("advise-*"))
    advice = json.loads((folder / "advice.json").read_text())
    return {"advice": advice, "wall_s": time.perf_counter() - started, "worker_s": worker_seconds(folder)}


def run_sweep(args: argparse.Namespace, sizes: list[int], out: Path) -> dict[str, Any]:
    """Every size x seed trained to the target: per size the seconds to target of each seed (None: not reached)."""
    from harness import plan
    from harness import spec as spec_module
    from harness.plan.entries import entry_named
    from harness.results.store import read_trials
    from harness.studies.advise.trials import evaluation_samples, train_size_of
    from harness.studies.sweep import run_spec

    base = spec_module.load(args.spec)
    entry = entry_named(base, args.framework, args.spec)
    data = base.model_dump(mode="json", exclude_none=True)
    data.update(frameworks=[entry.model_dump(mode="json", exclude_none=True)], batch_sizes=sizes,
                seeds=list(range(args.seeds)), repeats=1, epochs=args.max_epochs, target_accuracy=args.target,
                stop_at_target=True, evaluate_every=1, evaluate_every_samples=evaluation_samples(train_size_of(base)),
                name=f"{base.name}-exhaustive")
    data.pop("variants", None)
    spec = plan.checked_spec(data, args.spec)
    started = time.perf_counter()
    run_dir = run_spec(spec, out, args.spec)
    wall = time.perf_counter() - started
    reached: dict[int, list[float | None]] = {size: [] for size in sizes}
    for record in read_trials(run_dir):
        hit = record.metrics.time_to_target if record.ok else None
        reached[record.batch_size].append(None if hit is None else hit.training_s)
    return {"reached": reached, "wall_s": wall, "worker_s": worker_seconds(run_dir)}


def overridden(spec: Path, sets: list[str]) -> Path:
    """A copy of ``spec`` with each ``KEY=VALUE`` of ``sets`` at its top level (the value read as YAML), written
    beside it (a model of your own is found relative to the spec's folder); the caller removes it."""
    import yaml

    data = yaml.safe_load(spec.read_text())
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: KEY=VALUE")
        data[key] = yaml.safe_load(value)
    handle, name = tempfile.mkstemp(prefix=f".{spec.stem}-", suffix=".yaml", dir=spec.parent)
    with open(handle, "w") as out:
        yaml.safe_dump(data, out, sort_keys=False)
    return Path(name)


def summary(sizes_s: dict[int, list[float | None]]) -> dict[int, dict[str, Any]]:
    out = {}
    for size, values in sizes_s.items():
        hits = [v for v in values if v is not None]
        out[size] = {"median": statistics.median(hits) if len(hits) * 2 > len(values) else None,
                     "min": min(hits, default=None), "max": max(hits, default=None),
                     "reached": f"{len(hits)}/{len(values)}"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(ROOT / "specs" / "quick.yaml"))
    parser.add_argument("--framework", default="pytorch")
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to reach (default 0.95)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per size in the exhaustive sweep (default 5)")
    parser.add_argument("--max-epochs", type=int, default=30, help="the sweep's epochs at most (default 30)")
    parser.add_argument("--repeats", type=int, default=3, help="advise's throughput repeats (default 3)")
    parser.add_argument("--rounds", type=int, default=1, help="advise and sweep, interleaved (default 1)")
    parser.add_argument("--validate", action="store_true",
                        help="also run advise --validate each round, its measured best against the sweep's")
    parser.add_argument("--out", help="keep the run directories here (default: a temporary folder)")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change the spec's top-level KEY for both sides, e.g. learning_rate_scaling=sqrt")
    args = parser.parse_args(argv)
    keep = Path(args.out) if args.out else None
    derived = overridden(Path(args.spec), args.set) if args.set else None
    shown, args.spec = args.spec, str(derived or args.spec)
    try:
        rounds = compare(args, keep)
    finally:
        if derived is not None:
            derived.unlink()
    args.spec = shown + "".join(f" --set {item}" for item in args.set)
    report(args, rounds)
    return 0


def compare(args: argparse.Namespace, keep: Path | None) -> list[dict[str, Any]]:
    """``--rounds`` of advise (and ``--validate`` where asked) then the exhaustive sweep, interleaved."""
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = keep or Path(tmp)
        for index in range(args.rounds):
            advised = run_advise(args, root / f"round{index}" / "advise")
            answer = advised["advice"]["entries"]
            (label,) = answer
            sizes = advised["advice"]["candidates"]
            swept = run_sweep(args, sizes, root / f"round{index}" / "sweep")
            rounds.append({"advise": {k: v for k, v in advised.items() if k != "advice"},
                           "time": answer[label]["objectives"]["time"], "noise": answer[label]["noise_scale"],
                           "sizes": sizes, "sweep": swept})
            if args.validate:
                checked = run_advise(args, root / f"round{index}" / "validate", validate=True)
                rounds[-1]["validate"] = {"wall_s": checked["wall_s"], "worker_s": checked["worker_s"],
                                          "validation": checked["advice"]["entries"][label]["objectives"]["time"]
                                          .get("validation")}
    return rounds


def report(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> None:
    """Each round's table, its ratio and compute, and the medians over the rounds (``--json``: every figure)."""
    for index, one in enumerate(rounds):
        table = summary(one["sweep"]["reached"])
        pick = one["time"].get("batch_size")
        predicted = {r["batch_size"]: r["seconds"] for r in one["time"].get("rows") or []}
        finite = {size: row["median"] for size, row in table.items() if row["median"] is not None}
        best = min(finite, key=finite.get) if finite else None
        print(f"round {index + 1}: {args.spec} {args.framework}, target {args.target}, {args.seeds} seeds; noise scale "
              f"{(one['noise'] or {}).get('b_simple')}; advise picked {pick}, the exhaustive best {best}")
        print("| batch size | seconds to target, median | min..max | reached | advise's prediction |")
        print("| ---: | ---: | --- | --- | ---: |")
        for size, row in table.items():
            median = "" if row["median"] is None else f"{row['median']:.3f}"
            spread = "" if row["min"] is None else f"{row['min']:.3f}..{row['max']:.3f}"
            guess = predicted.get(size)
            print(f"| {size}{' (advise)' if size == pick else ''}{' (best)' if size == best else ''} | {median} | "
                  f"{spread} | {row['reached']} | {'' if guess is None else f'{guess:.3f}'} |")
        ratio = (finite.get(pick) / finite[best]) if pick in finite and best is not None else None
        one["ratio"] = ratio
        print(f"advise's pick / the best: {'n/a' if ratio is None else f'{ratio:.2f}'} (goal <= 1.25); compute: "
              f"advise {one['advise']['worker_s']:.1f} worker s ({one['advise']['wall_s']:.1f} s wall), the sweep "
              f"{one['sweep']['worker_s']:.1f} worker s ({one['sweep']['wall_s']:.1f} s wall): "
              f"{one['advise']['worker_s'] / max(one['sweep']['worker_s'], 1e-9):.2f} of it")
        one["compute"] = one["advise"]["worker_s"] / max(one["sweep"]["worker_s"], 1e-9)
        checked = one.get("validate")
        if checked and checked["validation"]:
            v = checked["validation"]
            measured = v["measured_best"]
            against = (finite.get(measured) / finite[best]) if measured in finite and best is not None else None
            one["validated_ratio"] = against
            held = "held" if v["held"] else "did not hold"
            own = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}"
            share = checked["worker_s"] / max(one["sweep"]["worker_s"], 1e-9)
            print(f"advise --validate: measured best {measured}, the prediction {held} ({own}x by its own seeds); "
                  f"the sweep's median there / the best: {'n/a' if against is None else f'{against:.2f}'}; compute "
                  f"{checked['worker_s']:.1f} worker s, {share:.2f} of the sweep's")
        print()
    ratios = sorted(r["ratio"] for r in rounds if r.get("ratio") is not None)
    if len(rounds) > 1 and ratios:
        computes = sorted(r["compute"] for r in rounds)
        print(f"over {len(rounds)} rounds: pick / best median {statistics.median(ratios):.2f} "
              f"({ratios[0]:.2f}..{ratios[-1]:.2f}); compute median {statistics.median(computes):.2f} "
              f"({computes[0]:.2f}..{computes[-1]:.2f}) of the sweep's")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1, default=str))


if __name__ == "__main__":
    raise SystemExit(main())

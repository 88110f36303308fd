"""How many probes `harness max-batch` needs, and whether its recommendation holds in a real run (issue 42).

For each framework, ``--searches`` searches of the spec (``harness max-batch SPEC --framework F``, the command a user
runs, each in its own process with its own run directory), then, for every distinct recommended size, ``--reruns``
independent ``harness run SPEC --frameworks F --batch-sizes B`` (the spec's whole trial under the same cap: its
dataset, warm-up, every step of its epochs, its evaluation), each a fresh worker. It prints, per framework, the search
probes of each search (run checks apart) with their median and range, the run checks, the limit and the
recommendation of each search, the wall time, and the re-runs' statuses; ``--json`` writes every figure.

    .venv/bin/python benchmarks/max_batch_probes.py                       # specs/max_batch.yaml, 4 frameworks
    .venv/bin/python benchmarks/max_batch_probes.py --frameworks mxnet --searches 1 --reruns 0
    .venv/bin/python benchmarks/max_batch_probes.py --json /tmp/max_batch_probes.json

The goals it measures (issue 42, specs/max_batch.yaml under its 400 MB cap on a 2-core machine): at most 8 search
probes in the median of 3 searches, and a recommendation that an independent run completes in each of 2 tries.
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
FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax")


def search(spec: str, framework: str, out: Path, extra: list[str]) -> dict[str, Any]:
    """One ``harness max-batch`` of ``framework``: its result (run.json's), probe counts and wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "harness", "max-batch", spec, "--framework", framework,
                           "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    runs = sorted(out.iterdir())
    if proc.returncode not in (0, 1) or not runs:
        return {"exit": proc.returncode, "error": proc.stderr.strip()[-500:], "wall_s": wall}
    result = json.loads((runs[-1] / "run.json").read_text())["result"]
    probes = [p for p in result["probes"] if p["kind"] == "probe"]
    return {"exit": proc.returncode, "wall_s": wall, "run_dir": str(runs[-1]), "status": result["status"],
            "probes": len(probes), "run_checks": len(result["probes"]) - len(probes),
            "sizes": [p["batch_size"] for p in probes],
            "run_check_sizes": [p["batch_size"] for p in result["probes"] if p["kind"] == "run"],
            "limit": result["limit"], "smallest_oom": result["smallest_oom"], "recommended": result["recommended"],
            "recommended_by": result["recommended_by"], "fits_sometimes": result["fits_sometimes"],
            "notes": result["notes"]}


def rerun(spec: str, framework: str, batch: int, out: Path) -> dict[str, Any]:
    """One independent ``harness run`` of the spec's trial at ``batch``: its status and reason."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "harness", "run", spec, "--frameworks", framework,
                           "--batch-sizes", str(batch), "--out", str(out), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    runs = sorted(out.iterdir())
    if not runs or not (runs[-1] / "trials.jsonl").exists():
        return {"batch": batch, "status": f"exit {proc.returncode}", "reason": proc.stderr.strip()[-300:],
                "wall_s": wall}
    record = json.loads((runs[-1] / "trials.jsonl").read_text().splitlines()[0])
    return {"batch": batch, "status": record["status"], "reason": (record.get("reason") or "")[:200],
            "wall_s": wall, "start": record.get("start")}


def spread(values: list[int]) -> str:
    """"median (min..max)" of ``values``, "-" for none."""
    return f"{statistics.median(values):g} ({min(values)}..{max(values)})" if values else "-"


def table(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table, one row per framework."""
    rows = ["| framework | search probes | median (range) | run checks | limit | recommended | wall s | "
            "independent runs at the recommendation |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for framework, entry in figures.items():
        done = [s for s in entry["searches"] if "probes" in s]
        counts = [s["probes"] for s in done]
        reruns = "; ".join(f"{b}: {', '.join(r['status'] for r in rs)}" for b, rs in entry["reruns"].items()) or "-"
        failed = [s for s in entry["searches"] if "probes" not in s]
        rows.append(
            f"| {framework} | {', '.join(map(str, counts))}{f' ({len(failed)} failed)' if failed else ''} | "
            f"{spread(counts)} | {', '.join(str(s['run_checks']) for s in done)} | "
            f"{', '.join(str(s['limit']) for s in done)} | {', '.join(str(s['recommended']) for s in done)} | "
            f"{', '.join(format(s['wall_s'], '.0f') for s in done)} | {reruns} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="specs/max_batch.yaml")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--searches", type=int, default=3)
    parser.add_argument("--reruns", type=int, default=2, help="independent runs of each recommended size")
    parser.add_argument("--out", help="folder for the run directories (default: a temporary one)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--max-batch-args", default="", help="more arguments for `harness max-batch`, one string")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="max_batch_probes-"))
    figures: dict[str, Any] = {}
    for framework in args.frameworks.split(","):
        entry: dict[str, Any] = {"searches": [], "reruns": {}}
        figures[framework] = entry
        for i in range(args.searches):
            found = search(args.spec, framework, out / framework / f"search{i + 1}", args.max_batch_args.split())
            entry["searches"].append(found)
            print(f"{framework} search {i + 1}: " + (
                f"{found['probes']} probes {found['sizes']}, run checks {found['run_check_sizes']}, limit "
                f"{found['limit']}, recommended {found['recommended']} ({found['wall_s']:.0f} s)"
                if "probes" in found else f"failed: exit {found['exit']}: {found['error']}"), flush=True)
        for batch in sorted({s["recommended"] for s in entry["searches"] if s.get("recommended")}):
            entry["reruns"][batch] = [rerun(args.spec, framework, batch, out / framework / f"run{batch}-{k + 1}")
                                      for k in range(args.reruns)]
            print(f"{framework} runs at {batch}: " + ", ".join(
                f"{r['status']}{': ' + r['reason'] if r['reason'] else ''}" for r in entry["reruns"][batch]),
                flush=True)
    print()
    print(table(figures))
    print(f"\nrun directories: {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

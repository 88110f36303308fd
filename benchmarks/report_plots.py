"""What does writing a run's report cost, and how much faster is this tree's than a baseline's? ``report.write``
(report.md, report.html and plots/, most of it matplotlib: each metric's figure and each ok trial's time series, saved
as a PNG and as the HTML report's inline SVG) timed on the same run directory by this working tree and by a git
revision (``--against``, HEAD by default), interleaved.

Each side runs in its own interpreter (the revision's ``harness/`` extracted with ``git archive`` into a temporary
folder), writes one uncounted report first (imports, matplotlib's font cache), then one report per repeat, when the
parent asks; the order of the two sides alternates from repeat to repeat so that neither always runs first. Each
side writes into its own copy of the run directory. The table shows CPU seconds (the process's, what a shared machine
cannot inflate much) and wall seconds per report, median [min..max] over the repeats, and the ratio baseline / this
tree of the medians. Afterwards the two sides' report.md must be equal, report.html equal outside its inline SVG with
as many <svg> elements, and plots/ must hold the same PNG files.

Without ``--run-dir`` the run is made first: the fault test adapter (a numpy softmax regression,
``tests.fakes.fault_adapter``) at batch sizes 16, 32, 64 and 128, ``--run-repeats`` repeats each (2: 8 trials, as in
the test suite's runs; 9: 36 trials, as many as specs/quick.yaml has).

    .venv/bin/python benchmarks/report_plots.py                           # 8 trials, against HEAD, 7 repeats: ~2 min
    .venv/bin/python benchmarks/report_plots.py --run-repeats 9 --repeats 5
    .venv/bin/python benchmarks/report_plots.py --run-dir results/RUN --against 2fe160d --json report_plots.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEC = """name: report-plots
frameworks: [fault]
batch_sizes: [16, 32, 64, 128]
repeats: {repeats}
epochs: 2
dataset: {{name: synthetic, shape: [8, 8, 1], classes: 4}}
model: {{layers: [{{type: flatten}}, {{type: dense, units: 4}}]}}
"""
_SVG = re.compile(r"<svg.*?</svg>", re.S)


def child(tree: str, run_dir: str) -> None:
    """A side: ``harness`` imported from ``tree``; one uncounted report, then one per line on stdin (JSON out)."""
    sys.path.insert(0, tree)
    import harness
    from harness.results import report

    assert Path(harness.__file__).resolve().is_relative_to(Path(tree).resolve()), harness.__file__
    report.write(Path(run_dir))
    print("ready", flush=True)
    for _ in sys.stdin:
        cpu, wall = time.process_time(), time.perf_counter()
        report.write(Path(run_dir))
        print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}), flush=True)


def make_run(folder: Path, repeats: int) -> Path:
    # here, not at the top: a side imports ``harness`` from its own tree, which nothing may have imported before
    sys.path.insert(0, str(ROOT))
    from tests.fakes.fault_adapter import REGISTRATION

    spec = folder / "spec.yaml"
    spec.write_text(SPEC.format(repeats=repeats))
    env = {**os.environ, "HARNESS_ADAPTERS": REGISTRATION, "PYTHONPATH": str(ROOT)}
    made = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--out", str(folder / "runs")],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"the run failed:\n{made.stdout}{made.stderr}")
    (run_dir,) = (folder / "runs").iterdir()
    return run_dir


def baseline_tree(rev: str, folder: Path) -> Path:
    archive = folder / "baseline.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", rev, "harness"], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "baseline", filter="data")
    return folder / "baseline"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):.2f}..{max(values):.2f}]"


def same_reports(a: Path, b: Path) -> list[str]:
    """What differs between two written run directories' reports (nothing: an empty list)."""
    problems = []
    if (a / "report.md").read_text() != (b / "report.md").read_text():
        problems.append("report.md differs")
    html_a, html_b = (a / "report.html").read_text(), (b / "report.html").read_text()
    if _SVG.sub("<svg/>", html_a) != _SVG.sub("<svg/>", html_b):
        problems.append("report.html differs outside its SVG")
    if len(_SVG.findall(html_a)) != len(_SVG.findall(html_b)):
        problems.append("report.html has another number of <svg> elements")
    pngs_a = sorted(p.relative_to(a) for p in (a / "plots").rglob("*.png"))
    if pngs_a != sorted(p.relative_to(b) for p in (b / "plots").rglob("*.png")):
        problems.append("plots/ holds other PNG files")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="an existing run directory (copied, never written); default: make one")
    parser.add_argument("--run-repeats", type=int, default=2, help="repeats per batch size of the run made here")
    parser.add_argument("--against", default="HEAD", help="the baseline's git revision; 'none': this tree alone")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write every report's timings here")
    parser.add_argument("--child", nargs=2, metavar=("TREE", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    with tempfile.TemporaryDirectory(prefix="report-plots-") as tmp:
        folder = Path(tmp)
        source = Path(args.run_dir) if args.run_dir else make_run(folder, args.run_repeats)
        trees = {"this tree": ROOT}
        if args.against != "none":
            trees = {f"baseline {args.against}": baseline_tree(args.against, folder), **trees}
        sides: dict[str, subprocess.Popen[str]] = {}
        copies: dict[str, Path] = {}
        for i, (name, tree) in enumerate(trees.items()):
            copies[name] = folder / f"side{i}" / source.name  # the same name: report.md shows it
            shutil.copytree(source, copies[name])
            sides[name] = subprocess.Popen([sys.executable, __file__, "--child", str(tree), str(copies[name])],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp)
        for name, side in sides.items():  # the uncounted report of each
            assert side.stdout is not None and side.stdout.readline().strip() == "ready", name
        timings: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        names = list(sides)
        for repeat in range(args.repeats):
            for name in names if repeat % 2 == 0 else names[::-1]:
                side = sides[name]
                assert side.stdin is not None and side.stdout is not None
                side.stdin.write("go\n")
                side.stdin.flush()
                timings[name].append(json.loads(side.stdout.readline()))
        for side in sides.values():
            assert side.stdin is not None
            side.stdin.close()
            side.wait()
        ok = sum(1 for line in (source / "trials.jsonl").read_text().splitlines() if '"status": "ok"' in line)
        print(f"{source.name}: {ok} ok trials; {args.repeats} interleaved repeats per side after one uncounted "
              f"report each; seconds per report.write, median [min..max]")
        print(f"{'':<24} {'CPU s':>22} {'wall s':>22}")
        for name in names:
            print(f"{name:<24} {spread([t['cpu_s'] for t in timings[name]]):>22} "
                  f"{spread([t['wall_s'] for t in timings[name]]):>22}")
        problems: list[str] = []
        if len(names) == 2:
            cpu = [statistics.median(t["cpu_s"] for t in timings[name]) for name in names]
            wall = [statistics.median(t["wall_s"] for t in timings[name]) for name in names]
            print(f"{'baseline / this tree':<24} {cpu[0] / cpu[1]:>22.2f} {wall[0] / wall[1]:>22.2f}")
            problems = same_reports(copies[names[0]], copies[names[1]])
            print("reports: " + ("; ".join(problems) if problems else "the same report.md, report.html outside "
                                 "its SVG, number of <svg> elements and PNG files on both sides"))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "timings": timings}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

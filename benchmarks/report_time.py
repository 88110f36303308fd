"""How long does a run's report take to write, as ``harness run`` writes it after its last trial? ``report.write``
(report.md, report.html, plots/) timed cold: each repeat a fresh interpreter that imports ``harness.results.report``
untimed (``harness run`` imports it before its first trial), then times the one ``report.write`` it makes, matplotlib's
import and first figures included. This tree against a git revision (``--against``, HEAD by default; its ``harness/``
extracted with ``git archive``), the two sides interleaved, alternating which goes first.

Per side: wall seconds and CPU seconds (user + system of the process, every thread's, and of the processes it waited
for), median [min..max] over the repeats; CPU time is what a loaded machine inflates least.
Afterwards the two sides' reports must be the same: report.md and every PNG byte for byte, report.html byte for byte
once each inline SVG's ids are renamed in order of appearance (matplotlib draws them from a random salt and from
objects' addresses). The comparison writes with ``svg.hashsalt`` fixed and ``SOURCE_DATE_EPOCH=0``.

Without ``--run-dir`` the run is made first, as in benchmarks/report_plots.py (the fault test adapter, batch sizes 16
to 128, ``--run-repeats`` repeats: 3 makes 12 trials).

    .venv/bin/python benchmarks/report_time.py                                  # 12 trials, against HEAD, 5 repeats
    .venv/bin/python benchmarks/report_time.py --run-dir results/RUN --against 1a2b3c4 --repeats 7
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from report_plots import make_run, spread  # noqa: E402 - a sibling script

CHILD = """
import json, os, resource, sys, time
tree, run_dir, salt = sys.argv[1:4]
sys.path.insert(0, tree)
if salt:
    import matplotlib
    matplotlib.rcParams["svg.hashsalt"] = salt
import adapters, harness
from harness.results import report
assert harness.__file__.startswith(tree) and adapters.__file__.startswith(tree), (harness.__file__, adapters.__file__)
def cpu():
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
c, w = cpu(), time.perf_counter()
report.write(run_dir)
print(json.dumps({"wall_s": time.perf_counter() - w, "cpu_s": cpu() - c}))
"""
def baseline_tree(rev: str, folder: Path) -> Path:
    """The revision's ``harness/`` and ``adapters/`` (which the report reads the frameworks' versions from) in
    ``folder/baseline``."""
    archive = folder / "baseline.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", rev, "harness", "adapters"], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "baseline", filter="data")
    return folder / "baseline"


_ID = re.compile(r"\b([a-z])([0-9a-f]{10})\b")


def write(tree: Path, run_dir: Path, salt: str = "") -> dict[str, float]:
    env = {**os.environ, "SOURCE_DATE_EPOCH": "0"} if salt else None
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(run_dir), salt], capture_output=True, text=True,
                          check=True, env=env, cwd=run_dir.parent)
    return json.loads(done.stdout.splitlines()[-1])


def _same_ids(html: str) -> str:
    def rename(svg: re.Match[str]) -> str:
        seen: dict[str, str] = {}
        return _ID.sub(lambda m: seen.setdefault(m.group(0), f"{m.group(1)}-{len(seen)}"), svg.group(0))

    return re.sub(r"<svg.*?</svg>", rename, html, flags=re.S)


def differences(a: Path, b: Path) -> list[str]:
    """What differs between two run directories' reports (see the module's docstring); an empty list: nothing."""
    found = [] if (a / "report.md").read_bytes() == (b / "report.md").read_bytes() else ["report.md"]
    if _same_ids((a / "report.html").read_text()) != _same_ids((b / "report.html").read_text()):
        found.append("report.html")
    pngs = sorted(p.relative_to(a) for p in a.rglob("*.png"))
    if pngs != sorted(p.relative_to(b) for p in b.rglob("*.png")):
        found.append("the list of PNG files")
    return found + [str(p) for p in pngs if (a / p).read_bytes() != (b / p).read_bytes()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="an existing run directory (copied, never written); default: make one")
    parser.add_argument("--run-repeats", type=int, default=3, help="repeats per batch size of the run made here")
    parser.add_argument("--against", default="HEAD", help="the baseline's git revision; 'none': this tree alone")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write every report's timings here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="report-time-") as tmp:
        folder = Path(tmp)
        source = Path(args.run_dir) if args.run_dir else make_run(folder, args.run_repeats)
        trees = {"this tree": ROOT}
        if args.against != "none":
            trees = {f"baseline {args.against}": baseline_tree(args.against, folder), **trees}
        copies = {}
        for i, name in enumerate(trees):
            copies[name] = folder / f"side{i}" / source.name  # the same name: report.md shows it
            shutil.copytree(source, copies[name])
        timings: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        names = list(trees)
        for repeat in range(args.repeats):
            for name in names if repeat % 2 == 0 else names[::-1]:
                timings[name].append(write(trees[name], copies[name]))
        ok = sum(1 for line in (source / "trials.jsonl").read_text().splitlines() if '"status": "ok"' in line)
        print(f"{source.name}: {ok} ok trials; {args.repeats} interleaved repeats per side, each report.write in a "
              f"fresh interpreter; seconds, median [min..max]")
        print(f"{'':<24} {'wall s':>22} {'CPU s':>22}")
        for name in names:
            print(f"{name:<24} {spread([t['wall_s'] for t in timings[name]]):>22} "
                  f"{spread([t['cpu_s'] for t in timings[name]]):>22}")
        problems: list[str] = []
        if len(names) == 2:
            wall = [statistics.median(t["wall_s"] for t in timings[name]) for name in names]
            cpu = [statistics.median(t["cpu_s"] for t in timings[name]) for name in names]
            print(f"{'baseline / this tree':<24} {wall[0] / wall[1]:>22.2f} {cpu[0] / cpu[1]:>22.2f}")
            for name in names:
                write(trees[name], copies[name], salt="report-time")
            problems = differences(copies[names[0]], copies[names[1]])
            print("reports: " + ("differ: " + ", ".join(problems) if problems else
                                 "the same (report.md and PNGs byte for byte, report.html but for its SVG ids)"))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "timings": timings}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

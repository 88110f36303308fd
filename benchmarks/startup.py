"""What does a trial cost besides its work? The same real trials started cold (a new interpreter that imports the
framework) and forked (a child of a preloaded parent per environment, ``harness.execution.forkserver``), interleaved.

For each framework (each in its own environment, ``envs/<framework>``), the quick spec's CNN on digits at one batch
size, ``--epochs`` epochs, one CPU thread, as ``make run`` trains it. One uncounted round first starts every parent
(the price a sweep pays once per environment, printed apart) and warms the file cache for both paths. Then each
repeat runs, per framework, one cold and one forked trial, in an order that alternates from repeat to repeat so that
neither path always runs first. Per trial the record's phases (``TrialRecord.phases``) give its wall time and the
part outside timed training and evaluation; the table shows medians with min..max over the repeats, and the ratio
cold / forked of the medians. Every forked trial's losses and accuracy are checked against the cold trial's of the
same repeat (equal up to float32 rounding).

    .venv/bin/python benchmarks/startup.py                       # four frameworks, 5 repeats: about 3 minutes
    .venv/bin/python benchmarks/startup.py --frameworks pytorch,jax --repeats 9 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.execution import launcher  # noqa: E402
from harness.execution.protocol import Payload  # noqa: E402
from harness.execution.workers import Workers  # noqa: E402
from harness.plan import plan  # noqa: E402
from harness.record.phases import TrialPhases  # noqa: E402
from harness.spec import Spec  # noqa: E402

FRAMEWORKS = ("pytorch", "tensorflow", "mxnet", "jax")
PHASES = ("start_s", "import_s", "prepare_s", "data_s", "build_s", "warmup_s", "other_s", "teardown_s")


def make_spec(framework: str, batch_size: int, epochs: int, worker_start: str) -> Spec:
    quick = yaml.safe_load((ROOT / "specs" / "quick.yaml").read_text())
    entry = {"name": framework, "python": str(ROOT / "envs" / framework / "bin" / "python")}
    return Spec.model_validate({**quick, "name": "startup", "frameworks": [entry], "batch_sizes": [batch_size],
                                "epochs": epochs, "repeats": 1, "worker_start": worker_start})


def run_trial(framework: str, batch_size: int, epochs: int, worker_start: str) -> dict[str, Any]:
    """One real trial through the launcher, as a sweep runs it; its phases, path and losses."""
    spec = make_spec(framework, batch_size, epochs, worker_start)
    (trial,) = plan(spec, "cpu")
    outcome = launcher.run_worker(Payload(trial=trial), spec.timeout_s, spec.sampler.interval_s, "cpu",
                                  threads=spec.cpu_threads)
    result = outcome.result()
    if outcome.status != "ok" or result is None:
        raise SystemExit(f"{framework} {worker_start}: {outcome.status}: {outcome.reason}")
    phases = TrialPhases.from_events(outcome.events, outcome.started, outcome.ended)
    metrics = result.metrics
    return {"framework": framework, "asked": worker_start, "start": outcome.start, "phases": phases.model_dump(),
            "outside_s": phases.outside_training_s, "wall_s": phases.total_s,
            "losses": [e.train_loss for e in metrics.epochs] + [metrics.test_loss], "accuracy": metrics.test_accuracy}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):.2f}..{max(values):.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=5, help="epochs per trial (the quick spec's 5 by default)")
    parser.add_argument("--json", help="write every trial's figures here")
    args = parser.parse_args()
    frameworks = args.frameworks.split(",")
    trials: list[dict[str, Any]] = []
    began = time.monotonic()
    parents = {}
    owner = Workers().__enter__()  # the preloaded parents of the forked trials, ended after the last
    for framework in frameworks:  # the uncounted round: parents started, file cache warm for both paths
        run_trial(framework, args.batch_size, 1, "cold")
        parents[framework] = run_trial(framework, args.batch_size, 1, "auto")["phases"]["start_s"]
    for repeat in range(args.repeats):
        order = ("cold", "auto") if repeat % 2 == 0 else ("auto", "cold")
        for framework in frameworks:
            pair = {mode: run_trial(framework, args.batch_size, args.epochs, mode) for mode in order}
            trials += [{**trial, "repeat": repeat} for trial in pair.values()]
            cold, forked = pair["cold"], pair["auto"]
            assert forked["start"] == "forked" and cold["start"] == "cold", (forked["start"], cold["start"])
            assert forked["accuracy"] == cold["accuracy"], (framework, forked["accuracy"], cold["accuracy"])
            assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(forked["losses"], cold["losses"])), framework
    owner.__exit__(None, None, None)
    print(f"{args.repeats} repeats per path and framework, batch size {args.batch_size}, {args.epochs} epochs, "
          f"{time.monotonic() - began:.0f} s in all; seconds per trial, median [min..max]")
    print(f"{'framework':<11} {'outside cold':>22} {'outside forked':>22} {'ratio':>6} {'wall cold':>22} "
          f"{'wall forked':>22} {'ratio':>6}  parent start (once)")
    for framework in frameworks:
        cold = [t for t in trials if t["framework"] == framework and t["asked"] == "cold"]
        forked = [t for t in trials if t["framework"] == framework and t["asked"] == "auto"]
        oc, of = [t["outside_s"] for t in cold], [t["outside_s"] for t in forked]
        wc, wf = [t["wall_s"] for t in cold], [t["wall_s"] for t in forked]
        print(f"{framework:<11} {spread(oc):>22} {spread(of):>22} {statistics.median(oc) / statistics.median(of):6.1f} "
              f"{spread(wc):>22} {spread(wf):>22} {statistics.median(wc) / statistics.median(wf):6.2f}  "
              f"{parents[framework]:.2f} s")
    print("\nforked, median seconds per phase outside training and evaluation:")
    print(f"{'framework':<11} " + " ".join(f"{p[:-2]:>9}" for p in PHASES))
    for framework in frameworks:
        forked = [t for t in trials if t["framework"] == framework and t["asked"] == "auto"]
        print(f"{framework:<11} " + " ".join(
            f"{statistics.median(t['phases'][p] or 0.0 for t in forked):9.3f}" for p in PHASES))
    print("losses and accuracy: every forked trial equal to its cold pair (float32 rounding)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "parents_s": parents, "trials": trials}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

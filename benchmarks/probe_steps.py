"""After how many optimizer steps a max-batch probe's peak settles, per framework (issue 59).

Runs the probe a max-batch search runs (``harness.studies.max_batch.probe.probe_spec``: the spec's model under its
cap, synthetic data as many as a run holds, no warm-up) cut to E epochs of at most S steps each (an evaluation of the
test set after each epoch), in a fresh worker per cell, and prints its peak (what the search fits: on the CPU the
worker's VmData growth above the capped baseline, TensorFlow's capped BFC allocator's peak) against the full probe's
(3 epochs of every step, before issue 59). Usage:

    python benchmarks/probe_steps.py specs/max_batch.yaml pytorch:16,250 tensorflow:16,400 --repeats 2

Findings: docs/findings/2026-11-28-probe-steps.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.execution.launcher import run_worker
from harness.execution.protocol import Payload
from harness.plan import plan
from harness.spec import load as load_spec
from harness.studies.max_batch import runcheck
from harness.studies.max_batch.probe import peak, probe_spec

#: (epochs, steps per epoch; 0: every step), the full probe last
CELLS = [(1, 1), (1, 2), (1, 3), (1, 5), (2, 1), (2, 2), (2, 3), (3, 0)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("targets", nargs="+", help="framework:size,size,...")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cells", help="e.g. 1x1,1x2,2x2,3x0 (default: all)")
    parser.add_argument("--out", help="a JSON lines file the rows are appended to")
    args = parser.parse_args()
    spec = load_spec(args.spec)
    cells = CELLS if not args.cells else [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
    sizes = runcheck.run_sizes(spec)
    for target in args.targets:
        framework, batches = target.split(":")
        for batch in (int(b) for b in batches.split(",")):
            for epochs, steps in cells:
                for repeat in range(args.repeats):
                    pspec = probe_spec(spec, framework, batch, spec.memory_limit_mb, "cpu", args.spec,
                                       run_sizes=sizes).model_copy(update={"epochs": epochs})
                    trial = plan(pspec, "cpu")[0]
                    if steps:
                        trial = replace(trial, max_steps_per_epoch=steps)
                    started = time.monotonic()
                    outcome = run_worker(Payload(trial=trial), spec.timeout_s, None, "cpu", trial.threads)
                    value, source = peak(outcome, "cpu") if outcome.status in ("ok", "oom") else (None, "")
                    row = {"framework": framework, "batch": batch, "epochs": epochs, "steps": steps or "all",
                           "repeat": repeat, "status": outcome.status, "peak_mb": None if value is None else
                           round(value / 1e6, 1), "source": source, "seconds": round(time.monotonic() - started, 1)}
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with open(args.out, "a") as out:
                            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

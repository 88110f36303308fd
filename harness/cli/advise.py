"""``harness advise SPEC``: its parser; the study is ``harness.studies.advise``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harness.cli.common import OFFLINE_HELP

OBJECTIVES = ("memory", "throughput", "time", "energy")  # harness.studies.advise.OBJECTIVES, kept light to import


def _objectives(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [o for o in chosen if o not in OBJECTIVES]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'none given'}: each is one of "
                                         f"{', '.join(OBJECTIVES)}")
    return chosen


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``advise SPEC [--framework NAME ...] [--objective LIST] [--target-accuracy F] [--budget MINUTES] ...``."""
    parser = subparsers.add_parser(
        "advise", help="which batch size to train with, per objective (memory, throughput, time, energy)",
        description="Measures what the choice rests on and answers it: the largest batch that holds (max-batch), "
                    "throughput per candidate size with repeats, and the gradient noise scale of the spec's model "
                    "(McCandlish et al. 2018), from which steps, time and energy to the target accuracy are "
                    "predicted for every candidate. Writes advice.json and advice.md (the answer first). Exit 0 "
                    "with the answer, 2 for a bad spec or arguments (before anything runs).")
    parser.add_argument("spec", help="a YAML spec, e.g. specs/quick.yaml")
    parser.add_argument("--framework", action="append", default=[], metavar="NAME",
                        help="an entry's label or name (repeat for several; default: every entry)")
    parser.add_argument("--objective", type=_objectives, default=OBJECTIVES, metavar="LIST",
                        help=f"comma-separated, of {', '.join(OBJECTIVES)} (default: all; energy is answered where "
                             "the device has an energy counter)")
    parser.add_argument("--target-accuracy", type=float, help="the test accuracy to reach (default: the spec's)")
    parser.add_argument("--budget", type=float, metavar="MINUTES",
                        help="wall-time bound: a stage that would start after it is cut, and the answer says so")
    parser.add_argument("--validate", action="store_true",
                        help="also train the candidates to the target with several seeds (successive halving: the "
                             "slower half dropped each round) and say whether the predicted size held")
    parser.add_argument("--global-batch", type=int, metavar="G",
                        help="also plan G samples per optimizer step: gradient accumulation over micro-batches that "
                             "hold, and data parallelism over the GPUs there are, measured side by side")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each throughput candidate (default 3)")
    parser.add_argument("--noise-batch", type=int, help="the noise trial's batch size (default: the spec's "
                                                        "base_batch_size, else its smallest batch size of at least "
                                                        "64 that --micro-batches divides)")
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="micro-batches the noise trial's batches are split into (default 8)")
    parser.add_argument("--probes", type=int, default=8, help="probe batches per evaluation (default 8)")
    parser.add_argument("--device", help="cpu or cuda:N (default: the spec's device)")
    parser.add_argument("--out", default="results", help="folder that receives the run directory (default: results)")
    parser.add_argument("--offline", action="store_true", help=OFFLINE_HELP)
    parser.set_defaults(handler=handle)
    return parser


def handle(args: argparse.Namespace) -> int:
    from harness.cli.common import load_spec
    from harness.spec import SpecError

    spec = load_spec(args.spec, offline=args.offline)
    from harness.studies.advise import Options, advise  # (0.3 s of imports) for a spec that runs only
    options = Options(frameworks=args.framework, objectives=args.objective, target=args.target_accuracy,
                      budget_s=None if args.budget is None else args.budget * 60, repeats=args.repeats,
                      noise_batch=args.noise_batch, micro_batches=args.micro_batches, probes=args.probes,
                      device=args.device, out=args.out, validate=args.validate,
                      global_batch=args.global_batch)
    try:
        folder = advise(spec, args.spec, options)
    except SpecError as err:
        print(str(err), file=sys.stderr)
        return 2
    text = (folder / "advice.md").read_text(encoding="utf-8")
    print(text.split("# Evidence")[0].rstrip())
    print(f"\nwritten to {folder} (advice.json, advice.md)")
    return 0

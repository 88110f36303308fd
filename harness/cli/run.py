"""``harness run SPEC``: every trial of a spec, then the report; exit 3 when no trial ended ok and one failed."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cli.common import (
    EXIT_NOTHING_RAN,
    EXIT_USAGE,
    OFFLINE_HELP,
    int_list,
    load_spec,
    print_summary,
    str_list,
    summary_console,
)

if TYPE_CHECKING:
    from harness.execution.executors import LocalExecutor
    from harness.execution.ray_executor import RayExecutor


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run every trial of a spec, then write the report")
    run.add_argument("spec", help="a YAML spec, e.g. specs/quick.yaml")
    run.add_argument("--frameworks", type=str_list, help="comma-separated subset, e.g. pytorch,mxnet")
    run.add_argument("--batch-sizes", type=int_list, help="comma-separated batch sizes, e.g. 8,64,512")
    run.add_argument("--epochs", type=int, help="epochs per trial")
    run.add_argument("--out", default="results", help="folder that receives the run directory (default: results)")
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    run.add_argument("--resume", metavar="RUN_DIR", help="finish an interrupted run of the same spec")
    run.add_argument("--history", metavar="FILE", help="append the run's summary row to this history file")
    run.add_argument("--executor", choices=("local", "ray"), default="local",
                     help="local: trials on this machine (default); ray: each trial a Ray task on a cluster")
    run.add_argument("--parallel", type=int, default=1, metavar="N",
                     help="local: N trials at once, one per GPU (cuda:0..N-1) or per set of cpu_threads cores")
    run.add_argument("--devices", metavar="LIST", help="local: GPUs side by side, e.g. cuda:0,cuda:1 (one trial each "
                                                       "at a time; default: the spec's devices)")
    run.add_argument("--address", help="ray: the cluster's address (auto, host:6379, ray://host:10001); default: a "
                                       "local Ray instance on this machine")
    run.add_argument("--retries", type=int, default=0, metavar="N",
                     help="ray: run a trial again up to N times when its node or worker dies (default 0: recorded "
                          "crashed, 'node lost')")
    run.add_argument("--offline", action="store_true", help=OFFLINE_HELP)
    run.set_defaults(handler=handle)


def _executor(args: argparse.Namespace, spec: Any) -> LocalExecutor | RayExecutor | None:
    """The executor the flags and the spec ask for (``harness.execution.executors``; made ``exclusive`` for an
    exclusive spec), or None for the default (one trial at a time on this machine, which the sweep makes and closes).
    The caller closes the one returned (``with``). Raises ValueError (or ExecutorError) for flags that do not go
    together."""
    from harness.execution.executors import ExecutorError, LocalExecutor, local_slots
    from harness.execution.ray_executor import RayExecutor
    from harness.measure.machine import resolve_device

    if args.executor == "local" and (args.address or args.retries):
        raise ValueError("--address and --retries apply to --executor ray")
    if args.retries < 0:
        raise ValueError(f"--retries must be 0 or more, not {args.retries}")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else spec.devices
    if args.executor == "ray":
        if args.parallel != 1 or args.devices:
            raise ValueError("--parallel and --devices apply to --executor local (Ray places trials itself)")
        device = resolve_device(spec.device)
        if device.startswith("cuda") and device != "cuda:0":
            raise ExecutorError(f"--executor ray gives each trial a GPU of its own; the spec's device {device} "
                                "cannot be honoured (use device: auto or cuda:0)")
        return RayExecutor(args.address, device.startswith("cuda"), spec.cpu_threads or _plan_threads(),
                           retries=args.retries, exclusive=spec.exclusive)
    if args.parallel == 1 and not devices:
        return None
    return LocalExecutor(local_slots(resolve_device(spec.device), args.parallel, devices, spec.cpu_threads),
                         exclusive=spec.exclusive)


def _plan_threads() -> int:
    """The threads a trial gets when the spec does not say (the available cores, as the plan counts them)."""
    from harness.plan import available_cpus

    return available_cpus()


def handle(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from harness.record import Epoch, Event, TrialRecord

    overrides = {"frameworks": args.frameworks, "batch_sizes": args.batch_sizes, "epochs": args.epochs}
    # the dataset fetched or decoded once, and the spec checked, before the first trial
    spec = load_spec(args.spec, overrides, offline=args.offline, progress=False if args.no_progress else None)
    # the sweep and the report's code (pandas, matplotlib: 0.3 s) only for a spec that runs: a bad one answers at once
    from harness.measure.sampler import interval_warning
    from harness.results import report
    from harness.studies.sweep import raise_on_signals, run_spec

    if (warning := interval_warning(spec.sampler.interval_s)) is not None:
        print(f"{args.spec}: sampler.interval_s: {warning}", file=sys.stderr)
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=args.no_progress or not console.is_terminal)
    state: dict[str, Any] = {}

    def on_start(trial: Any, index: int, total: int) -> None:
        state["trial"] = trial.id
        if "task" not in state:
            state["task"] = progress.add_task("starting", total=total)
        progress.update(state["task"], description=f"{trial.id}: starting")

    def on_event(event: Event) -> None:
        if "task" in state and isinstance(event, Epoch):
            progress.update(state["task"], description=f"{state.get('trial', '')} epoch {event.epoch + 1}: "
                                                       f"accuracy {100 * event.test_accuracy:.1f}%")

    def on_end(trial: Any, record: TrialRecord) -> None:
        progress.advance(state["task"])
        throughput = record.metrics.throughput_samples_per_s
        detail = f"{throughput:,.0f} samples/s" if throughput else record.reason
        progress.console.print(f"{trial.id}: {record.status} ({detail}) in {record.wall_s:.1f} s")

    try:
        executor = _executor(args, spec)
    except ValueError as err:  # ExecutorError too: no cluster, too few cores, Ray not installed
        print(f"harness run: {err}", file=sys.stderr)
        return EXIT_USAGE
    raise_on_signals()  # SIGTERM, SIGHUP: the run is marked interrupted, its report written (see harness.cli.main)
    # the executor made here is closed here, when the run ends or stops (its workers still running killed)
    with progress, executor if executor is not None else contextlib.nullcontext():
        run_dir = run_spec(spec, args.out, args.spec, on_start=on_start, on_end=on_end, on_event=on_event,
                           resume=args.resume, executor=executor)
    data = report.build(run_dir)
    path = report.write(run_dir, data)
    if args.history:
        from harness.studies import history

        history.append(args.history, run_dir)
    print_summary(data, summary_console())
    print(f"run directory: {run_dir}\nreport: {path}")
    return run_status(run_dir)


def run_status(run_dir: Path) -> int:
    """EXIT_NOTHING_RAN when no trial ended ok and at least one ended in error, crashed or timeout (a broken
    environment, driver or adapter: a nightly job must notice); else 0, whatever else failed (an OOM, a skipped or
    unsupported trial is a result)."""
    from harness.results.store import read_trials

    statuses = {r.status for r in read_trials(run_dir)}
    if "ok" not in statuses and statuses & {"error", "crashed", "timeout"}:
        failed = ", ".join(sorted(statuses & {"error", "crashed", "timeout"}))
        print(f"harness run: no trial ended ok ({failed}): exit {EXIT_NOTHING_RAN}", file=sys.stderr)
        return EXIT_NOTHING_RAN
    return 0

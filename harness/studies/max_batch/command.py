"""The ``max-batch`` command: checks its arguments, runs the search with its run directory written as it goes, prints
the probe table. Its parser is in ``harness.cli``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harness import plan as planning
from harness.execution import probes
from harness.execution.workers import Workers, owner
from harness.measure.machine import resolve_device
from harness.plan.entries import entry_named
from harness.spec import Spec, SpecError
from harness.studies.max_batch.checks import check_search
from harness.studies.max_batch.output import RunWriter, mb, table
from harness.studies.max_batch.probe import Probe, probe_spec
from harness.studies.max_batch.search import DEFAULT_INITIAL_SIZES, find_max_batch


def run(args: argparse.Namespace, spec: Spec) -> int:
    """0 with the result printed, 1 when the search stopped on a non-OOM failure, 2 for a bad spec or arguments
    (one line on standard error, before anything runs: a --data-parallel below 1 or above the devices this machine
    has, or a trial the framework's adapter cannot train, among them: ``checks.check_search``). ``spec``: the spec
    file ``args.spec`` as the command read and checked it (``harness.cli.common.load_spec``, its data ready)."""
    with owner() as workers:  # the preloaded parents of its probes and workers, ended with the search
        return _run(args, spec, workers)


def _run(args: argparse.Namespace, spec: Spec, workers: Workers) -> int:
    """``run`` with ``workers``, whose parents the probes and the search's workers fork from."""
    try:
        if args.memory_limit_mb is not None and args.memory_limit_mb <= 0:
            raise SpecError(args.spec, "memory_limit_mb", "--memory-limit-mb must be positive")
        entry = entry_named(spec, args.framework, args.spec)
        planning.check_framework_name(entry.name, args.spec, backend=entry.backend)
        # One check of what the search runs: this entry alone, on the device asked for; then its interpreter's probe.
        searched = {**spec.model_dump(mode="json"), "frameworks": [entry.model_dump(exclude_none=True)],
                    **({"device": args.device} if args.device is not None else {})}
        device = args.device or resolve_device(spec.device)
        dp = check_search(spec, entry.name, device, args.data_parallel, args.spec, args.memory_limit_mb)
        searched_spec = planning.checked_spec(searched, args.spec)
        # the interpreter's probe in a child of the preloaded parent the probes fork from (one data-parallel
        # worker group aside): a fork, not another interpreter importing the framework
        first = probe_spec(searched_spec, entry.row, DEFAULT_INITIAL_SIZES[0], args.memory_limit_mb, device, args.spec)
        via = workers.probe_runner(planning.plan(first, device)) if dp is None else None
        probes.probe_entries(searched_spec, args.spec, device, via=via)
    except SpecError as err:
        print(str(err), file=sys.stderr)
        return 2
    settings = {"memory_limit_mb": args.memory_limit_mb, "margin": args.margin, "tolerance": args.tolerance,
                "initial_sizes": args.initial_sizes, "max_batch": args.max_batch, "timeout_s": args.timeout,
                "with_dataset": args.with_dataset, "data_parallel": args.data_parallel,
                "run_checks": args.run_checks}
    writer = RunWriter(args.out, spec, args.framework, device, args.spec, settings)

    def on_probe(probe: Probe, outcome: Any) -> None:
        writer.probe(probe, outcome)
        peak = f", peak {mb(probe.peak_bytes)} MB" if probe.peak_bytes is not None else ""
        detail = f": {_short(probe.reason)}" if probe.reason else ""
        batch = (f"batch {probe.batch_size}" if probe.global_batch_size in (0, probe.batch_size) else
                 f"batch {probe.batch_size} per device (global {probe.global_batch_size})")
        label = {"run": "run check", "compile": "compile"}.get(probe.kind, "probe")
        print(f"{label} {probe.index + 1}: {batch} {probe.status}{detail}"
              f"{peak} ({probe.seconds:.1f} s, {probe.purpose})", file=sys.stderr, flush=True)

    try:
        result = find_max_batch(spec, args.framework, device, memory_limit_mb=args.memory_limit_mb,
                                margin=args.margin, tolerance=args.tolerance, initial_sizes=args.initial_sizes,
                                max_batch=args.max_batch, timeout_s=args.timeout, spec_file=args.spec,
                                with_dataset=args.with_dataset, data_parallel=args.data_parallel,
                                run_checks=args.run_checks, on_probe=on_probe)
    except ValueError as err:
        print(f"{args.spec}: {err}", file=sys.stderr)
        return 2
    run_dir = writer.finish(result)
    print(table(result))
    print(f"\nwritten to {run_dir}")
    return 1 if result.status == "stopped" else 0


def _short(reason: str, limit: int = 240) -> str:
    """A probe's reason on its progress line: its first line, cut at a word with "..." where longer than ``limit``
    (a cut in the middle read "so the cap caused it: , peak 599.8 MB"); the run directory keeps it whole."""
    line = reason.strip().splitlines()[0] if reason.strip() else ""
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."

"""The report's "Where the time went" section: per row, the trials' wall time (``TrialRecord.phases.total_s``, the
launcher's start of each worker to its exit) cut into the timed training windows, the evaluations and the rest, the
share of the rest, and its slowest phase; and how the row's workers started (cold or forked,
``TrialRecord.start``). Trials recorded before phases were (schema 2 without ``phases``) leave the section out."""

from __future__ import annotations

from statistics import median

from harness.record.phases import TrialPhases
from harness.record.trial import TrialRecord
from harness.results.metrics import title
from harness.results.sections import Paragraph, Section, simple_table
from harness.results.tables import ReportData

#: The phases outside timed training and evaluation, in the order a worker meets them: field -> the name shown.
OUTSIDE = {"start_s": "start", "import_s": "import", "prepare_s": "prepare", "data_s": "data", "build_s": "build",
           "warmup_s": "warm-up", "other_s": "between windows", "teardown_s": "teardown"}


def _starts(records: list[TrialRecord]) -> str:
    """``forked``, ``cold``, or how many of each where the row took both paths."""
    counts = {path: sum(r.start == path for r in records) for path in ("forked", "cold")}
    taken = [path for path, n in counts.items() if n]
    if len(taken) == 1:
        return taken[0]
    return ", ".join(f"{path} {n}" for path, n in counts.items() if n) or "unknown"


def _slowest(phases: list[TrialPhases]) -> str:
    """The phase outside training and evaluation with the largest total over the trials, with its median per
    trial."""
    totals = {name: sum(getattr(p, name) or 0.0 for p in phases) for name in OUTSIDE}
    name = max(totals, key=totals.__getitem__)
    values = [getattr(p, name) for p in phases if getattr(p, name) is not None]
    return f"{OUTSIDE[name]} ({median(values):.2f} s)" if values else ""


def time_budget_section(data: ReportData) -> Section | None:
    """The section, or None when no trial has phases. Per row: the start path, the trials counted (every trial
    with phases, whatever its status: a failed trial's time is spent too), their summed wall time, timed training
    and evaluation (s), the share of the wall time outside both (%), its median per trial (s) and the slowest phase
    outside both (the largest total; its median per trial)."""
    rows = []
    for row in data.frameworks:
        records = [r for r in data.records if r.row == row and r.phases is not None and r.phases.total_s]
        if not records:
            continue
        phases = [r.phases for r in records if r.phases is not None]
        wall = sum(p.total_s or 0.0 for p in phases)
        timed = sum(p.timed_s or 0.0 for p in phases)
        evaluation = sum(p.eval_s or 0.0 for p in phases)
        outside = [p.outside_training_s or 0.0 for p in phases]
        rows.append([title(row), _starts(records), str(len(records)), f"{wall:.1f}", f"{timed:.1f}",
                     f"{evaluation:.1f}", f"{100 * sum(outside) / wall:.0f}", f"{median(outside):.2f}",
                     _slowest(phases)])
    if not rows:
        return None
    table = simple_table(["row", "start", "trials", "wall s", "timed training s", "evaluation s",
                          "outside training %", "outside per trial s", "slowest phase outside"], rows, "llrrrrrrl")
    note = Paragraph(
        "Each trial's wall time runs from the launcher's start of its worker to the worker's exit, on the monotonic "
        "clock its events carry. Outside training: all but the timed windows (what throughput counts) and the "
        "evaluations, that is the worker's start, the framework's import, the data, the model's build, the warm-up "
        "steps with their compilation, what lies between windows and the teardown (per phase: `phases` in "
        "trials.jsonl); per trial it is the median. Start: cold, a new interpreter per trial that imports the "
        "framework; forked, a child of a parent per environment that imported the framework's modules and touched "
        "no device (harness.execution.forkserver), so each trial still has its own process, allocator and device "
        "state.")
    return Section("time-budget", "Where the time went", (table, note))

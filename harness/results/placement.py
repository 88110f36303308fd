"""Which trials ran beside which: the report's warning where trials shared a node's CPUs or a GPU while they were
measured (``--parallel``, ``devices``, ``--executor ray``), from the ``placement`` each record carries."""

from __future__ import annotations

from typing import Any

from harness.record.trial import TrialRecord
from harness.results.sections import Paragraph, Section, simple_table
from harness.results.tables import ReportData


def overlaps(records: list[TrialRecord]) -> dict[str, dict[str, list[str]]]:
    """Per trial id, the ids of the trials that ran at the same time on the same node, split into ``device`` (the
    same GPU) and ``node`` (another GPU or the CPU of the same node). Only records with a ``placement`` (trials that
    ran a worker) count; intervals are the placements' start and end (time.time() of the node that ran them)."""
    placed = [(r.id, r.placement) for r in records if r.placement is not None and r.placement.node not in ("", "?")]
    out: dict[str, dict[str, list[str]]] = {}
    for trial, a in placed:
        for other, b in placed:
            if other == trial or not a.overlaps(b):
                continue
            same_gpu = a.device == b.device and a.device.startswith("cuda")
            out.setdefault(trial, {"device": [], "node": []})["device" if same_gpu else "node"].append(other)
    return out


def side_by_side_section(data: ReportData) -> Section | None:
    """"Trials side by side": how the run placed its trials (executor, slots) and, where trials overlapped, which
    shared a GPU (their throughput and memory figures are not those of a GPU to itself) and which shared a node's
    CPUs (pinned to disjoint cores, they still share memory bandwidth, caches, the launcher and the sampler). None
    when no trials overlapped."""
    shared = overlaps(data.records)
    if not shared:
        return None
    how = "; ".join(_executor_words(e) for e in data.run.executors) or "several trials at once"
    rows = [[r.id, ", ".join(shared[r.id]["device"]) or "-", ", ".join(shared[r.id]["node"]) or "-"]
            for r in data.records if r.id in shared]
    return Section("side_by_side", "Trials side by side", (
        Paragraph(f"This run placed trials with {how}. Trials that ran at the same time on one machine disturb each "
                  "other's figures: where host contention matters, set `exclusive: true` in the spec (one trial at a "
                  "time)."),
        simple_table(["trial", "shared a GPU with", "shared the node's CPUs with"], rows)))


def _executor_words(executor: dict[str, Any]) -> str:
    if executor.get("executor") == "ray":
        alive = sum(1 for n in executor.get("nodes", []) if n.get("alive"))
        return (f"Ray {executor.get('ray_version', '')} ({alive} node(s), up to {executor.get('capacity')} trials "
                "at once)")
    slots = executor.get("slots") or []
    where = ", ".join(s["device"] + (f" (cores {','.join(map(str, s['cpus']))})" if s.get("cpus") else "")
                      for s in slots)
    return f"the local executor, {len(slots)} slot(s): {where}"

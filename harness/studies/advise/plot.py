"""advice.md's figure per entry: predicted time to the target against batch size, the measured seconds of
``--validate`` beside it (median and range over seeds), and, where the device has an energy counter, the time-energy
frontier of the predicted candidates (the sizes no other beats in both seconds and joules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def frontier(points: list[tuple[int, float, float]]) -> list[int]:
    """The batch sizes on the time-energy frontier: those whose (seconds, joules) no other point beats in both (at
    least as good in each and better in one).

    Args:
        points: (batch size, seconds, joules) per candidate.

    Returns:
        The frontier's batch sizes, ascending by seconds.
    """
    def beaten(s: float, j: float) -> bool:
        return any(s2 <= s and j2 <= j and (s2 < s or j2 < j) for _, s2, j2 in points)

    return [b for b, s, j in sorted(points, key=lambda p: (p[1], p[2])) if not beaten(s, j)]


def figure(label: str, time_answer: dict[str, Any], path: Path) -> Path | None:
    """Writes the entry's figure to ``path`` (PNG) from its time answer (``rows``: per size the predicted
    ``seconds`` and ``joules``; ``validation``: measured seconds per size); None, writing nothing, where no size
    has predicted seconds."""
    rows = [r for r in time_answer.get("rows") or [] if r.get("seconds") is not None]
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    energy = [(r["batch_size"], r["seconds"], r["joules"]) for r in rows if r.get("joules") is not None]
    fig = Figure(figsize=(10 if energy else 6, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if energy else 1, squeeze=False)[0]
    ax = axes[0]
    sizes = [r["batch_size"] for r in rows]
    ax.plot(sizes, [r["seconds"] for r in rows], marker="o", label="predicted")
    validation = time_answer.get("validation") or {}
    measured = [(int(b), v) for b, v in (validation.get("sizes") or {}).items() if v.get("median_s") is not None]
    if measured:
        reached = [[s for s in v["seconds"] if s is not None] for _, v in measured]
        medians = [v["median_s"] for _, v in measured]
        low = [m - min(r) for m, r in zip(medians, reached)]
        high = [max(r) - m for m, r in zip(medians, reached)]
        ax.errorbar([b for b, _ in measured], medians, yerr=[low, high], fmt="s", capsize=3,
                    label="measured (--validate: median, range over seeds)")
    pick = time_answer.get("batch_size")
    if pick in sizes:
        ax.axvline(pick, color="gray", linestyle=":", label=f"the answer: {pick}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("batch size")
    ax.set_ylabel("seconds of training to the target")
    ax.set_title(f"{label}: time to the target")
    ax.legend(fontsize="small")
    if energy:
        on = set(frontier(energy))
        ex = axes[1]
        ex.scatter([s for _, s, _ in energy], [j for _, _, j in energy], color="lightgray")
        line = [(s, j, b) for b, s, j in sorted(energy, key=lambda p: p[1]) if b in on]
        ex.plot([s for s, _, _ in line], [j for _, j, _ in line], marker="o", label="frontier")
        for b, s, j in energy:
            ex.annotate(str(b), (s, j), fontsize="x-small", xytext=(3, 3), textcoords="offset points")
        ex.set_xlabel("predicted seconds to the target")
        ex.set_ylabel("predicted joules to the target")
        ex.set_title("time-energy frontier")
        ex.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path

"""Two runs side by side in one HTML page (a nightly against its baseline, ``harness report BASE NEW --html``):
compare's verdicts (its Markdown, turned into HTML by Python-Markdown), each metric of both runs in one plot, and
each run's header and Ohio State table, from each run's ``ReportData``."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from harness.results.data import build
from harness.results.html import block_html, page, section_html, svg
from harness.results.metrics import title
from harness.results.overview import header_section, ohio_state_section
from harness.results.tables import ReportData


def _markdown(text: str) -> str:
    """Markdown written elsewhere (compare's verdicts) as HTML."""
    import markdown

    return markdown.markdown(text, extensions=["tables"], output_format="html")


def pair_figure(base: ReportData, new: ReportData, key: str) -> tuple[Any, dict[str, str]] | None:
    """One metric of two runs in one plot: the base run's rows dashed, the new run's solid; None when either run
    lacks the metric."""
    from matplotlib import pyplot as plt

    metric = new.metric(key)
    if metric is None or key not in base.tables:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    tips: dict[str, str] = {}
    for name, data, style in (("base", base, "--"), ("new", new, "-")):
        for fw in data.frameworks:
            points = [(bs, v) for bs, v in data.tables[key].loc[fw].items() if isinstance(v, float)]
            if not points:
                continue
            (line,) = ax.plot(*zip(*points), linestyle=style, label=f"{title(fw)} ({name})")
            for bs, value in points:
                gid = f"pair-{key}-{len(tips)}"
                ax.plot([bs], [value], marker="o", color=line.get_color(), gid=gid)
                tips[gid] = f"{title(fw)} ({name}), batch size {bs}: {value:,.{metric.digits}f} {metric.unit}".strip()
    sizes = sorted(set(base.batch_sizes) | set(new.batch_sizes))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel(f"{metric.title} ({metric.unit})" if metric.unit else metric.title)
    ax.set_title(f"{metric.title}: base dashed, new solid")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, tips


def render_pair(base_dir: Path, new_dir: Path, comparison_markdown: str) -> str:
    """Two runs side by side: compare's verdicts (its Markdown), each metric of both runs in one plot, and each run's
    header and Ohio State table in two columns."""
    base, new = build(base_dir), build(new_dir)
    heading = f"{Path(base_dir).name} (base) against {Path(new_dir).name} (new)"
    verdicts = comparison_markdown.split("\n", 1)[1] if comparison_markdown.startswith("# ") else comparison_markdown
    body = [f"<h1>{html.escape(heading)}</h1>", "<h2>Compare's verdicts</h2>", _markdown(verdicts),
            "<h2>Every metric, both runs</h2><div class=\"plots\">"]
    for metric in new.metrics:
        drawn = pair_figure(base, new, metric.key)
        if drawn is not None:
            body.append(svg(*drawn))
    body.append("</div><h2>The Ohio State layout</h2><div class=\"pair\">")
    for name, data, path in (("base", base, base_dir), ("new", new, new_dir)):
        header, ohio = header_section(data), ohio_state_section(data)
        body.append(f"<div><h3>{name}: {html.escape(Path(path).name)}</h3>" + section_html(header, 4, f"{name}-")
                    + "\n".join(block_html(b) for b in ohio.blocks) + "</div>")
    body.append("</div>")
    return page(heading, body)

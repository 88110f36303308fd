"""``report.html``: the report as one self-contained page that opens offline. The report's sections
(``harness.results.sections``, the same ones report.md is rendered from) as HTML, every metric against batch size as
inline SVG whose points name their row, batch size and value on hover (an SVG <title>), a table of every trial with
its status and reason, each trial's sampled time series (inline SVG, warm-up and timed windows shaded) and the
machine and environment. No script, stylesheet, font or image is fetched: the styles are inline and the plots are
SVG elements of the page.

``harness.results.pair`` puts two runs side by side with the pieces here (``svg``, ``section_html``, ``page``).
"""

from __future__ import annotations

import html
import io
import re
from pathlib import Path
from typing import Any

from harness.record.run import RunRecord
from harness.results.metrics import title
from harness.results.plots import NO_METRIC_PLOTS, metric_figure, plotted_metrics, trial_figure
from harness.results.sections import Block, BulletList, Images, Lines, Paragraph, Section, Table
from harness.results.tables import ReportData

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; } th { background: #f4f4f4; }
td:not(:first-child) { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fff0f0; } td.l, th.l { text-align: left; } code { background: #f4f4f4; padding: 0 3px; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; } .plots svg { width: 560px; height: auto; }
.trial svg { width: 640px; height: auto; } details { margin: .3em 0; } summary { cursor: pointer; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; } .pair > div { overflow-x: auto; }
"""


def svg(fig: Any, tips: dict[str, str] | None = None) -> str:
    """A matplotlib figure as an inline <svg> element (text as SVG text in the browser's fonts, nothing external),
    with a <title> (a hover text) added to each group whose id is in ``tips``."""
    import matplotlib
    from matplotlib import pyplot as plt

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as <text> in the page's own fonts: smaller, searchable
        fig.savefig(buffer, format="svg")
    plt.close(fig)
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    for gid, tip in (tips or {}).items():
        text = text.replace(f'<g id="{gid}">', f'<g id="{gid}"><title>{html.escape(tip)}</title>', 1)
    return text


_INLINE = re.compile(r"`([^`]+)`|\[([^\]]+)\]\(([^)\s]+)\)")


def inline(text: str) -> str:
    """Text of a block (``harness.results.sections``: `code` spans, [text](link) links, ``\\*``) as HTML."""
    out, at = [], 0
    for match in _INLINE.finditer(text):
        out.append(html.escape(text[at:match.start()], quote=False).replace("\\*", "*"))
        code, label, link = match.groups()
        out.append(f"<code>{html.escape(code, quote=False)}</code>" if code is not None else
                   f"<a href=\"{html.escape(link)}\">{html.escape(label, quote=False)}</a>")
        at = match.end()
    return "".join(out) + html.escape(text[at:], quote=False).replace("\\*", "*")


def _table(table: Table) -> str:
    def cells(tag: str, row: tuple[str, ...]) -> str:
        return "".join(f"<{tag} class=\"l\">{inline(c)}</{tag}>" if i and a == "left" else f"<{tag}>{inline(c)}</{tag}>"
                       for i, (c, a) in enumerate(zip(row, table.align)))

    classes = [f" class=\"{c}\"" if c else "" for c in table.row_classes] + [""] * len(table.rows)
    body = "".join(f"<tr{classes[i]}>{cells('td', row)}</tr>" for i, row in enumerate(table.rows))
    return f"<table><thead><tr>{cells('th', table.header)}</tr></thead><tbody>{body}</tbody></table>"


def block_html(block: Block) -> str:
    """One block of a section as HTML."""
    if isinstance(block, Paragraph):
        return f"<p>{inline(block.text)}</p>"
    if isinstance(block, Lines):
        return "<p>" + "<br>\n".join(inline(line) for line in block.lines) + "</p>"
    if isinstance(block, BulletList):
        return "<ul>" + "".join(f"<li>{inline(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, Images):
        return "".join(f"<p><a href=\"{html.escape(path)}\">{html.escape(alt, quote=False)}</a></p>"
                       for alt, path in block.images)
    return _table(block)


def section_html(section: Section, level: int | None = None, prefix: str = "") -> str:
    """A section as HTML: its heading (at ``level``, default the section's own; id: ``prefix`` and the section's
    key) and its blocks."""
    h = level or section.level
    anchor = prefix + re.sub(r"[^a-z0-9]+", "-", section.key.lower()).strip("-")
    return "\n".join([f"<h{h} id=\"{anchor}\">{html.escape(section.title, quote=False)}</h{h}>",
                      *(block_html(b) for b in section.blocks)])


def page(heading: str, body: list[str]) -> str:
    """A whole self-contained page: ``body`` (HTML parts) under ``heading``, with the inline styles."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(heading)}</title><style>{STYLE}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def trials_table(data: ReportData) -> str:
    """Every trial: id, row, batch size, seed, repeat, status, reason, wall seconds, throughput."""
    rows = ["<table id=\"trials\"><thead><tr><th>trial</th><th>row</th><th>batch size</th><th>seed</th>"
            "<th>repeat</th><th>status</th><th>reason</th><th>wall s</th><th>samples/s</th></tr></thead><tbody>"]
    for r in data.records:
        throughput = r.metrics.throughput_samples_per_s
        rows.append(f"<tr class=\"{'ok' if r.status == 'ok' else 'bad'}\"><td>{html.escape(r.id)}</td>"
                    f"<td>{html.escape(title(r.row))}</td><td>{r.batch_size}</td><td>{r.seed}</td>"
                    f"<td>{r.repeat}</td><td>{html.escape(r.status)}</td>"
                    f"<td style=\"text-align:left\">{html.escape(r.reason)}</td>"
                    f"<td>{r.wall_s:,.1f}</td>"
                    f"<td>{'' if throughput is None else f'{throughput:,.1f}'}</td></tr>")
    return "\n".join(rows) + "</tbody></table>"


def environment_table(run: RunRecord) -> str:
    """The machine and the harness's environment as run.json recorded them, one row per field (packages folded)."""
    env = run.environment
    rows = []
    for key, value in env.items():
        if key == "packages" and isinstance(value, dict):
            listed = ", ".join(f"{k} {v}" for k, v in sorted(value.items()))
            cell = f"<details><summary>{len(value)} packages</summary>{html.escape(listed)}</details>"
        else:
            cell = html.escape(value if isinstance(value, str) else repr(value))
        rows.append(f"<tr><th>{html.escape(key)}</th><td style=\"text-align:left\">{cell}</td></tr>")
    return "<table id=\"environment\">" + "".join(rows) + "</table>"


def render(data: ReportData, run_dir: Path, sections: list[Section],
           metric_svgs: dict[str, str] | None = None, trial_svgs: dict[str, str | None] | None = None) -> str:
    """The whole report.html of one run (``data``: its ``ReportData``; ``sections``:
    ``harness.results.report.sections(data)``). Every section but the plot links, with the plots of every metric
    after the Ohio State layout. ``metric_svgs`` (metric key -> ``svg`` of its figure) and ``trial_svgs`` (trial id ->
    ``svg`` of ``trial_figure``, None without samples): the figures the PNGs were saved from, already rendered
    (``harness.results.report.write``); what they lack is drawn here."""
    body = []
    for section in sections:
        if section.key == "plots":  # report.md's links to the PNGs: here the plots are inline
            continue
        body.append(section_html(section))
        if section.key == "ohio_state":
            plotted = plotted_metrics(data)
            body.append("<h2 id=\"plots\">Every metric against batch size</h2>")
            if not plotted:
                body.append(f"<p>{html.escape(NO_METRIC_PLOTS)}</p>")
            else:
                body.append("<p>Hover over a point for its row, batch size and value.</p><div class=\"plots\">")
                for metric in plotted:
                    body.append(metric_svgs[metric.key] if metric_svgs and metric.key in metric_svgs else
                                svg(*metric_figure(data, metric)))
                body.append("</div>")
    body += ["<h2 id=\"trials-heading\">Trials</h2>", trials_table(data),
             "<h2>Each trial over time</h2><p>Sampled metrics against seconds since the worker started; warm-up "
             "grey, timed windows green.</p>"]
    for record in data.records:
        if record.status != "ok":
            continue
        if trial_svgs is not None and record.id in trial_svgs:
            drawn = trial_svgs[record.id]
        else:
            fig = trial_figure(run_dir, record.id)
            drawn = svg(fig) if fig is not None else None
        if drawn is not None:
            body.append(f"<details class=\"trial\"><summary>{html.escape(record.id)}</summary>{drawn}</details>")
    body += ["<h2>Machine and environment</h2>", environment_table(data.run)]
    return page(sections[0].title if sections else "report", body)


def write(data: ReportData, run_dir: Path, sections: list[Section],
          metric_svgs: dict[str, str] | None = None, trial_svgs: dict[str, str | None] | None = None) -> Path:
    """Writes ``report.html`` into the run directory (see ``render``) and returns its path."""
    path = Path(run_dir) / "report.html"
    path.write_text(render(data, Path(run_dir), sections, metric_svgs, trial_svgs), encoding="utf-8")
    return path

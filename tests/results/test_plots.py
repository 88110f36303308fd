"""The report's plots: a trial figure redrawn for another trial (``plots.TrialFigures``) shows what a figure of its own
shows, every figure leaves no layout engine behind (one draw per savefig), and a written report has every figure in
both outputs: a PNG that report.md links and an inline SVG in report.html."""

from __future__ import annotations

import json
import re

import pytest

from harness.results import plots, report
from tests.helpers import make_run, record


def write_series(run_dir, trial_id, seconds, cpu, rss_mb):
    """Samples every 0.1 s for ``seconds`` (CPU % up to ``cpu``, RSS up to ``rss_mb`` MB) and a warm-up and two timed
    windows in the events."""
    (run_dir / "samples").mkdir(exist_ok=True)
    (run_dir / "events").mkdir(exist_ok=True)
    n = int(seconds * 10)
    samples = [{"t": 100 + i / 10, "cpu_percent": cpu * i / n, "rss_bytes": rss_mb * 1e6 * (i + 1) / n}
               for i in range(n)]
    (run_dir / "samples" / f"{trial_id}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    edges = [("warmup", 0.1), ("warmup", 0.3), ("train", 0.4), ("train", seconds / 2), ("train", seconds / 2 + 0.1),
             ("train", seconds - 0.1)]
    events = [{"event": "phase", "t": 100 + at, "name": name, "edge": "start" if i % 2 == 0 else "end"}
              for i, (name, at) in enumerate(edges)]
    (run_dir / "events" / f"{trial_id}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def shown(fig):
    """What a figure shows: per axes its limits, ticks and tick labels, labels, title, lines' data and shading."""
    fig.canvas.draw()
    return [(ax.get_xlim(), ax.get_ylim(), list(ax.get_xticks()), [t.get_text() for t in ax.get_yticklabels()],
             ax.get_ylabel(), ax.get_xlabel(), ax.get_title(),
             [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()],
             [p.get_x() for p in ax.patches]) for ax in fig.axes]


def test_a_trial_figure_redrawn_for_another_trial_shows_what_its_own_figure_shows(tmp_path):
    write_series(tmp_path, "long", 9.0, 180.0, 2500.0)
    write_series(tmp_path, "short", 1.5, 40.0, 60.0)
    figures = plots.TrialFigures()
    for trial_id in ("long", "short", "long"):
        reused = figures.figure(tmp_path, trial_id)
        own = plots.trial_figure(tmp_path, trial_id)
        assert reused.get_layout_engine() is None and own.get_layout_engine() is None
        assert shown(reused) == shown(own)
        for a, b in zip(reused.axes, own.axes):  # the same layout, up to its iteration from another start
            assert a.get_position().bounds == pytest.approx(b.get_position().bounds, abs=2e-3)
    assert len(reused.axes[0].patches) == 3  # the last trial's shading only


def test_every_figure_is_in_both_reports(tmp_path):
    records = [record("pytorch", 8), record("pytorch", 16), record("mxnet", 8), record("mxnet", 16, status="oom")]
    run_dir = make_run(tmp_path, records)
    ok = [r["id"] for r in records if r["status"] == "ok"]
    for i, trial_id in enumerate(ok):
        write_series(run_dir, trial_id, 2.0 + i, 100.0, 200.0 * (i + 1))
    data = report.build(run_dir)
    markdown = report.write(run_dir).read_text()
    page = (run_dir / "report.html").read_text()
    pngs = [f"plots/{m.key}.png" for m in data.metrics] + [f"plots/trials/{t}.png" for t in ok]
    for png in pngs:
        assert f"({png})" in markdown and (run_dir / png).stat().st_size > 1000, png
    assert len(re.findall(r"<svg[ >]", page)) == len(data.metrics) + len(ok)
    for trial_id in ok:
        assert re.search(rf"<summary>{trial_id}</summary><svg", page), trial_id


@pytest.mark.parametrize("statuses", [("ok",), ("ok", "oom")], ids=["one-size", "one-size-ok"])
def test_a_run_with_one_batch_size_that_ended_ok_has_no_plot_against_batch_size(tmp_path, statuses):
    """Fewer than two batch sizes with an ok trial (one size, or a second whose trials ran out of memory): no metric
    is drawn against batch size (a line of one point), both reports say so, and each ok trial's time series is still
    drawn and linked."""
    records = [record(fw, size, status=status) for fw in ("pytorch", "mxnet")
               for size, status in zip((8, 16), statuses)]
    run_dir = make_run(tmp_path, records)
    ok = [r["id"] for r in records if r["status"] == "ok"]
    for trial_id in ok:
        write_series(run_dir, trial_id, 2.0, 100.0, 200.0)
    data = report.build(run_dir)
    assert data.metrics and plots.plotted_metrics(data) == []
    markdown = report.write(run_dir).read_text()
    page = (run_dir / "report.html").read_text()
    assert not any((run_dir / "plots" / f"{m.key}.png").exists() for m in data.metrics)
    assert not any(f"(plots/{m.key}.png)" in markdown for m in data.metrics)
    assert plots.NO_METRIC_PLOTS in markdown and plots.NO_METRIC_PLOTS in page
    assert len(re.findall(r"<svg[ >]", page)) == len(ok)
    for trial_id in ok:
        png = f"plots/trials/{trial_id}.png"
        assert f"({png})" in markdown and (run_dir / png).exists()

"""report.html in a real headless browser (Debian's chromium): what the browser rendered (its DOM after loading),
what the page logged to the console (chromium's log of console messages) and what it asked of the network
(chromium's NetLog: every request the page made, told apart from the browser's own by the page's network isolation
key). A control page with a console error and a remote image proves each check can fail.

Chromium is installed by .ci/run; where it is missing the tests fail under HARNESS_REQUIRE_BROWSER=1 (CI) and are
skipped otherwise, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import harness
from tests.helpers import ROOT

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--disable-default-apps", "--no-first-run", "--hide-scrollbars"]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if path is None:
        if os.environ.get("HARNESS_REQUIRE_BROWSER"):
            pytest.fail("no chromium on PATH (HARNESS_REQUIRE_BROWSER is set): apt-get install chromium")
        pytest.skip("no chromium on PATH: apt-get install chromium to run the browser tests")
    return path


class Tags(HTMLParser):
    """Counts the elements of a DOM and keeps the text of each table row (``rows[table id]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}
        self.rows: dict[str, list[str]] = {}
        self._table: str | None = None
        self._row: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.count[tag] = self.count.get(tag, 0) + 1
        if tag == "table":
            self._table = dict(attrs).get("id") or f"table{self.count[tag]}"
        elif tag == "tr":
            self._row = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._row is not None and self._table is not None:
            self.rows.setdefault(self._table, []).append(" ".join(self._row))
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._row is not None and data.strip():
            self._row.append(data.strip())


def open_page(page: Path, work: Path) -> dict:
    """Loads ``page`` in headless chromium; returns the rendered DOM (``tags``), the page's console messages and the
    URLs of the network requests the page made."""
    work.mkdir(parents=True, exist_ok=True)
    netlog = work / "netlog.json"
    done = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={work / 'profile'}", "--enable-logging=stderr",
                           "--v=0", f"--log-net-log={netlog}", "--dump-dom", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    tags = Tags()
    tags.feed(done.stdout)
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    log = json.loads(netlog.read_text())
    kinds = {number: name for name, number in log["constants"]["logEventTypes"].items()}
    requests = [e["params"]["url"] for e in log["events"] if kinds[e["type"]] == "URL_REQUEST_START_JOB"
                and "url" in e.get("params", {})
                and str(e["params"].get("network_isolation_key", "")).startswith("file://")]
    return {"tags": tags, "console": console, "requests": requests, "dom": done.stdout}


def screenshot(page: Path, out: Path, work: Path) -> Path:
    done = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={work / 'shot-profile'}", "--window-size=1280,1800",
                           f"--screenshot={out}", page.resolve().as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and out.exists(), done.stderr[-3000:]
    return out


def test_the_checks_catch_a_console_error_and_a_network_request(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><title>bad</title></head><body>'
                    '<img src="http://example.invalid/a.png"><script>console.error("boom")</script></body></html>')
    seen = open_page(page, tmp_path / "b")
    assert any('"boom"' in line for line in seen["console"]), seen["console"]
    assert seen["requests"] == ["http://example.invalid/a.png"]


def test_report_html_renders_every_table_and_plot_offline(real_run, tmp_path):
    run = harness.load_run(real_run)
    page = real_run / "report.html"
    seen = open_page(page, tmp_path)
    assert seen["console"] == [] and seen["requests"] == [], (seen["console"], seen["requests"])
    tags = seen["tags"]
    ok = list(run.trials.query("status == 'ok'")["id"])
    assert tags.count.get("svg", 0) == len(run.data.metrics) + len(ok)  # every metric, every trial's series
    assert tags.count.get("img", 0) == 0 and tags.count.get("script", 0) == 0 and tags.count.get("link", 0) == 0
    trial_rows = tags.rows["trials"][1:]
    assert len(trial_rows) == len(run.trials)
    for trial, status, reason in run.trials[["id", "status", "reason"]].itertuples(index=False):
        row = next(r for r in trial_rows if r.startswith(trial + " "))
        assert status in row and (not reason or reason[:40] in row)
    text = (real_run / "report.md").read_text()
    for heading in [line[3:] for line in text.splitlines() if line.startswith("## ") and line != "## Plots"]:
        assert heading.replace("&", "&amp;") in seen["dom"], heading
    throughput = run.summary().query("metric == 'throughput' and cell == ''")
    assert all(f"{v:,.1f}" in seen["dom"] for v in throughput["value"])
    assert tags.rows["environment"] and any(r.startswith("python") for r in tags.rows["environment"])
    assert "<title>PyTorch (fp32), batch size 32:" in seen["dom"]  # a point's hover text
    shot = screenshot(page, tmp_path / "report.png", tmp_path)
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[0] >= 1000 and len({tuple(p) for p in pixels[::20, ::20, :3].reshape(-1, 3)}) > 20
    if os.environ.get("HARNESS_SCREENSHOT"):  # how the README's picture is made
        shutil.copy(shot, os.environ["HARNESS_SCREENSHOT"])


def test_report_md_and_html_of_a_real_run_carry_the_same_content(real_run):
    """Without a browser: every heading and table cell of report.md is one of report.html (one set of sections)."""
    from tests.helpers import same_content

    assert same_content((real_run / "report.md").read_text(), (real_run / "report.html").read_text()) == ([], [])


def test_two_runs_side_by_side(real_run, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(real_run, base)
    done = subprocess.run([sys.executable, "-m", "harness", "report", str(base), str(real_run), "--html"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    page = real_run / f"compare-{base.name}.html"
    seen = open_page(page, tmp_path / "b")
    assert seen["console"] == [] and seen["requests"] == []
    run = harness.load_run(real_run)
    assert seen["tags"].count.get("svg", 0) == len(run.data.metrics)
    assert "Regressions beyond 5% and the noise: 0" in seen["dom"]  # a run against its own copy
    verdicts = next(rows for rows in seen["tags"].rows.values() if rows[0].endswith("noise verdict"))
    assert len(verdicts) > 1 and f"{base.name} (base) against {real_run.name} (new)" in seen["dom"]
    refused = subprocess.run([sys.executable, "-m", "harness", "report", str(base), str(real_run)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "need --html" in refused.stderr

"""The report's "Where the time went" section from constructed trial records (no training): per row the summed wall
time, timed training and evaluation, the share outside both, its median per trial, the slowest phase outside both,
and the start path; absent for trials recorded without phases."""

from __future__ import annotations

import pytest

from harness.results import report
from harness.results.sections import Table, to_markdown
from harness.results.time_budget import time_budget_section
from tests.helpers import make_run, record


def _phases(start, import_, data, build, warmup, timed, evaluation, other=0.05, teardown=0.05):
    parts = {"start_s": start, "import_s": import_, "prepare_s": 0.0, "data_s": data, "build_s": build,
             "warmup_s": warmup, "timed_s": timed, "eval_s": evaluation, "other_s": other, "teardown_s": teardown}
    return {**parts, "total_s": sum(parts.values())}


def _records():
    return [
        # pytorch, forked: 0.1 s outside per trial besides a slow build at 16
        record("pytorch", 8, start="forked", phases=_phases(0.02, 0.0, 0.03, 0.1, 0.1, 2.0, 0.5)),
        record("pytorch", 16, start="forked", phases=_phases(0.02, 0.0, 0.03, 0.9, 0.1, 1.0, 0.5)),
        # mxnet: one cold trial whose import dominates, one forked
        record("mxnet", 8, start="cold", phases=_phases(0.3, 3.0, 0.03, 0.1, 0.2, 2.0, 0.5)),
        record("mxnet", 16, start="forked", phases=_phases(0.02, 0.0, 0.03, 0.1, 0.2, 1.0, 0.5)),
    ]


def test_shares_medians_slowest_phase_and_start_path(tmp_path):
    data = report.build(make_run(tmp_path, _records()))
    section = time_budget_section(data)
    assert section is not None and section.title == "Where the time went"
    (table,) = [b for b in section.blocks if isinstance(b, Table)]
    assert table.header == ("row", "start", "trials", "wall s", "timed training s", "evaluation s",
                            "outside training %", "outside per trial s", "slowest phase outside")
    pytorch, mxnet = table.rows
    # pytorch: outside training 0.02 + 0.03 + 0.1 + 0.1 + 0.05 + 0.05 = 0.35 s, and 1.15 s with the slow build
    walls = [0.35 + 2.5, 1.15 + 1.5]
    assert pytorch[:6] == ("PyTorch", "forked", "2", f"{sum(walls):.1f}", "3.0", "1.0")
    assert pytorch[6] == f"{100 * 1.5 / sum(walls):.0f}" and pytorch[7] == f"{(0.35 + 1.15) / 2:.2f}"
    assert pytorch[8] == "build (0.50 s)"  # 0.1 + 0.9 over two trials, median 0.5
    assert mxnet[1] == "forked 1, cold 1" and mxnet[8] == "import (1.50 s)"
    text = to_markdown([section])
    assert "| PyTorch | forked | 2 |" in text and "no device" in text


def test_absent_without_phases(tmp_path):
    records = [record("pytorch", 8), record("mxnet", 8)]
    data = report.build(make_run(tmp_path, records, batch_sizes=(8,)))
    assert time_budget_section(data) is None
    assert "Where the time went" not in report.render_markdown(data)


def test_a_failed_trial_counts_its_time(tmp_path):
    records = [record("pytorch", 8, start="forked", phases=_phases(0.02, 0.0, 0.03, 0.1, 0.1, 2.0, 0.5)),
               record("pytorch", 16, status="oom", start="forked",
                      phases={"start_s": 0.02, "import_s": 0.0, "data_s": 0.03, "build_s": 4.0, "total_s": 4.1})]
    data = report.build(make_run(tmp_path, records, frameworks=("pytorch",)))
    (table,) = [b for b in time_budget_section(data).blocks if isinstance(b, Table)]
    ((row),) = table.rows
    assert row[2] == "2" and float(row[3]) == pytest.approx(2.85 + 4.1, abs=0.05) and row[8].startswith("build")

"""The report's first section, the answer (``harness.results.answer``): the fastest size with its interval and the
knee, the most accurate, the first to the target, the powers-of-two verdict, each per row and computed from the
records, before every table."""

from __future__ import annotations

import pytest

from harness.results import report
from harness.results.answer import Point, fastest_and_knee
from harness.results.data import build
from tests.helpers import make_run, record


def _data(tmp_path, records, batch_sizes, **spec):
    run_dir = make_run(tmp_path, records, frameworks=("pytorch",), batch_sizes=batch_sizes)
    if spec:
        import json

        run = json.loads((run_dir / "run.json").read_text())
        run["spec"].update(spec)
        (run_dir / "run.json").write_text(json.dumps(run))
    return build(run_dir)


def test_the_answer_comes_first_and_is_computed_from_the_records(tmp_path):
    speeds = {8: (900.0, 1000.0, 1100.0), 15: (1480.0, 1500.0, 1520.0), 16: (1900.0, 2000.0, 2100.0),
              17: (1950.0, 2050.0, 2150.0), 32: (2000.0, 2100.0, 2200.0)}
    accuracy = {8: 0.95, 15: 0.93, 16: 0.93, 17: 0.92, 32: 0.90}
    reached = {8: 3.0, 15: 2.0, 16: 1.5, 17: 1.6, 32: None}
    records = [record("pytorch", bs, r, throughput=speeds[bs][r], accuracy=accuracy[bs],
                      **({} if reached[bs] is None else {}))
               for r in range(3) for bs in speeds]
    for rec in records:
        if reached[rec["batch_size"]] is not None:
            rec["metrics"]["time_to_target"] = {"epochs": 2, "training_s": reached[rec["batch_size"]],
                                                "wall_s": 9.0}
    data = _data(tmp_path, records, list(speeds), target_accuracy=0.9)
    sections = report.sections(data)
    assert [s.key for s in sections[:2]] == ["header", "answer"]
    (line,) = sections[1].blocks[0].items
    assert line.startswith("PyTorch: fastest at batch size 32 (2,100 samples/s, 95 % interval ")
    # the knee: 16's interval (1,900..2,100) reaches 0.95 x 2,100 = 1,995; 15's does not
    assert "the knee, the smallest within 95 % of it: 16" in line
    assert "most accurate after 10 epochs: batch size 8 (95.00 %)" in line
    assert "first to 90 % test accuracy: batch size 16 (1.50 s of training)" in line
    assert "15 vs 16: -25.0 %;" in line and "17 vs 16: +2.5 % (within the noise)" in line
    md = report.render_markdown(data, sections)
    assert md.index("## The answer") < md.index("| batch size |")


def test_no_answer_without_a_trial_that_ended_ok(tmp_path):
    data = _data(tmp_path, [record("pytorch", 8, status="oom")], [8])
    assert "answer" not in [s.key for s in report.sections(data)]


def test_the_knee_rule():
    points = [Point(8, 800.0, (700.0, 900.0)), Point(16, 1500.0, (1400.0, 1530.0)), Point(32, 1600.0, None)]
    best, knee = fastest_and_knee(points)
    assert (best.batch_size, knee.batch_size) == (32, 16)
    assert fastest_and_knee([Point(8, 800.0), Point(16, 1530.0), Point(32, 1600.0)])[1].batch_size == 16
    assert fastest_and_knee([Point(8, 800.0), Point(16, 1500.0), Point(32, 1600.0)])[1].batch_size == 32
    # the goal is 95 % of the best's median, whatever the best's own interval
    assert fastest_and_knee([Point(8, 800.0), Point(16, 1530.0), Point(32, 1600.0, (1000.0, 2000.0))])[1] \
        .batch_size == 16
    with pytest.raises(ValueError):
        fastest_and_knee([])

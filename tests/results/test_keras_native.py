"""The report's "Keras over native" section from constructed trial records (no training): the throughput and peak
memory ratios of a Keras row over its native framework's row per batch size, their noise verdicts, the pairing by
``Family.native``, the section's absence without the native framework, and the declarations' titles ("Keras
(JAX)") for rows without a label of their own."""

from __future__ import annotations

from types import SimpleNamespace

from harness.record import TrialRecord
from harness.results import html, report
from harness.results.keras_native import keras_native_section, pairs
from harness.results.sections import Table, to_markdown
from tests.helpers import make_run, record

MB = 1e6

#: (framework, batch size) -> the three repeats' (throughput samples/s, peak RSS MB). keras-jax at batch size 8: half
#: the throughput and 1.5 x the memory, far outside the repeats' spread; at 16: the same as jax within the spread.
CELLS = {
    ("jax", 8): [(100.0, 500.0), (101.0, 502.0), (102.0, 504.0)],
    ("jax", 16): [(200.0, 500.0), (202.0, 502.0), (204.0, 504.0)],
    ("keras-jax", 8): [(50.0, 750.0), (51.0, 752.0), (52.0, 754.0)],
    ("keras-jax", 16): [(199.0, 501.0), (201.0, 503.0), (203.0, 505.0)],
}


def _records(frameworks=("jax", "keras-jax"), labels=None):
    """Three ok repeats per cell of ``CELLS`` for ``frameworks`` (``labels``: framework -> its row's label)."""
    out = []
    for (framework, batch_size), repeats in CELLS.items():
        if framework not in frameworks:
            continue
        label = (labels or {}).get(framework, framework)
        for repeat, (throughput, rss_mb) in enumerate(repeats):
            rec = record(framework, batch_size, repeat, throughput=throughput, label=label,
                         id=f"{label}-bs{batch_size}-r{repeat}")
            rec["sampler"]["stats"]["rss_bytes"]["max"] = rss_mb * MB
            out.append(rec)
    return out


def _data(tmp_path, records, rows=("jax", "keras-jax")):
    return report.build(make_run(tmp_path, records, frameworks=rows, batch_sizes=(8, 16)))


def _table(section):
    (table,) = [block for block in section.blocks if isinstance(block, Table)]
    return table


def test_ratios_and_verdicts_per_batch_size(tmp_path):
    data = _data(tmp_path, _records())
    section = keras_native_section(data)
    assert section is not None and section.title == "Keras over native"
    table = _table(section)
    assert table.header == ("Keras", "native", "batch size", "throughput ratio", "throughput verdict",
                            "peak memory ratio", "memory verdict")
    # medians 51 / 101 and 752 / 502 at batch size 8; 201 / 202 and 503 / 502 at 16
    assert table.rows == (
        ("Keras (JAX)", "JAX", "8", "0.50", "slower", "1.50", "more memory"),
        ("Keras (JAX)", "JAX", "16", "1.00", "no measurable difference", "1.00", "no measurable difference"),
    )
    text = to_markdown([section])
    assert "| Keras (JAX) | JAX | 8 | 0.50 | slower | 1.50 | more memory |" in text
    assert "below 1 Keras trains fewer samples per second" in text
    assert "per-step host synchronisation" in text and "`Model.train_on_batch`" in text
    assert "Memory (peak) (MB)" in text and "anonymous resident memory" in text  # the host's memory metric, named


def test_the_section_is_in_the_report_and_its_html(tmp_path):
    data = _data(tmp_path, _records())
    computed = report.sections(data)
    keys = [section.key for section in computed]
    assert "keras_native" in keys and keys.index("keras_native") > keys.index("metric:throughput")
    markdown = report.render_markdown(data, computed)
    assert "## Keras over native" in markdown
    page = html.section_html(next(s for s in computed if s.key == "keras_native"))
    assert '<h2 id="keras-native">Keras over native</h2>' in page
    assert "<td>Keras (JAX)</td><td class=\"l\">JAX</td><td>8</td><td>0.50</td>" in page


def test_absent_without_the_native_framework(tmp_path):
    records = [r for r in _records() if r["framework"] == "keras-jax"]
    records += [record("pytorch", bs, repeat, id=f"pytorch-bs{bs}-r{repeat}") for bs in (8, 16) for repeat in range(3)]
    data = _data(tmp_path, records, rows=("pytorch", "keras-jax"))
    assert keras_native_section(data) is None  # keras-jax's native is jax, not pytorch
    assert "keras_native" not in [section.key for section in report.sections(data)]
    (tmp_path / "native").mkdir()
    only_native = _data(tmp_path / "native", _records(frameworks=("jax",)), rows=("jax",))
    assert keras_native_section(only_native) is None


def test_an_unlabelled_keras_row_reads_as_its_declaration_title(tmp_path):
    text = report.render_markdown(_data(tmp_path, _records()))
    assert "| Keras (JAX) | 51.0 [50.0, 52.0] | 201.0 [199.0, 203.0] |" in text  # the Throughput table
    assert "| Keras (JAX) memory MB | 752.00 | 503.00 |" in text  # the Ohio State layout
    assert "keras-jax" not in text.replace("keras-jax-bs", "")  # no row shows the adapter's bare name


def test_an_explicit_label_is_kept_and_still_paired(tmp_path):
    labels = {"keras-jax": "Keras tuned"}
    data = _data(tmp_path, _records(labels=labels), rows=("jax", "Keras tuned"))
    assert pairs(data) == [("Keras tuned", "jax")]
    assert [row[:3] for row in _table(keras_native_section(data)).rows] == [("Keras tuned", "JAX", "8"),
                                                                            ("Keras tuned", "JAX", "16")]


def test_pairs_by_native_and_variant_with_every_native_label():
    def rec(framework, label, variant=""):
        return TrialRecord(id=f"{label}-{variant}", framework=framework, label=label, variant=variant, batch_size=8,
                           repeat=0, device="cpu", status="ok", wall_s=1.0)

    records = [rec("keras-torch", "keras-torch", "bf16"), rec("keras-torch", "keras-torch", "fp32"),
               rec("pytorch", "pytorch", "bf16"), rec("pytorch", "pytorch", "fp32"),
               rec("pytorch", "pytorch nightly", "bf16"), rec("jax", "jax", "bf16"), rec("tensorflow", "tensorflow")]
    rows = ["keras-torch (bf16)", "keras-torch (fp32)", "pytorch (bf16)", "pytorch (fp32)", "pytorch nightly (bf16)",
            "jax (bf16)", "tensorflow"]
    assert pairs(SimpleNamespace(records=records, frameworks=rows)) == [
        ("keras-torch (bf16)", "pytorch (bf16)"), ("keras-torch (bf16)", "pytorch nightly (bf16)"),
        ("keras-torch (fp32)", "pytorch (fp32)")]


def test_on_a_gpu_the_memory_ratio_is_the_worker_process_peak(tmp_path):
    records = []
    for framework, throughput, process_mb in (("jax", 1000.0, 2000.0), ("keras-jax", 800.0, 3000.0)):
        for repeat in range(3):
            rec = record(framework, 8, repeat, backend="nvml", throughput=throughput + repeat, label=framework,
                         id=f"{framework}-bs8-r{repeat}")
            rec["sampler"]["stats"]["process_memory_bytes"]["max"] = (process_mb + repeat) * MB
            records.append(rec)
    data = report.build(make_run(tmp_path, records, frameworks=("jax", "keras-jax"), batch_sizes=(8,)))
    section = keras_native_section(data)
    assert _table(section).rows == (("Keras (JAX)", "JAX", "8", "0.80", "slower", "1.50", "more memory"),)
    text = to_markdown([section])
    assert "GPU memory (worker, peak) (MB)" in text and "not the framework allocator's own peak" in text

"""The report from constructed run directories (records written as trials.jsonl holds them, schema version 2, read
back through the one loader): Ohio State layout, statuses in cells, medians with bootstrap intervals over repeats,
noise pairs, the GPU (NVML) layout with memory layers, MFU and energy per sample (derived once, in
``harness.results.derived``)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.record import TrialRecord
from harness.results import derived, html, report, store, tables
from harness.results.sections import BulletList, Images, Lines, Paragraph, Section, batch_table, to_markdown
from harness.results.stats import median_ci, overlaps
from tests.helpers import make_run, record, report_text, same_content


def typed(records):
    return [TrialRecord.model_validate(r) for r in records]


def test_ohio_state_layout_with_statuses_and_medians(tmp_path):
    records = [record("pytorch", 8, throughput=100.0, accuracy=0.6), record("pytorch", 16, throughput=180.0),
               record("mxnet", 8, throughput=90.0), record("mxnet", 16, status="oom")]
    text = report.write(make_run(tmp_path, records)).read_text()
    assert "| batch size | 8 | 16 |" in text
    assert "| PyTorch CPU use % | 90.00 | 90.00 |" in text
    assert "| PyTorch memory MB | 500.00 | 500.00 |" in text  # a record without rss_anon_bytes: its whole RSS
    assert "| MXNet memory MB | 500.00 | oom |" in text
    assert "| PyTorch accuracy after 10 epochs % | 60.00 | 50.00 |" in text
    assert "| mxnet-bs16-r0 | oom | CUDA out of memory |" in text
    assert "| PyTorch RSS MB | 500.0 | 500.0 |" in text and "| PyTorch data MB | 2.0 | 2.0 |" in text
    assert (tmp_path / "run" / "plots" / "throughput.png").exists()


def test_repeats_give_median_and_interval_and_noise_pairs(tmp_path):
    rng = np.random.default_rng(1)
    records = []
    for repeat in range(6):
        # pytorch 8 and mxnet 8 overlap (same distribution); pytorch 16 is far away from pytorch 8
        records += [record("pytorch", 8, repeat, throughput=100 + rng.normal(0, 2)),
                    record("mxnet", 8, repeat, throughput=100 + rng.normal(0, 2)),
                    record("pytorch", 16, repeat, throughput=200 + rng.normal(0, 2)),
                    record("mxnet", 16, repeat, throughput=300 + rng.normal(0, 2))]
    data = report.build(make_run(tmp_path, records))
    metric = data.metric("throughput")
    low, high = data.cis["throughput"][("pytorch", 8)]
    values = tables.cell_values(typed(records), metric, "pytorch", 8)
    assert low <= np.median(values) <= high and high - low < 10
    pairs = tables.noise_pairs(data, metric)
    assert pairs == ["PyTorch vs MXNet at batch size 8"]
    row = tables.metric_row(data, metric, "pytorch", 1)
    assert row[0].startswith(f"{np.median(values):,.1f} [") and row[0].endswith("]")


def test_median_ci_and_overlap():
    assert median_ci([3.0]) is None
    assert median_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    a = median_ci(list(range(100)))
    assert 40 < a[0] < 50 < a[1] < 60
    assert overlaps((1, 2), (2, 3)) and not overlaps((1, 2), (2.5, 3)) and overlaps(None, (1, 2)) is None


def test_gpu_layout_memory_layers_mfu_and_energy(tmp_path):
    recs = [record("pytorch", 8, backend="nvml", throughput=67_000.0,
                   ), record("mxnet", 8, backend="nvml", throughput=33_500.0)]
    for rec in recs:
        rec["sampler"]["energy"] = {"energy_j": 500.0, "mean_power_w": 250.0, "method": "counter", "duration_s": 2.0}
    found = derived.mfu(TrialRecord.model_validate(recs[0]))
    assert found.fraction == pytest.approx(67_000 * 1e9 / 67e12) and found.peak_flops_per_s == 67e12
    assert "H100" in found.source and found.note is None
    assert derived.energy_per_sample_j(TrialRecord.model_validate(recs[0])) == pytest.approx(0.05)
    text = report.write(make_run(tmp_path, recs, batch_sizes=(8,))).read_text()
    assert "| PyTorch GPU use % | 40.00 |" in text and "| PyTorch GPU memory MB | 700.00 |" in text
    assert "| PyTorch NVML device MB | 1,000.0 |" in text and "| PyTorch allocator peak MB | 300.0 |" in text
    assert "| MXNet allocator reserved peak MB | n/a |" in text
    # 67,000 samples/s x 1 GFLOP per sample = 67 TFLOP/s: the whole fp32 peak of an H100 SXM
    assert "## Model FLOPs utilization (%)" in text and "| PyTorch | 100.00 |" in text and "| MXNet | 50.00 |" in text
    assert "## Energy per training sample (mJ)" in text and "| PyTorch | 50.000 |" in text  # 500 J / 10,000
    assert "not SM occupancy" in text


def test_mfu_left_out_for_cpu_and_unknown_devices():
    assert derived.mfu(TrialRecord.model_validate(record("pytorch", 8))) is None  # a CPU has no peak to miss
    unknown = record("pytorch", 8, backend="nvml")
    unknown["sampler"]["name"] = "NVIDIA L40S"  # not an L4: names match whole
    found = derived.mfu(TrialRecord.model_validate(unknown))
    assert found.fraction is None and found.note == "unknown device: no peak (NVIDIA L40S)"
    t4 = record("pytorch", 8, backend="nvml", precision="bf16")  # the T4's entry has no bf16 peak
    t4["sampler"]["name"] = "Tesla T4"
    found = derived.mfu(TrialRecord.model_validate(t4))
    assert found.fraction is None and found.note == "no bf16 peak for Tesla T4"
    pair = record("pytorch", 8, backend="nvml", data_parallel=2, throughput=67_000.0)  # two GPUs: twice the peak
    assert derived.mfu(TrialRecord.model_validate(pair)).fraction == pytest.approx(0.5)


def test_the_report_says_why_mfu_is_empty(tmp_path):
    known, unknown = record("pytorch", 8, backend="nvml"), record("mxnet", 8, backend="nvml")
    unknown["sampler"]["name"] = "NVIDIA RTX A1000"
    text = report.write(make_run(tmp_path, [known, unknown], batch_sizes=(8,))).read_text()
    section = text[text.index("## Model FLOPs utilization (%)"):]
    section = section[:section.index("\n## ", 5)]
    assert "| MXNet | n/a |" in section and "n/a: unknown device: no peak (NVIDIA RTX A1000)." in section


def test_study_sections_from_a_real_run(fault_adapter, monkeypatch, tmp_path):
    """Variants x batch sizes around a power of two, with repeats, scaling and a target accuracy."""
    from harness.plan import checked_spec as validate
    from harness.studies.sweep import run_spec
    from tests.helpers import base_spec

    monkeypatch.setenv("HARNESS_STEP_SLEEP", "*:0.002")
    spec = validate(base_spec(frameworks=[fault_adapter], batch_sizes=[15, 16, 17], epochs=2, repeats=2,
                              learning_rate_scaling="linear", base_batch_size=16, target_accuracy=0.3,
                              variants={"optimizer": [{"name": "sgd", "learning_rate": 0.1},
                                                      {"name": "sgd", "learning_rate": 0.4, "momentum": 0.5}]}),
                    tmp_path / "s.yaml")
    run_dir = run_spec(spec, tmp_path / "r")
    records = store.read_trials(run_dir)
    assert len(records) == 2 * 2 * 3 and {r.variant for r in records} == {"sgd lr=0.1", "sgd lr=0.4 m=0.5"}
    assert {r.learning_rate for r in records if r.batch_size == 16} == {0.1, 0.4}
    text = report.write(run_dir).read_text()
    text = text.replace("| fault (", "| Fault (")  # only built-in frameworks get a capitalised title
    assert "| Fault (sgd lr=0.1) |" in text and "| Fault (sgd lr=0.4 m=0.5) |" in text
    assert "| Fault (sgd lr=0.1) accuracy after 2 epochs % | 90.53 |" in text.replace("90.53 | 90.53 | 90.53", "90.53")
    assert "## Learning rate and effective batch size" in text
    assert "| Fault (sgd lr=0.1) | 0.09375 | 0.10000 | 0.10625 |" in text  # 0.1 x 15/16, x 16/16, x 17/16
    assert "## Time to 30% test accuracy" in text and "First to reach it: fault (sgd lr=0.1): batch size" in text
    assert "## Powers of two against their neighbours" in text
    pow2_rows = [line for line in text.splitlines() if line.startswith("| Fault (sgd lr=0.1) | 16 |")]
    assert [row.split("|")[3].strip() for row in pow2_rows] == ["15", "17"]
    assert all(row.split("|")[5].strip() in ("no measurable difference", "faster", "slower") for row in pow2_rows)


def test_the_report_says_what_the_sampler_could_not_measure(tmp_path):
    recs = [record("pytorch", 8, backend="nvml"), record("mxnet", 8, backend="nvml")]
    recs[0]["sampler"].update(unavailable={"energy_mj":
                                           "NVML_ERROR_NOT_SUPPORTED (nvmlDeviceGetTotalEnergyConsumption)"},
                              notes=["MIG instance: device-level utilization is not available"],
                              energy={"energy_j": 9.0, "method": "power_integral", "short_windows": 2, "windows": 5,
                                      "short_window_s": 1.0, "duration_s": 0.1},
                              throttle={"count": 4, "share": {"gpu_idle": 0.5, "sw_power_cap": 0.25}})
    recs[1]["sampler"]["energy"] = {"energy_j": 5.0, "method": "counter", "short_windows": 0, "windows": 5}
    text = report.write(make_run(tmp_path, recs, batch_sizes=(8,))).read_text()
    section = text[text.index("## How the sampler fared"):]
    assert "- energy_mj: NVML_ERROR_NOT_SUPPORTED" in section
    assert "- MIG instance: device-level utilization is not available (1 trial)" in section
    assert "total-energy counter (nvmlDeviceGetTotalEnergyConsumption): 1 trials" in section
    assert "power integrated over time" in section and "pytorch-bs8-r0 (2 of 5 windows < 1.0 s)" in section
    assert "pytorch-bs8-r0: sw_power_cap 25%" in section and "gpu_idle" not in section
    assert "No energy figure" not in section and "No GPU utilization" not in section
    # windows too short for the counter's refresh and for the driver's utilization period (seen on an H200)
    recs[1]["sampler"]["energy"] = {"energy_j": None, "method": "counter", "short_windows": 1, "windows": 1,
                                    "duration_s": 0.0056, "note": "less than the reading's refresh"}
    recs[1]["sampler"]["stats"]["gpu_util_pct"] = {"count": 0, "scope": "too short"}
    recs[1]["sampler"]["stats"]["sm_active_pct"] = {"count": 0, "scope": "too short"}
    (tmp_path / "s").mkdir()
    section = report.write(make_run(tmp_path / "s", recs, batch_sizes=(8,))).read_text()
    section = section[section.index("## How the sampler fared"):]
    assert "shorter than the reading's refresh (both edges would read the same value): mxnet-bs8-r0 (0.006 s)" \
        in section
    assert "driver's averaging period (1/6 s; nvmlDeviceGetUtilizationRates): mxnet-bs8-r0." in section
    assert "between two GPM reads (0.1 s; nvmlGpmMetricsGet): mxnet-bs8-r0." in section
    # on the CPU, a trial whose windows held no sample of the live worker (its only sample came after its exit)
    short = [record("pytorch", 8), record("pytorch", 16)]
    short[1]["sampler"]["stats"]["rss_anon_bytes"] = {"count": 0, "scope": "none"}
    short[1]["metrics"]["measured_s"] = 0.031
    (tmp_path / "h").mkdir()
    section = report.write(make_run(tmp_path / "h", short, frameworks=("pytorch",), batch_sizes=(8, 16))).read_text()
    section = section[section.index("## How the sampler fared"):].split("\n## ")[0]
    assert "No CPU use or memory figure where no sample of the live worker fell in the timed windows" in section
    assert "docs/design/sampling.md): pytorch-bs16-r0 (0.031 s)." in section and "pytorch-bs8-r0" not in section
    quiet = [record("pytorch", 8)]  # host backend, nothing unusual: no section at all
    (tmp_path / "q").mkdir()
    assert "How the sampler fared" not in report.write(make_run(tmp_path / "q", quiet, batch_sizes=(8,))).read_text()


def test_seeds_give_the_mean_and_a_t_interval_for_accuracy_and_repeats_the_median_for_timing(tmp_path):
    """With several seeds, accuracy and loss cells are the mean over seeds (of each seed's median over its repeats)
    with a Student-t interval; throughput stays the median over every repeat with a bootstrap interval; the report
    says which spread is which."""
    from scipy import stats

    accuracy = {0: 0.90, 1: 0.94, 2: 0.95}
    records = [record("pytorch", 8, repeat, seed=seed, throughput=100.0 + repeat + seed, accuracy=accuracy[seed],
                      id=f"pytorch-bs8-r{repeat}-s{seed}") for repeat in range(2) for seed in accuracy]
    run_dir = make_run(tmp_path, records, frameworks=("pytorch",), batch_sizes=(8,))
    data = report.build(run_dir)
    acc = data.metric("accuracy")
    values = np.array(list(accuracy.values())) * 100
    assert data.tables["accuracy"].loc["pytorch", 8] == pytest.approx(values.mean())
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    low, high = data.cis["accuracy"][("pytorch", 8)]
    assert (low, high) == pytest.approx((values.mean() - half, values.mean() + half))
    thr = data.metric("throughput")
    records = typed(records)
    assert data.tables["throughput"].loc["pytorch", 8] == np.median(tables.cell_values(records, thr, "pytorch", 8))
    assert tables.seed_values(records, acc, "pytorch", 8) == pytest.approx(list(values))
    text = report.write(run_dir).read_text()
    assert "Cells show the mean over 3 seeds [95% t-interval of that mean]" in text
    assert "timing noise of the same training" in text


def test_seeds_plan_one_trial_per_seed_with_its_own_seed(tmp_path):
    from harness.plan import checked_spec, plan
    from tests.helpers import base_spec

    spec = checked_spec(base_spec(seeds=[3, 7], repeats=2, batch_sizes=[16]), tmp_path / "s.yaml")
    trials = plan(spec, "cpu")
    assert [(t.id, t.seed) for t in trials] == [("pytorch-bs16-r0-s3", 3), ("pytorch-bs16-r0-s7", 7),
                                                ("pytorch-bs16-r1-s3", 3), ("pytorch-bs16-r1-s7", 7)]
    from harness.spec import SpecError

    with pytest.raises(SpecError, match="seeds: a seed is listed twice"):
        checked_spec(base_spec(seeds=[1, 1]), tmp_path / "s.yaml")


def test_mixed_precision_accuracy_against_fp32_per_batch_size(tmp_path):
    """Rows that differ only in precision are set against the fp32 row: the change in points per batch size (with
    a noise verdict from the intervals of the repeats) and the change of the curve from the smallest to the largest
    batch size; rows of another execution mode are paired with their own fp32 row."""
    records = []
    for variant, precision, compile, accuracies in (
            ("fp32, eager", "fp32", "eager", {8: (0.90, 0.91, 0.92), 16: (0.80, 0.81, 0.82)}),
            ("bf16, eager", "bf16", "eager", {8: (0.905, 0.915, 0.925), 16: (0.70, 0.71, 0.72)}),
            ("fp32, compiled", "fp32", "compiled", {8: (0.5, 0.5, 0.5), 16: (0.5, 0.5, 0.5)}),
            ("bf16, compiled", "bf16", "compiled", {8: (0.6, 0.6, 0.6)})):
        for bs, values in accuracies.items():
            for repeat, accuracy in enumerate(values):
                rec = record("pytorch", bs, repeat, accuracy=accuracy, variant=variant, precision=precision,
                             compile=compile)
                rec["id"] += f"-{precision}-{compile}"
                records.append(rec)
    text = report.write(make_run(tmp_path, records, frameworks=("pytorch",))).read_text()
    section = text.split("## Mixed precision and accuracy")[1].split("\n## ")[0]
    assert "| PyTorch (bf16, eager) - fp32 | +0.50 (within noise) | -10.00 (beyond noise) |" in section
    assert "| PyTorch (bf16, compiled) - fp32 | +10.00 (beyond noise) |  |" in section  # nothing in bf16 at 16
    assert ("PyTorch (bf16, eager): from batch size 8 to 16 accuracy moves -10.00 points in fp32 and -20.50 in bf16 "
            "(the curve's slope changes by -10.50 points)") in section
    assert "PyTorch (bf16, compiled): from" not in section  # one batch size: no curve
    assert "Largest change: +10.00 points (PyTorch (bf16, compiled), batch size 8)" in section
    plain = [record("pytorch", 8), record("pytorch", 16)]
    (tmp_path / "b").mkdir()
    assert "Mixed precision" not in report.write(make_run(tmp_path / "b", plain, frameworks=("pytorch",))).read_text()


GPM_STATS = {"sm_active_pct": 55.0, "sm_occupancy_pct": 30.0, "tensor_active_pct": 42.5, "dram_bw_util_pct": 12.25}


def _with_gpm(rec, scale=1.0):
    rec["sampler"]["stats"].update({k: {"mean": v * scale, "median": v * scale, "max": v * scale, "count": 5,
                                        "scope": "windows"} for k, v in GPM_STATS.items()})
    return rec


def test_gpm_rows_beside_gpu_use_and_mfu_where_trials_have_them(tmp_path):
    """NVML GPM metrics (Hopper and newer) join the Ohio State layout after GPU use %, with MFU; a trial without them
    (an older GPU) reads n/a, and each gets its own section."""
    records = [_with_gpm(record("pytorch", 8, backend="nvml")), _with_gpm(record("pytorch", 16, backend="nvml"), 2),
               record("mxnet", 8, backend="nvml"), record("mxnet", 16, backend="nvml")]
    data = report.build(make_run(tmp_path, records))
    labels = [label for label, _ in tables.ohio_state_rows(data)]
    assert labels[:7] == ["PyTorch GPU use %", "PyTorch SM active %", "PyTorch SM occupancy %",
                          "PyTorch tensor active %", "PyTorch DRAM bandwidth %", "PyTorch MFU %",
                          "PyTorch GPU memory MB"]
    text = report.render_markdown(data)
    assert "| PyTorch SM active % | 55.00 | 110.00 |" in text and "| MXNet SM active % | n/a | n/a |" in text
    assert "| PyTorch DRAM bandwidth % | 12.25 | 24.50 |" in text
    assert "## SM activity (mean) (%)" in text and "NVML_GPM_METRIC_SM_UTIL" in text
    assert "NVML's GPM metrics" in text


def test_no_gpm_rows_without_gpm_values(tmp_path):
    nvml = [record("pytorch", 8, backend="nvml"), record("mxnet", 8, backend="nvml")]
    data = report.build(make_run(tmp_path, nvml, batch_sizes=(8,)))
    assert not {"sm_active", "sm_occupancy", "tensor_active", "dram_bw"} & {m.key for m in data.metrics}
    text = report.render_markdown(data)
    assert "SM active" not in text and "GPM" not in text and "MFU %" in text  # MFU, derived for every GPU trial
    (tmp_path / "cpu").mkdir()
    cpu = report.build(make_run(tmp_path / "cpu", [_with_gpm(record("pytorch", 8))], batch_sizes=(8,)))
    assert [label for label, _ in tables.ohio_state_rows(cpu)] == [
        "PyTorch CPU use %", "PyTorch memory MB", "PyTorch accuracy after 10 epochs %"]


def test_markdown_and_html_are_rendered_from_the_same_sections(tmp_path):
    """report.md and report.html are two renderings of one list of sections: every heading and every table cell of
    the Markdown is a heading or a cell of the HTML, on a GPU run with a failed trial, GPM rows and a sampler note."""
    records = [_with_gpm(record("pytorch", 8, backend="nvml")), record("pytorch", 16, backend="nvml"),
               record("mxnet", 8, backend="nvml"), record("mxnet", 16, status="oom", backend="nvml",
                                                          reason="out | of memory")]
    records[2]["sampler"]["unavailable"] = {"sm_active": "no GPM on this GPU"}
    run_dir = make_run(tmp_path, records)
    text = report.write(run_dir).read_text()
    page = (run_dir / "report.html").read_text()
    assert same_content(text, page) == ([], [])
    assert "| mxnet-bs16-r0 | oom | out / of memory |" in text and "<td class=\"l\">out | of memory</td>" in page
    data = report.build(run_dir)
    assert data.run_dir == run_dir
    computed = report.sections(data)
    assert to_markdown(computed) == text
    assert report_text(run_dir) == text  # what tests of the report's text read instead of writing it whole
    assert [s.title for s in computed][:4] == ["t: 4 of 4 trials", "The answer", "The Ohio State layout",
                                               "Memory, layer by layer"]
    # the check can fail: a page without one section's table misses its cells
    broken = page.replace(html.block_html(computed[2].blocks[1]), "")
    assert same_content(text, broken)[1]


def test_the_markdown_renderer_writes_each_block_type():
    sections = [Section("a", "Title", (BulletList(("one", "two `x`")), Lines(("l1", "l2"))), level=1),
                Section("b", "Part", (Paragraph("text"), batch_table([("row", ["1", "a|b"])], [8, 16]),
                                      Images((("alt", "plots/a.png"),))))]
    assert to_markdown(sections) == ("# Title\n\n- one\n- two `x`\n\nl1\nl2\n\n## Part\n\ntext\n\n"
                                     "| batch size | 8 | 16 |\n| --- | ---: | ---: |\n| row | 1 | a/b |\n\n"
                                     "![alt](plots/a.png)\n")
    assert html.inline("a `b<c>` [d](e.png) \\* f") == 'a <code>b&lt;c&gt;</code> <a href="e.png">d</a> * f'

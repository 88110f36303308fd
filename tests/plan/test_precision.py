"""Precision and execution mode through the whole sweep: variants cross them, a combination an adapter cannot run is
``unsupported`` with its reason before any worker starts, the records and the report say which precision and mode
each row ran in, and the first step (compilation included) is timed on its own."""

from __future__ import annotations

import adapters
from harness.plan import checked_spec, model_info, plan, variants
from harness.plan.support import Conditions
from harness.plan.support import unsupported as plan_unsupported
from harness.results import store
from harness.studies import sweep
from tests.helpers import base_spec, report_text, skip_probes


def unsupported(name, info, precision, compile, device):
    return plan_unsupported(adapters.BUILTIN[name], info, Conditions(precision, compile, device))


def test_variants_cross_precision_and_mode(tmp_path):
    spec = checked_spec(base_spec(frameworks=["pytorch"], batch_sizes=[16, 32], variants={
        "precision": ["fp32", "bf16"], "compile": ["eager", "compiled"]}), tmp_path / "s.yaml")
    assert [v.label for v in variants(spec)] == ["fp32, eager", "fp32, compiled", "bf16, eager", "bf16, compiled"]
    trials = plan(spec, "cpu")
    assert len(trials) == 8 and {(t.precision, t.compile) for t in trials} == {
        ("fp32", "eager"), ("fp32", "compiled"), ("bf16", "eager"), ("bf16", "compiled")}
    assert trials[0].precision == "fp32"
    plain = checked_spec(base_spec(precision="bf16", compile="compiled"), tmp_path / "p.yaml")
    assert [(t.precision, t.compile, t.variant) for t in plan(plain, "cpu")] == [("bf16", "compiled", "")]


def test_the_plan_decides_execution_from_the_declaration_before_any_worker(tmp_path):
    info = model_info(checked_spec(base_spec(), tmp_path / "s.yaml"))
    assert unsupported("pytorch", info, "bf16", "compiled", "cpu") is None
    assert unsupported("pytorch", info, "fp16", "default", "cpu").startswith(
        "the pytorch adapter does not train in fp16 on cpu (only on cuda): fp16 with dynamic loss scaling is")
    assert unsupported("pytorch", info, "fp16", "default", "cuda:0") is None
    assert unsupported("jax", info, "fp32", "eager", "cpu") == (
        "the jax adapter has no eager mode (its modes: compiled)")
    assert unsupported("jax", info, "fp32", "default", "cpu") is None  # JAX's default mode is compiled


def test_a_sweep_records_precision_mode_first_step_and_unsupported_rows(monkeypatch, tmp_path):
    """PyTorch in bf16 and fp16 (refused on the CPU) and JAX in eager mode (it has none) on the CPU: the refused
    trials are recorded at plan time with the reason and no worker; the bf16 trial ran in bf16 (its settings) with
    its first step timed apart; the report names each row's precision and mode."""
    # JAX's interpreter is never started
    skip_probes(monkeypatch)
    spec = checked_spec(base_spec(frameworks=["pytorch", "jax"], variants={
        "precision": ["bf16", "fp16"], "compile": ["eager"]}), tmp_path / "s.yaml")
    run_dir = sweep.run_spec(spec, tmp_path / "runs")
    records = {(r.framework, r.precision): r for r in store.read_trials(run_dir)}
    assert {key: r.status for key, r in records.items()} == {
        ("pytorch", "bf16"): "ok", ("pytorch", "fp16"): "unsupported",
        ("jax", "bf16"): "unsupported", ("jax", "fp16"): "unsupported"}
    assert records[("pytorch", "fp16")].reason.startswith(
        "not run: the pytorch adapter does not train in fp16 on cpu (only on cuda): fp16 with dynamic loss")
    assert records[("jax", "bf16")].reason == "not run: the jax adapter has no eager mode (its modes: compiled)"
    assert not (run_dir / "events" / f"{records[('pytorch', 'fp16')].id}.jsonl").exists()
    ok = records[("pytorch", "bf16")]
    assert ok.settings["autocast_dtype"] == "bfloat16" and ok.metrics.precision == "bf16"
    assert ok.metrics.compile == "eager" and ok.metrics.compile_meaning == "eager torch.nn modules"
    assert ok.metrics.first_step_s > 0
    text = report_text(run_dir)
    assert "precision per row (variants); execution mode per row (variants)" in text
    assert "| PyTorch (bf16, eager) |" in text and "| PyTorch (fp16, eager) | unsupported |" in text
    assert "## First step (compilation included) (s)" in text

"""A model of your own through a real sweep: the mechanisms that work on the neutral model work on it (data
parallelism over two processes, a data loader), or are refused by the plan with the reason before anything trains
(a loader under data parallelism, synchronised batchnorm on the CPU); the records and the report say which model
each row trained, with its parameters and FLOPs counted by the framework."""

from __future__ import annotations

from harness import plan
from harness.plan.support import Conditions
from harness.results import store
from harness.studies import sweep
from tests.helpers import ROOT, base_spec, report_text


def test_a_torch_module_of_your_own_runs_data_parallel_and_through_a_loader(tmp_path):
    data = base_spec(frameworks=[{"name": "pytorch", "model": {"factory": f"{ROOT}/specs/models.py:torch_cnn",
                                                                "kwargs": {"width": 8}}}],
                     batch_sizes=[32], cpu_threads=2, variants={"data_parallel": [1, 2],
                                                                  "input": ["resident", "loader"]})
    del data["model"]
    spec = plan.checked_spec(data, tmp_path / "s.yaml")
    run_dir = sweep.run_spec(spec, tmp_path / "runs")
    records = {(r.data_parallel, r.metrics.input if r.status == "ok" else "loader"): r
               for r in store.read_trials(run_dir)}
    assert {key: r.status for key, r in records.items()} == {
        (1, "resident"): "ok", (1, "loader"): "ok", (2, "resident"): "ok", (2, "loader"): "unsupported"}, {
        key: r.reason for key, r in records.items()}
    ok = [r for r in records.values() if r.status == "ok"]
    assert {r.metrics.model_source for r in ok} == {"native"} and len({r.metrics.parameter_count for r in ok}) == 1
    assert all(r.metrics.train_flops_per_sample and r.metrics.achieved_flops_per_s for r in ok)
    assert records[(2, "resident")].metrics.data_parallelism.mechanism.startswith("torch.nn.parallel")
    assert records[(1, "loader")].metrics.input_wait_s > 0
    assert all(r.metrics.test_accuracy > 0.5 for r in ok)  # one epoch of a small CNN on digits
    text = report_text(run_dir)
    assert "## Models" in text and "`models.py:torch_cnn(width=8)`" in text and "no: a model of your own" in text


def test_sync_batchnorm_of_a_model_of_your_own_is_refused_on_the_cpu(tmp_path):
    """Whether a model of your own has batchnorm is unknown to the plan: synchronised batchnorm is refused where
    the adapter has none (PyTorch on the CPU), with the declaration's reason."""
    data = base_spec(frameworks=[{"name": "pytorch", "model": {"factory": f"{ROOT}/specs/models.py:torch_cnn"}}],
                     data_parallel={"devices": 2, "sync_batchnorm": True})
    del data["model"]
    spec = plan.checked_spec(data, tmp_path / "s.yaml")
    why = plan.unsupported_reason(spec, "pytorch", Conditions(data_parallel=2, sync_batchnorm=True))
    assert why is not None and why.startswith("the pytorch adapter has no synchronised batchnorm on cpu"), why

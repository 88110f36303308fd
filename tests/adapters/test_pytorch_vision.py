"""torchvision's models, brought as models of your own (specs/torchvision.yaml), in their own environment
(envs/pytorch-vision: PyTorch's requirements plus the entry's packages, torchvision's own torch release; ``make test``
makes it with ``harness envs create --spec specs/torchvision.yaml``). A real sweep of the spec, shrunk to one small
batch on synthetic 32x32 images: every entry trains, its parameter count is torchvision's own, its FLOPs are counted
by torch, and the report lists the packages' versions beside the framework's."""

from __future__ import annotations

import pytest

from harness import plan
from harness import spec as spec_module
from harness.execution import environments
from harness.results import store
from harness.studies import sweep
from tests.helpers import ROOT, report_text

#: torchvision 0.29.1's models with num_classes=10: sum(p.numel() for p in model.parameters()).
PARAMETERS = {"resnet18": 11_181_642, "mobilenet_v3_small": 1_528_106}


@pytest.fixture(scope="module")
def vision_env():
    """envs/pytorch-vision, made when missing (kept when up to date)."""
    spec = spec_module.load(ROOT / "specs" / "torchvision.yaml")
    for folder, framework, packages in environments.spec_environments(spec):
        environments.create(framework, ROOT / "envs", name=folder, packages=packages)


@pytest.mark.slow
def test_the_torchvision_spec_trains_each_model_of_its_own(vision_env, tmp_path):
    spec = plan.load(ROOT / "specs" / "torchvision.yaml", {
        "dataset": {"name": "synthetic", "shape": [32, 32, 3], "classes": 10, "size": 128, "test_size": 32},
        "batch_sizes": [16], "warmup_steps": 1, "cpu_threads": 2, "device": "cpu"})
    run_dir = sweep.run_spec(spec, tmp_path / "runs")
    records = {r.label: r for r in store.read_trials(run_dir)}
    assert {label: r.status for label, r in records.items()} == {"resnet18": "ok", "mobilenet_v3_small": "ok"}, {
        label: r.reason for label, r in records.items()}
    for label, record in records.items():
        assert record.metrics.model_source == "native" and record.metrics.parameter_count == PARAMETERS[label]
        assert record.metrics.flops_source == "torch.utils.flop_counter.FlopCounterMode"
        assert record.metrics.train_flops_per_sample > 1e6  # a real network at 32x32: millions per sample
    flops = {label: record.metrics.train_flops_per_sample for label, record in records.items()}
    assert flops["resnet18"] > flops["mobilenet_v3_small"], flops
    run = store.read_run(run_dir)
    assert all(entry.versions.get("torchvision") == "0.29.1" for entry in run.frameworks), run.frameworks
    text = report_text(run_dir)
    assert "`torchvision.models:resnet18(weights=None, num_classes=10)`" in text and "11,181,642" in text
    assert "torchvision 0.29.1" in text

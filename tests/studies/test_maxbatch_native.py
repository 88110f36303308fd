"""max-batch for a model of your own: a real search under a real CPU cap, each probe a fresh worker that builds the
model from its factory. There is no neutral model to predict from, so the search starts from probes alone; the answer
is confirmed by a second probe (ok in both)."""

from __future__ import annotations

import pytest

from harness.plan import checked_spec
from harness.studies.max_batch import find_max_batch, table
from tests.helpers import ROOT, base_spec


@pytest.mark.slow
def test_a_torch_module_of_your_own_gets_a_confirmed_limit(tmp_path):
    data = base_spec(frameworks=[{"name": "pytorch", "model": {"factory": f"{ROOT}/specs/models.py:torch_cnn"}}],
                     dataset={"name": "synthetic", "shape": [8, 8, 1], "classes": 10}, device="cpu",
                     memory_limit_mb=300, timeout_s=120)
    del data["model"]
    spec = checked_spec(data, tmp_path / "s.yaml")
    result = find_max_batch(spec, "pytorch", tolerance=0.5, margin=0.0, run_checks=0, initial_sizes=(16, 256))
    shown = table(result)
    assert result.status == "found", shown
    assert result.statuses(result.limit) == ["ok", "ok"], shown  # confirmed by a second probe
    assert result.neutral is None and result.neutral_limit is None  # a model of your own: no neutral prediction
    assert result.smallest_oom is not None and "oom" in result.statuses(result.smallest_oom), shown
    assert result.model is not None and result.model.per_sample_bytes > 0, shown

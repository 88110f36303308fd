"""benchmarks/advise_vs_sweep.py's arithmetic: a size's median seconds to target only where most seeds reached it,
and the workers' seconds summed over every run directory under a folder."""

from __future__ import annotations

import importlib.util
import json

from tests.helpers import ROOT


def _benchmark():
    spec = importlib.util.spec_from_file_location("advise_vs_sweep", ROOT / "benchmarks" / "advise_vs_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_median_needs_most_seeds_to_have_reached_the_target():
    table = _benchmark().summary({8: [1.0, 3.0, 2.0, None, 5.0], 512: [0.5, None, None, None, 0.4]})
    assert table[8] == {"median": 2.5, "min": 1.0, "max": 5.0, "reached": "4/5"}
    assert table[512]["median"] is None and table[512]["reached"] == "2/5" and table[512]["min"] == 0.4


def test_worker_seconds_sum_every_trial_of_every_run(tmp_path):
    for name, walls in (("a", [1.5, 2.0]), ("b/c", [0.25])):
        folder = tmp_path / name
        folder.mkdir(parents=True)
        (folder / "trials.jsonl").write_text("".join(json.dumps({"wall_s": w}) + "\n" for w in walls))
    assert _benchmark().worker_seconds(tmp_path) == 3.75


def test_set_changes_the_spec_beside_it_for_both_sides(tmp_path):
    """--set KEY=VALUE: a copy of the spec with the key changed, in the spec's folder (a model of your own is found
    there), read as YAML values; a malformed item is refused."""
    import pytest
    import yaml

    spec = tmp_path / "own.yaml"
    spec.write_text("name: own\nbatch_sizes: [16, 64]\nmodel: {factory: 'models.py:net'}\n")
    derived = _benchmark().overridden(spec, ["learning_rate_scaling=sqrt", "base_batch_size=64"])
    assert derived.parent == tmp_path and derived != spec
    assert yaml.safe_load(derived.read_text()) == {"name": "own", "batch_sizes": [16, 64],
                                                   "model": {"factory": "models.py:net"},
                                                   "learning_rate_scaling": "sqrt", "base_batch_size": 64}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        _benchmark().overridden(spec, ["nothing"])

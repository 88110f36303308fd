"""A model of your own with bad input is caught before anything runs, once per entry in its own interpreter: one
line naming the spec file and the field, exit 2, no run directory (``harness.execution.native_probe``, the
packages check of ``harness.execution.probes.probe_entries``). The entries run in the harness's own
interpreter, which has PyTorch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from harness import plan
from harness.execution.probes import probe_entries
from harness.spec import SpecError
from tests.helpers import ROOT, base_spec

MODELS = '''
from torch import nn


def good(classes=10):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, classes))


def broken(width=3):
    raise ValueError(f"a width of {width} is too narrow")


def not_a_module():
    return {"layers": 2}


def imagenet_head():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 1000))
'''


def _spec(tmp_path, model=None, packages=None, name="s.yaml"):
    (tmp_path / "models.py").write_text(MODELS)
    entry = {"name": "pytorch", **({"model": model} if model else {}), **({"packages": packages} if packages else {})}
    data = base_spec(frameworks=[entry])
    del data["model"]  # every entry brings its own (or the check says which lacks one)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("model, packages, field, message", [
    ({"factory": "no_such_module_xyz:make"}, None, "model.factory",
     "cannot import no_such_module_xyz: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ({"factory": "models.py:nothing"}, None, "model.factory", "has no nothing"),
    ({"factory": "models.py:broken", "kwargs": {"width": 1}}, None, "model",
     "models.py:broken(width=1) raised ValueError: a width of 1 is too narrow"),
    ({"factory": "models.py:not_a_module"}, None, "model", "models.py:not_a_module returned a builtins.dict, not a "
                                                           "torch.nn.Module"),
    ({"factory": "models.py:imagenet_head"}, None, "model",
     "models.py:imagenet_head gives (2, 1000) logits, the dataset needs (batch, 10): 10 classes"),
    ({"factory": "models.py:good"}, ["definitely-not-installed-pkg==1.0"], "packages",
     "lacks definitely-not-installed-pkg==1.0, which the entry pytorch needs"),
])
def test_bad_input_is_one_spec_error_naming_the_field(tmp_path, model, packages, field, message):
    path = _spec(tmp_path, model, packages)
    spec = plan.load(path)
    with pytest.raises(SpecError) as err:
        probe_entries(spec, path)
    text = str(err.value)
    assert text.startswith(f"{path}: frameworks.0.{field}: "), text
    assert message in text and "\n" not in text, text


def test_a_spec_without_a_model_names_the_entries_that_lack_one(tmp_path):
    path = _spec(tmp_path)
    with pytest.raises(SpecError, match=r": model: the entries pytorch have no model of their own"):
        plan.load(path)


def test_the_command_line_exits_2_with_one_line_and_writes_nothing(tmp_path):
    path = _spec(tmp_path, {"factory": "models.py:not_a_module"})
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT),
                                                                             "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"{path}: frameworks.0.model: {tmp_path}/models.py:not_a_module returned a "
                                   "builtins.dict, not a torch.nn.Module"), proc.stderr
    assert not out.exists()

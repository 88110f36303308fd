"""The harness from Python (``harness.api``): the guide's example runs as written (a sweep from a dict, its frames
read back, its report written), and a bad spec or option raises SpecError naming it before anything runs."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

import pytest

import harness
from harness.spec import SpecError
from tests.helpers import ROOT, base_spec


def test_the_guides_example_runs_a_sweep_from_a_dict_and_reads_its_frames(envs, tmp_path, monkeypatch):
    text = (ROOT / "docs" / "guide" / "python.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/guide/python.md", "exec"), namespace)  # the guide's own example, as written
    run = namespace["run"]
    assert isinstance(run, harness.Run) and run.path.parent == tmp_path / "results"
    assert sorted(run.trials.batch_size) == [16, 128] and (run.trials.status == "ok").all()
    assert (run.trials.throughput_samples_per_s > 0).all() and (run.trials.test_accuracy > 0.5).all()
    assert (run.path / "report.md").exists() and (run.path / "report.html").exists()
    assert printed.getvalue().rstrip().endswith("True") and "throughput_samples_per_s" in printed.getvalue()


def test_relative_paths_of_a_dict_resolve_against_its_root(tmp_path):
    from harness.api import spec_of

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "py").symlink_to(os.path.realpath(sys.executable))
    spec, name = spec_of(base_spec(frameworks=[{"name": "pytorch", "python": "bin/py"}]), root=tmp_path)
    assert name == "<dict>" and spec.entries[0].python == str(tmp_path / "bin" / "py")


@pytest.mark.parametrize(("call", "words"), [
    (lambda: harness.run(base_spec(batch_sizes=[0])), "<dict>: batch_sizes.0: Input should be greater than 0"),
    (lambda: harness.run(42), "a spec is a path or a dict, not int"),
    (lambda: harness.max_batch(base_spec(frameworks=[{"name": "pytorch", "label": "a"},
                                                     {"name": "pytorch", "label": "b"}]), "pytorch"),
     "<dict>: --framework: pytorch names 2 entries"),
    (lambda: harness.advise(base_spec(), objectives=("speed",)), "<dict>: --objective: speed: each is one of"),
])
def test_a_bad_spec_or_option_raises_before_anything_runs(tmp_path, monkeypatch, call, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((SpecError, TypeError)) as raised:
        call()
    assert str(raised.value).startswith(words)
    assert not (tmp_path / "results").exists()

"""Keras 3 on the jax backend: the checks of tests/adapters/keras_checks.py, in envs/keras-jax."""

import pytest

from tests.adapters.keras_checks import *  # noqa: F403 (the tests, collected here)


@pytest.fixture(scope="module")
def keras_name() -> str:
    return "keras-jax"


def test_an_environment_without_keras_is_one_line_naming_the_entry_and_the_fix(write_spec, tmp_path):
    """envs/jax has JAX but no Keras: the run stops before anything runs, exit 2, one line naming the file, the
    entry and the command that makes the right environment."""
    import subprocess
    import sys

    from harness.execution import environments
    from harness.spec import ROOT
    from tests.helpers import base_spec

    python = environments.create("jax", ROOT / "envs")[0]
    path = write_spec(base_spec(frameworks=["pytorch", {"name": "keras", "backend": "jax", "python": str(python)}]))
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert line.startswith(f"{path}: frameworks.1: keras-jax is not installed in") and (
        "harness envs create keras-jax" in line), line
    assert not (tmp_path / "r").exists()

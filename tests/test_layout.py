"""The house: imports go one way only (import-linter's contracts in setup.cfg), and the worker's side of the harness
stays importable with its light dependencies alone (it runs in each framework's own interpreter)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

LINT = Path(sys.executable).with_name("lint-imports")


def lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_the_import_contracts_hold():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_a_planted_upward_import_breaks_the_layers(tmp_path):
    for name in ("harness", "adapters"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", tmp_path)
    models = tmp_path / "harness" / "neutral" / "models.py"
    models.write_text(models.read_text().replace(
        "from harness.spec import ", "from harness.studies import sweep  # noqa\nfrom harness.spec import ", 1))
    proc = lint(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "harness.neutral is not allowed to import harness.studies" in proc.stdout
    assert "harness.neutral.models -> harness.studies.sweep" in proc.stdout


def test_a_framework_import_in_the_harness_breaks_a_contract(tmp_path):
    for name in ("harness", "adapters"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", tmp_path)
    (tmp_path / "harness" / "measure" / "sneaky.py").write_text("import torch\n")
    proc = lint(tmp_path)
    assert proc.returncode == 1 and "harness.measure.sneaky -> torch" in proc.stdout, proc.stdout


def test_the_worker_side_imports_no_heavy_dependency():
    """The worker runs in each framework's environment, where only numpy, pydantic and PyYAML are required."""
    code = ("import sys, harness.execution.worker, harness.execution.limits, adapters, adapters.base;"
            "print(sorted(m for m in ('pandas', 'matplotlib', 'scipy', 'psutil', 'rich', 'sklearn', 'torch',"
            " 'tensorflow', 'mxnet') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_function_of_the_harness_is_much_over_60_lines():
    long = []
    for path in list((ROOT / "harness").rglob("*.py")) + list((ROOT / "adapters").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 70:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_suites_schedule_names_real_files():
    """tests/conftest.py's LONGEST_FIRST and SERIAL_MODULES name test files that exist: a renamed file would
    otherwise fall silently to the end of the parallel part, or out of the serial one."""
    from tests.conftest import LONGEST_FIRST, SERIAL_MODULES

    for path in LONGEST_FIRST:
        assert (ROOT / "tests" / path).is_file(), path
    for module in SERIAL_MODULES:
        assert list((ROOT / "tests").rglob(f"{module}.py")), module

"""The house: imports go one way only and close no circle (import-linter's contracts in setup.cfg, and
scripts/import_cycles.py for the circles the contracts cannot see), no module of the harness is over 450 lines, and
the worker's side of the harness stays importable with its light dependencies alone (it runs in each framework's own
interpreter)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

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


CYCLES = ROOT / "scripts" / "import_cycles.py"
#: Packages whose own circles are tolerated for now (their owners are untangling them; setup.cfg's acyclic contract
#: skips the same): remove an entry once scripts/import_cycles.py finds no circle there.
UNTANGLING: tuple[str, ...] = ()


def import_cycles(cwd: Path) -> subprocess.CompletedProcess[str]:
    """scripts/import_cycles.py over the harness and adapters under ``cwd``, tolerating UNTANGLING."""
    allow = [arg for package in UNTANGLING for arg in ("--allow", package)]
    return subprocess.run([sys.executable, str(CYCLES), *allow], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def _copy_tree(tmp_path: Path) -> Path:
    for name in ("harness", "adapters"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", tmp_path)
    return tmp_path


def test_no_import_circles_in_packages_through_their_init_or_the_top_level():
    """No circle among the modules of harness and adapters (lazy imports count), whether between siblings, between a
    package and its own modules, or through the ``harness`` top level: no module imports the package itself."""
    proc = import_cycles(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "imports the harness package itself" not in proc.stdout


def test_a_planted_lazy_import_circle_breaks_the_acyclic_contract(tmp_path):
    """A lazy import inside a function (energy's statistics asking multi_gpu, which imports energy) is a circle to
    both the contract and the script."""
    root = _copy_tree(tmp_path)
    energy = root / "harness" / "measure" / "energy.py"
    energy.write_text(energy.read_text() + "\n\ndef _planted():\n    from harness.measure import multi_gpu  # noqa\n")
    proc = lint(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No cycles are allowed in harness.measure." in proc.stdout
    found = import_cycles(root)
    assert found.returncode == 1 and "circle: harness.measure.energy, harness.measure.multi_gpu" in found.stdout, (
        found.stdout + found.stderr)


def test_an_import_of_the_top_level_package_is_found(tmp_path):
    """``from harness import __version__`` in a module: a circle through the top level's lazy hook waiting to close,
    which the contract type cannot see and the script does."""
    root = _copy_tree(tmp_path)
    energy = root / "harness" / "measure" / "energy.py"
    energy.write_text(energy.read_text().replace("import numpy as np\n",
                                                 "import numpy as np\n\nfrom harness import __version__  # noqa\n", 1))
    proc = import_cycles(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "harness.measure.energy imports the harness package itself" in proc.stdout


def test_no_module_of_the_harness_or_an_adapter_is_over_450_lines():
    paths = sorted([*(ROOT / "harness").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")])
    long = [f"{path.relative_to(ROOT)} ({n} lines)" for path in paths
            if (n := len(path.read_text().splitlines())) > 450]
    assert not long, long


def test_the_tests_are_laid_out_like_the_packages():
    """A tests/<room>/ folder for every sub-package of harness (and tests/adapters for the adapters), and no test
    module imports another test module: what they share is in tests/helpers.py (or tests/adapters/kit.py and the
    adapters' shared suites), fixtures in conftest.py."""
    rooms = {path.parent.name for path in (ROOT / "harness").glob("*/__init__.py")}
    missing = sorted(room for room in rooms | {"adapters"} if not (ROOT / "tests" / room).is_dir())
    assert not missing, missing
    imports_a_test = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            schedule = path.name == "test_layout.py" and names == ["tests.conftest"]  # the suite's schedule, below
            if not schedule and any(name.rsplit(".", 1)[-1].startswith("test_") or name.endswith(".conftest")
                                    for name in names):
                imports_a_test.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not imports_a_test, imports_a_test


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


def test_the_serial_part_collects_every_file_that_holds_a_serial_test():
    """The Makefile's SERIAL_TESTS, the only files the serial part of ``make test`` collects, are exactly the files
    with a serial test: a module of SERIAL_MODULES or a test marked ``@pytest.mark.serial`` (a serial test elsewhere
    would run in neither part)."""
    import re

    from tests.conftest import SERIAL_MODULES

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    listed = set(re.search(r"^SERIAL_TESTS := (.+)$", makefile, re.M).group(1).split())
    holding = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
               if path.stem in SERIAL_MODULES
               or re.search(r"^@pytest\.mark\.serial\b", path.read_text(encoding="utf-8"), re.M)}
    assert listed == holding, (sorted(listed - holding), sorted(holding - listed))

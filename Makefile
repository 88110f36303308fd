# Two commands on a fresh machine with Python 3.11 and pip:  make run   and   make test
# make run creates the virtual environment in .venv with the harness alone, and the framework environments in envs/
# that its SPEC runs in; make test also installs the tests, and CPU builds of PyTorch, TensorFlow and MXNet for the
# in-process adapter tests, in .venv, and every framework environment. Each is made only when missing or outdated.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPEC ?= specs/quick.yaml
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: install envs test-envs run lint test test-gpu docs clean

# pip installs uv (its pin in requirements/cpu.txt), and uv the rest, .venv and envs/, from the sources pip is
# configured to use (harness.execution.installers tells uv pip's find-links, indexes and constraints, and installs
# with pip where uv cannot be told them); INSTALLER=pip installs everything with pip alone, the same pins.
# $(VENV)/.harness: what `make run` needs, the harness and its own dependencies (NVML's client for device: auto);
# the frameworks run in envs/. $(VENV)/.installed: the rest, for the tests, lint and docs. The pins of
# requirements/cpu.txt are constraints throughout: the harness itself allows numpy 2, but MXNet in this environment
# needs numpy < 2, and the newest releases of some dependencies would pull numpy 2 in.
INSTALLER ?= auto
INSTALL := $(PY) -m harness.execution.installers $(if $(filter pip,$(INSTALLER)),--pip)
ENVS_CREATE := $(PY) -m harness envs create $(if $(filter pip,$(INSTALLER)),--installer pip)
$(VENV)/.harness: setup.cfg pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip $(if $(filter pip,$(INSTALLER)),,"$$(grep -E '^uv==' requirements/cpu.txt)")
	$(INSTALL) -e '.[gpu]' -c requirements/cpu.txt
	touch $@

$(VENV)/.installed: $(VENV)/.harness
	$(INSTALL) -r requirements/cpu.txt
	$(INSTALL) -e '.[test,gpu,ray,parquet,mlflow,docs]' -c requirements/cpu.txt
	touch $@

install: $(VENV)/.installed

# One virtualenv per framework under envs/ (PyTorch and TensorFlow on numpy 2, MXNet on numpy 1.26); kept when up
# to date. specs/quick.yaml runs each framework in its own.
envs: $(VENV)/.installed
	$(ENVS_CREATE)

# What the tests need beyond the frameworks' own environments: envs/pytorch-vision, PyTorch with torchvision (its own
# torch release: CPU builds from PyTorch's CPU index where it answers; offline, on x86_64, PyPI's CUDA build, which
# also runs on the CPU), for tests/adapters/test_pytorch_vision.py.
test-envs: $(VENV)/.installed
	$(ENVS_CREATE) --spec specs/torchvision.yaml

# Only the environments $(SPEC) runs in (its entries' envs/<folder>/bin/python), made when missing.
run: $(VENV)/.harness
	$(ENVS_CREATE) --spec $(SPEC) >/dev/null
	$(PY) -m harness run $(SPEC)

# The import contracts (setup.cfg), ruff and mypy (pyproject.toml: the rule set and why, strict at the seams).
lint: $(VENV)/.installed
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check harness adapters tests benchmarks scripts docs
	$(VENV)/bin/mypy

# The suite in two parts: TEST_WORKERS processes side by side (pytest-xdist, a test file per process), then the
# serial tests alone (tests/conftest.py SERIAL_MODULES and @pytest.mark.serial: they judge times against bounds or
# noise). --no-loadscope-reorder: files start in collection order, the longest first (tests/conftest.py
# LONGEST_FIRST). The serial part collects only SERIAL_TESTS, the files that hold serial tests (tests/test_layout.py
# checks the list against the markers): collecting every module imports every framework.
SERIAL_TESTS := tests/execution/test_interruptions.py tests/execution/test_timing.py tests/execution/test_launcher.py \
	tests/measure/test_sampler.py tests/studies/test_nightly.py
# Bytecode caches on for the suite (Python's default; an image may turn them off with PYTHONDONTWRITEBYTECODE=1, as
# this project's VM does): the suite starts hundreds of interpreters from this checkout, each of which would compile
# the harness's sources again, and every pytest process would rewrite the asserts of every test module again.
test: export PYTHONDONTWRITEBYTECODE :=
test: envs test-envs lint
	$(PY) -m pytest -m "not gpu and not serial" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
	$(PY) -m pytest -m "serial and not gpu" $(PYTEST_ARGS) $(SERIAL_TESTS)

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/): the reference pages are generated from the code by docs/hooks.py;
# --strict turns every warning (a broken link or anchor, a page missing from the nav) into an error.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean -f mkdocs.yml -d build/site

clean:
	rm -rf $(VENV) envs build *.egg-info

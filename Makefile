# Two commands on a fresh machine with Python 3.11 and pip:  make run   and   make test
# Both create the virtual environment in .venv (CPU builds of PyTorch, TensorFlow and MXNet) when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPEC ?= specs/quick.yaml
PYTEST_ARGS ?=

.PHONY: install run test test-gpu clean

$(VENV)/.installed: setup.cfg pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/cpu.txt
	$(PY) -m pip install --quiet -e '.[test,gpu]'
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) -m harness run $(SPEC)

test: $(VENV)/.installed
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

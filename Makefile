# The two commands of the README: `make demo` and `make test` (and `make docs` for the documentation).
# Each creates .venv (torch first, so pip sees it satisfied and never pulls CUDA wheels),
# installs vcdask with pinned dependencies, then runs the demo or the whole test suite.
# For the inner loop: `make test-fast` (no worker processes, notebooks or examples) and `make lint`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast test-min lint docs env clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test]"
	touch $@

env: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/vcdask demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest

# Unit tests and engine tests without worker processes: about 90 s on 2 cores. Tests that start
# worker processes are marked `cluster` (tests/conftest.py marks users of the cluster/client fixtures).
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -m "not slow and not chaos and not cluster"

$(VENV)/.lint-installed: pyproject.toml constraints.txt $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[lint]"
	touch $@

# ruff and mypy as configured in pyproject.toml, and no import cycles (.ci/import_cycles.py); runs all four
# and fails if any fails. CI runs it first.
lint: $(VENV)/.lint-installed
	status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/ruff format --check . || status=1; \
	$(BIN)/mypy || status=1; \
	$(BIN)/python .ci/import_cycles.py vcdask || status=1; \
	exit $$status

# The documentation, built with warnings as errors into docs/_build/html.
$(VENV)/.docs-installed: pyproject.toml constraints.txt $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

# The dependency floors pyproject.toml declares, pinned (constraints-min.txt), in a venv of their own: the fast
# tests and the demo on them. Not in CI (another environment: a few minutes to install); run it when a floor, or
# what vcdask imports from a dependency, changes.
VENV_MIN ?= .venv-min
test-min:
	test -x $(VENV_MIN)/bin/python || $(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/pip install --quiet "$(TORCH)"
	$(VENV_MIN)/bin/pip install --quiet -c constraints-min.txt -e ".[test]"
	$(VENV_MIN)/bin/python -m pytest -m "not slow and not chaos and not cluster"
	$(VENV_MIN)/bin/vcdask demo

clean:
	rm -rf $(VENV) $(VENV_MIN) vcdask-runs .pytest_cache docs/_build docs/generated

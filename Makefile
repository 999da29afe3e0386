# The two commands of the README: `make demo` and `make test` (and `make docs` for the documentation).
# Each creates .venv (torch first, so pip sees it satisfied and never pulls CUDA wheels),
# installs vcdask with pinned dependencies, then runs the demo or the whole test suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: demo test docs env clean

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

# The documentation, built with warnings as errors into docs/_build/html.
docs: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[docs]"
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) vcdask-runs .pytest_cache docs/_build docs/generated

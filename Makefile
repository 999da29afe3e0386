# The two commands of the README: `make demo` and `make test`.
# Each creates .venv (torch first, so pip sees it satisfied and never pulls CUDA wheels),
# installs vcdask with pinned dependencies, then runs the demo or the whole test suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: demo test env clean

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

clean:
	rm -rf $(VENV) vcdask-runs .pytest_cache

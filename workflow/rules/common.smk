from pathlib import Path

from kvpool import config as kvpool_config
from kvpool import mp, runlock
from kvpool.cells import CELL_PATTERN, Cell, cells, pool_predecessor
from kvpool.model import RANDOM_MODEL_DIR

# What the config alone decides is checked while parsing, so a dry run catches it too. Paths and
# free space belong to the machine that runs the jobs: onstart checks them there, before any job
# (a dry run, which may plan for another machine, skips onstart).
_problems = kvpool_config.problems(config, Path.cwd(), check_paths=False)
if _problems:
    raise ValueError("config cannot run:\n  " + "\n  ".join(_problems))


onstart:
    # held until this Snakemake process ends: no second run measures in this working directory meanwhile
    KVPOOL_RUN_LOCK = runlock.acquire(Path.cwd())
    _problems = kvpool_config.problems(config, Path.cwd(), check_paths=True)
    if _problems:
        raise ValueError("config cannot run on this machine:\n  " + "\n  ".join(_problems))

CELLS = cells(config)
CONDA_ENV = f"../../envs/{'gpu' if config['engine']['kind'] == 'vllm' else 'cpu'}.yaml"


wildcard_constraints:
    backend="lmcache-fs|lmcache-local-disk|lmcache-mp",
    arm="shared|isolated",
    chunk=r"\d+",
    tier="[A-Za-z0-9_-]+",


def model_path():
    """The engine's model: the configured one, or the random-weights model this workflow builds."""
    return config["engine"]["model"] or RANDOM_MODEL_DIR


def model_input(wildcards=None):
    """The model directory as a rule input, when this workflow builds it."""
    return [] if config["engine"]["model"] else [RANDOM_MODEL_DIR]


def cell_path(name):
    """``name`` inside the cell folder, as a pattern over the cell wildcards."""
    return f"results/cells/{CELL_PATTERN}/{name}"


def cell_files(name):
    """``name`` in every cell folder of the matrix, in matrix order."""
    return [f"results/cells/{cell.name}/{name}" for cell in CELLS]


def shared_cell_files(name):
    """``name`` in every shared-arm cell folder (the tier comparison reads only those)."""
    return [f"results/cells/{cell.name}/{name}" for cell in CELLS if cell.arm == "shared"]


def pool_freed_first(wildcards):
    """With keep_pools: false, the previous cell of the tier has measured and removed its pool.

    An ordering-only input (ancient): re-measuring that cell does not make this one stale.
    """
    before = pool_predecessor(config, Cell.from_wildcards(wildcards))
    return [ancient(f"results/cells/{before.name}/reuse.json")] if before else []


def cell_log(step):
    return f"logs/{step}/{CELL_PATTERN}.log"

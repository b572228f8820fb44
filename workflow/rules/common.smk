import re
import sys
from pathlib import Path

from kvpool import config as kvpool_config
from kvpool import settings as kvpool_settings
from kvpool.engine import external, mp, redis_pool
from kvpool.measure import model_check, runlock
from kvpool.report import breakdown, tables
from kvpool.report import contexts as contexts_report, crossover as crossover_report
from kvpool.studies import capacity, contexts, crossover, load, measured_only, routers, study_a, studyb, trace_replay
from kvpool.cells import BACKEND_LABEL, CELL_PATTERN, Arm, Cell
from kvpool.matrix import cells, is_memory_pool, measured, pool_predecessor
from kvpool.studies.load import LEVEL_PATTERN, levels, load_chain
from kvpool.report import load as load_report, studyb as studyb_report
from kvpool.engine.model import RANDOM_MODEL_DIR

# What the config alone decides is checked while parsing, so a dry run catches it too. Paths and
# free space belong to the machine that runs the jobs: onstart checks them there, before any job
# (a dry run, which may plan for another machine, skips onstart).
_problems = kvpool_config.problems(config, Path.cwd(), check_paths=False)
if _problems:
    raise ValueError("config cannot run:\n  " + "\n  ".join(_problems))
# A dry run skips onstart, but says what would stop the run if it ran here (cores this machine lacks, ...).
if workflow.output_settings.dryrun and not config["measured_only"]:
    for _problem in kvpool_config.problems(config, Path.cwd(), check_paths=True):
        print(f"kvpool: on this machine the run would stop before its first job: {_problem}", file=sys.stderr)


onstart:
    # held until this Snakemake process ends: no second run measures in this working directory meanwhile
    KVPOOL_RUN_LOCK = runlock.acquire(Path.cwd())
    # measured_only runs nothing that needs the tiers, the model or the cores
    _problems = [] if MEASURED_ONLY else kvpool_config.problems(config, Path.cwd(), check_paths=True)
    if _problems:
        raise ValueError("config cannot run on this machine:\n  " + "\n  ".join(_problems))


onsuccess:
    # Snakemake 9 can report success having skipped what was asked (kvpool.config.unbuilt_targets)
    _missing = kvpool_config.unbuilt_targets(workflow.dag)
    if _missing:
        print(kvpool_config.unbuilt_message(_missing), file=sys.stderr)
        sys.exit(1)


# measured_only: the summaries of what this working directory holds, and no rule that measures
MEASURED_ONLY = config["measured_only"]
CELLS = measured(config, Path.cwd()) if MEASURED_ONLY else cells(config)
# measured_only judges each cell again and tables it: refused where this config is not the one its run
# recorded in what the gate and Study A's tables read, which would overwrite the run's verdicts and rows
# with others, and where the run finished cells this config's matrix leaves out, whose verdicts and KV
# bytes a gate over the rest would never read
MEASURED_ONLY_STEPS = [
    study_a.run_validity,
    study_a.run_kv_bytes,
    tables.run_table1,
    tables.run_tier_compare,
    load_report.run_load_table,
    breakdown.run_breakdown,
]
_otherwise = measured_only.judged_otherwise(config, CELLS, Path.cwd(), MEASURED_ONLY_STEPS) if MEASURED_ONLY else []
_left_out = measured_only.left_out(config, Path.cwd()) if MEASURED_ONLY else []
if _otherwise or _left_out:
    raise ValueError(
        "measured_only: this config is not the one these cells' runs recorded; give the run's own config (each "
        "cell's manifest.json holds it under 'config')"
        + "".join(f"\n  {line}" for line in _otherwise)
        + "".join(f"\n  {line}: a finished cell this config's matrix leaves out" for line in _left_out)
    )
# Table 2 compares the shared cells of tiers whose read ceiling is measured (all of them, unless measured_only)
CEILING_TIERS = [
    tier for tier in config["tiers"] if not MEASURED_ONLY or Path(f"results/tiers/{tier}/ceiling.json").exists()
]
COMPARED = [cell for cell in CELLS if cell.arm == Arm.SHARED and cell.tier in CEILING_TIERS]
TIER_COMPARE = "results/tier_compare.csv" if COMPARED else []  # an input, or none
TIER_TABLE = "results/tier_table.csv" if COMPARED else []
CONDA_ENV = f"../../envs/{'gpu' if config['engine']['kind'] == 'vllm' else 'cpu'}.yaml"


wildcard_constraints:
    backend=BACKEND_LABEL,
    arm="shared|isolated",
    chunk=r"\d+",
    level=LEVEL_PATTERN,
    block=r"\d+-(on|off)",
    router="cross|round-robin|random|prefix-affinity",
    doc=r"\d+",
    tier="[A-Za-z0-9_-]+",


def model_path():
    """The engine's model: the configured one, or the random-weights model this workflow builds."""
    return config["engine"]["model"] or RANDOM_MODEL_DIR


def model_input(wildcards=None):
    """The model directory as a rule input, when this workflow builds it."""
    return [] if config["engine"]["model"] else [RANDOM_MODEL_DIR]


LAUNCH_CHECK = "results/launch-check.json"
MODEL_CHECK = "results/model-check.json"
# Weights vLLM draws at each replica's start: the model check proves the replicas alike before a cell runs.
DRAWN_WEIGHTS = config["engine"]["model"] is None and config["random_model"].get("weights") == "drawn"


def launch_input(wildcards=None):
    """The inputs of every job that starts replicas: the model (when this workflow builds it), for a fleet it
    launches the launch check, and for drawn weights the model check. A check run again (another config)
    re-measures nothing by its date alone: what it checks re-plans its cells through their own settings."""
    checks = [] if external.is_external(config) else [ancient(LAUNCH_CHECK)]
    return model_input() + checks + ([ancient(MODEL_CHECK)] if DRAWN_WEIGHTS else [])


def settings(step):
    """The config that ``step`` (the function the rule's script calls) declares it reads, beside its code
    (kvpool.settings.reads), as the rule's ``settings`` param: the script hands on exactly these, and a
    change to one of them re-runs the rule's jobs."""
    return lambda wildcards: kvpool_settings.step_settings(step, config, wildcards)


def cell_names(cells=None):
    """The folder names of ``cells`` (default: every cell), in matrix order: a summary rule's cells."""
    return [cell.name for cell in (CELLS if cells is None else cells)]


def recorded(path):
    """``path`` as an input, or no input ([]) with measured_only where it does not exist (older runs did
    not write it)."""
    return [] if MEASURED_ONLY and not Path(path).exists() else path


def cell_recorded(name):
    """``name`` in the cell folder, as an input function of the cell wildcards (see ``recorded``)."""
    return lambda wc: recorded(f"results/cells/{Cell.from_wildcards(wc).name}/{name}")


def cell_path(name):
    """``name`` inside the cell folder, as a pattern over the cell wildcards."""
    return f"results/cells/{CELL_PATTERN}/{name}"


def cell_files(name):
    """``name`` in every cell folder of the matrix, in matrix order."""
    return [f"results/cells/{cell.name}/{name}" for cell in CELLS]


def compared_cell_files(name):
    """``name`` in every cell folder that Table 2 compares (shared arm, tier ceiling measured)."""
    return [f"results/cells/{cell.name}/{name}" for cell in COMPARED]


def pool_freed_first(wildcards):
    """With keep_pools: false, the previous cell of the tier has measured and removed its pool.

    An ordering-only input (ancient): re-measuring that cell does not make this one stale.
    """
    before = pool_predecessor(config, Cell.from_wildcards(wildcards))
    return [ancient(last_output(before))] if before else []


def cell_log(step):
    return f"logs/{step}/{CELL_PATTERN}.log"


# The units after the reuse phase (c1) on a cell's pool, in run order: the peer replay (vLLM's client,
# kvpool.studies.peer) when peer.enabled and the cell's arm is in peer.arms, then the load levels in
# config order
def cell_chain(cell):
    """The names of the units that run on ``cell``'s pool after its reuse phase, in run order."""
    return [level.name for level in load_chain(config, cell)]


LOAD_CELLS = [cell for cell in CELLS if cell_chain(cell)]


def units_done(names):
    """(cell, unit) pairs in matrix and config order, for the cells whose chain has the unit: with
    measured_only, those that finished."""
    if MEASURED_ONLY:
        return [
            (cell, level)
            for cell in CELLS
            for level in names
            if Path(f"results/cells/{cell.name}/load~{level}/level.json").exists()
        ]
    return [(cell, level) for cell in LOAD_CELLS for level in names if level in cell_chain(cell)]


LOAD_DONE = units_done([level.name for level in levels(config)])
PEER_DONE = units_done([level.name for level in load_chain(config) if level.kind == "peer"])
# In all and the gate when a cell is replayed through vllm bench serve
PEER_TARGETS = {"csv": "results/peer.csv"} if PEER_DONE else {}


def last_output(cell):
    """The file whose job ends a cell's use of its pool: its last load level's, else its reuse's."""
    if chain := cell_chain(cell):
        return f"results/cells/{cell.name}/load~{chain[-1]}/level.json"
    return f"results/cells/{cell.name}/reuse.json"


# Routers compared (kvpool.studies.routers): per cell, one unit per router, each on a fresh pool of its own
# that it removes when it ends. A unit needs nothing of its cell's records, so a new load level or
# router builds only itself; the fleet resource keeps it from overlapping any other timed phase, and
# the space check counts one router pool beside the tier's largest cell pool.
ROUTER_NAMES = list(config["routers"]["names"])
ROUTER_UNITS = [
    (cell, router)
    for cell in cells(config)
    for router in ROUTER_NAMES
    if not MEASURED_ONLY or Path(f"results/cells/{cell.name}/router~{router}/run.json").exists()
]
ROUTER_TARGETS = {"csv": "results/routers.csv", "md": "results/routers.md"} if ROUTER_UNITS else {}


# A production trace replayed (kvpool.studies.trace_replay): per cell of the shared arm's matrix, arm in trace.arms
# and router, one unit on a fresh pool of its own, independent of every cell's records; none unless trace.arms.
TRACE_UNITS = [
    (cell, router)
    for cell, router in trace_replay.units(config)
    if not MEASURED_ONLY or Path(f"results/cells/{cell.name}/trace~{router}/run.json").exists()
]
TRACE_TARGETS = {"csv": "results/trace.csv", "md": "results/trace.md"} if TRACE_UNITS else {}


# Document length (kvpool.studies.contexts): per shared cell and length in contexts.doc_tokens, one unit on a
# fresh pool of its own, independent of the cell's records, so a new length builds only its units.
CONTEXT_UNITS = [
    (cell, tokens)
    for cell, tokens in contexts.units(config)
    if not MEASURED_ONLY or Path(f"results/cells/{cell.name}/doc~{tokens}/unit.json").exists()
]
CONTEXT_TARGETS = {"csv": "results/contexts.csv", "md": "results/contexts.md"} if CONTEXT_UNITS else {}


# Pool capacity (kvpool.studies.capacity): per shared cell whose pool is a server's memory and fraction in
# capacity.fractions, one unit on a fleet and a pool server of its own, so a new fraction builds only its unit.
CAPACITY_UNITS = [
    (cell, fraction)
    for cell, fraction in capacity.units(config)
    if not MEASURED_ONLY
    or Path(f"results/cells/{cell.name}/capacity~{capacity.unit_label(fraction)}/unit.json").exists()
]
CAPACITY_TARGETS = {"csv": "results/capacity.csv", "md": "results/capacity.md"} if CAPACITY_UNITS else {}

# What the TTFT breakdown reads: each cell's reuse phase (one request at a time) and each length unit's chains
BREAKDOWN_UNITS = [
    ({"cell": cell.name, "source": "reuse"}, f"results/cells/{cell.name}/reuse.csv") for cell in CELLS
] + [
    ({"cell": cell.name, "source": f"doc~{tokens}"}, f"results/cells/{cell.name}/doc~{tokens}/requests.csv")
    for cell, tokens in CONTEXT_UNITS
]
BREAKDOWN_CSVS = [path for _, path in BREAKDOWN_UNITS]


# the cells whose pool files were hashed (runs before the byte-level check did not hash them)
DIGESTED = [cell for cell in CELLS if recorded(f"results/cells/{cell.name}/pool-digests.csv")]


def level_after(wildcards):
    """Ordering only (ancient): a cell's levels run after its reuse phase and one after another, on
    its one pool; the last one removes the pool when pools are not kept."""
    cell = Cell.from_wildcards(wildcards)
    chain = cell_chain(cell)
    if wildcards.level not in chain:
        raise ValueError(
            f"load~{wildcards.level} is not a unit of {cell.name} (load.concurrency, load.rates, peer.enabled, peer.arms, peer.orders)"
        )
    position = chain.index(wildcards.level)
    before = "reuse.json" if position == 0 else f"load~{chain[position - 1]}/level.json"
    return ancient(f"results/cells/{cell.name}/{before}")


# Study B (kvpool.studies.studyb), resolved once, here: its pool named and checked. A config whose
# study_b cannot run was refused above when enabled; with study_b disabled, `all` leaves it out and its
# target (results/studyb.md) builds it all the same, where it can run (STUDYB_MISSING says why not).
STUDYB, STUDYB_MISSING = None, ""
if external.is_external(config):
    STUDYB_MISSING = (
        "study_b.enabled is false, and Study B cannot run on an external fleet (fleet.mode external): "
        "each of its blocks starts a fleet of its own"
    )
else:
    try:
        STUDYB = studyb.resolved(config)
    except ValueError as cannot:
        STUDYB_MISSING = f"study_b.enabled is false, and Study B cannot run with this config: {cannot}"
# What Study B's steps are handed: the study less how many blocks run and whether all builds them, so
# neither re-runs a measured block
STUDYB_MEASURED = studyb.block_study(STUDYB) if STUDYB else None
# Its blocks in run order; with measured_only, those that finished
STUDYB_DIR = (
    f"results/studyb/backend~{STUDYB['backend']}/chunk~{STUDYB['chunk']}/tier~{STUDYB['tier']}" if STUDYB else None
)
# Its blocks' logs: the results path less results/, so a block's logs are its own config's
STUDYB_LOGS = STUDYB_DIR.removeprefix("results/") if STUDYB else None
STUDYB_WORKLOAD = "results/studyb/workload.json"
STUDYB_BLOCKS = [
    block
    for block in (studyb.blocks(STUDYB) if STUDYB else [])
    if not MEASURED_ONLY or Path(f"{STUDYB_DIR}/block~{block}/block.json").exists()
]
if STUDYB and not STUDYB_BLOCKS:
    STUDYB_MISSING = f"measured_only: no block of Study B has finished under {Path.cwd()}/{STUDYB_DIR}"
if not (CELLS or STUDYB_BLOCKS or CONTEXT_UNITS or ROUTER_UNITS or CAPACITY_UNITS or TRACE_UNITS):
    raise ValueError(
        f"measured_only: no cell of this config has finished its reuse phase under {Path.cwd()}/results/cells, "
        f"no length, router, capacity or trace unit its requests there, and no block of Study B under "
        f"{Path.cwd()}/results/studyb"
    )
# In all and the gate when enabled (and, with measured_only, when a block finished)
STUDYB_TARGETS = (
    {"md": "results/studyb.md", "validity": "results/studyb/validity.json", "crossover": "results/crossover.md"}
    if config["study_b"]["enabled"] and STUDYB_BLOCKS
    else {}
)
# The report's Study B section reads these, when all builds Study B
STUDYB_REPORT = (
    {
        "validity": STUDYB_TARGETS["validity"],
        "locality": "results/locality.csv",
        "sessions": "results/studyb/sessions_summary.csv",
        "figures": "results/studyb/figures",
        "windows": "results/studyb/windows.csv",
        "crossover": "results/crossover.csv",
        "crossover_figures": "results/crossover",
    }
    if STUDYB_TARGETS
    else {}
)


def studyb_known(wildcards):
    """Ordering only (ancient), and read: the blocks before this one, their requests and reference rows."""
    earlier = STUDYB_BLOCKS[: STUDYB_BLOCKS.index(wildcards.block)] if wildcards.block in STUDYB_BLOCKS else []
    return [
        ancient(f"{STUDYB_DIR}/block~{block}/{name}") for block in earlier for name in ("requests.csv", "reference.csv")
    ]


def studyb_after(wildcards):
    """Ordering only (ancient): Study B's blocks run one after another, in the order OFF, ON, ON, OFF."""
    if wildcards.block not in STUDYB_BLOCKS:
        raise ValueError(f"block~{wildcards.block} is not one of Study B's blocks {STUDYB_BLOCKS}")
    position = STUDYB_BLOCKS.index(wildcards.block)
    return [ancient(f"{STUDYB_DIR}/block~{STUDYB_BLOCKS[position - 1]}/block.json")] if position else []


def final_outputs():
    """What `snakemake all` builds: Study A's tables, report and gate where the matrix has cells; the
    capacity table (its units need no cell of their own, so a run of them alone has its table and gate);
    Study B's page, verdict and crossover. With measured_only, a working directory that holds only Study
    B's blocks (a Study B run) builds Study B's page and verdict alone."""
    study_a = [
        "results/table1.csv",
        "results/table1.md",
        TIER_COMPARE,
        "results/report.html",
        "results/validity.csv",
        "results/kv_bytes.csv",
        "results/load.csv",
        PEER_TARGETS.get("csv", []),
        ROUTER_TARGETS.get("md", []),
        CONTEXT_TARGETS.get("md", []),
        "results/breakdown.csv",
        "results/gate.ok",
    ]
    return [
        study_a if CELLS else [],
        CAPACITY_TARGETS.get("md", []),
        TRACE_TARGETS.get("md", []),
        "results/gate.ok" if (CAPACITY_UNITS or TRACE_UNITS) and not CELLS else [],
        STUDYB_TARGETS.get("md", []),
        STUDYB_TARGETS.get("validity", []),
        STUDYB_TARGETS.get("crossover", []),
    ]

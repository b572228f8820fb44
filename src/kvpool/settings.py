"""What each step of the pipeline reads of the config: the declaration (``reads``) a rule hands its script
exactly, and the sections every timed phase reads. Studies, report and the workflow import it; it imports
nothing above the engine."""

from __future__ import annotations

from kvpool.engine import external
from kvpool.engine.backends import configured, pool_backend

# What the timed phases read: the engine's timeouts and host, the workload, where pools live, the MP and Redis
# servers' timeouts, the preflight policy, sampling, the drop and whether a pool is kept. A rule hands its script
# only the sections it declares, so a phase reading another one fails with a KeyError. A backend added since
# (vllm-fs) has its section handed to its own cells' steps alone (``step_settings``), so the steps of cells
# measured before keep their settings, and Snakemake re-runs none of them.
PHASE_SETTINGS = (
    "engine",
    "workload",
    "tiers",
    "replicas",
    "lmcache_mp",
    "lmcache_redis",
    "preflight_on_failure",
    "telemetry_hz",
    "drop_caches",
    "keep_pools",
)
# A memory pool's cell runs populate, drop and reuse in one job: the drop's self-test reads fault_injection.
MEMORY_POOL_CELL_SETTINGS = (*PHASE_SETTINGS, "fault_injection")


def reads(*sections: str, picked=None):
    """Declare, on a step (the function a rule's script calls), the config it reads: whole top-level
    ``sections``, and what ``picked(config, wildcards)`` returns (sections that only some of the rule's
    jobs read, or a part of one). Its rule hands the step exactly these (``step_settings``, the rule's
    ``settings`` param), so a step reading anything else fails with a KeyError, and a change to any of
    them re-runs the rule's jobs, and only theirs."""
    def declare(step):
        step.reads, step.picked = sections, picked
        return step

    return declare


# Settings that are dimensions of the matrix: each cell's (kvpool.cells) or unit's (a replay's order,
# kvpool.studies.load.Level) value is in its name, so no step is handed the list, and adding a value
# re-runs nothing measured before.
DIMENSIONS = {"lmcache_mp": ("gpu_workers", "servers"), "peer": ("orders",)}


def step_settings(step, config: dict, wildcards=None) -> dict:
    """The config that ``step`` declares it reads (``reads``, and what ``picked`` gives), for one job
    (``wildcards``), less the matrix's dimensions."""
    values = {key: config[key] for key in step.reads}
    if step.picked is not None:
        values.update(step.picked(config, wildcards))
    label = getattr(wildcards, "backend", None)
    if label is not None and set(PHASE_SETTINGS) <= set(step.reads):  # a cell's timed step: its backend's sections
        values.update(pool_sections(config, [pool_backend(label)], besides=PHASE_SETTINGS))
    for section, keys in DIMENSIONS.items():
        if isinstance(values.get(section), dict):
            values[section] = {k: v for k, v in values[section].items() if k not in keys}
    return values


def pool_sections(config: dict, pools, besides=()) -> dict:
    """The config sections of the backends ``pools`` declare (``PoolBackend.sections``), but those in ``besides``."""
    return {section: config[section] for pool in pools for section in pool.sections if section not in besides}


def backend_sections(config: dict, wildcards=None) -> dict:
    """The sections of the configured backends that the timed phases do not read already (vllm-fs's)."""
    return pool_sections(config, configured(config), besides=PHASE_SETTINGS)


def external_fleet(config: dict, wildcards=None) -> dict:
    """``fleet``, for a step that reads it only when the fleet is external (a launched fleet's cells are not
    re-planned or re-judged for it)."""
    return {"fleet": config["fleet"]} if external.is_external(config) else {}

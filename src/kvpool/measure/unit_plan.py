"""A unit's plan and its own pool: the fleet plan on free (or configured) ports, the ports checked again
before the fleet starts, and the pool folder made fresh for the unit and removed after it."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from kvpool.cells import Cell
from kvpool.engine import external
from kvpool.engine.plan import external_plan, fleet_plan, plan_pool_dirs, reference_plan, server_port_count
from kvpool.engine.plan_types import Plan
from kvpool.engine.ports import free_ports, resolve_ports, resolve_server_ports


def _ports(config: dict, count: int) -> tuple[list[int], str]:
    ports = config["engine"]["ports"]
    if ports == "auto":
        return free_ports(config["engine"]["host"], count), "auto"
    return list(ports[:count]), "config"


def new_plan(config: dict, cell: Cell, model: str, cell_dir: Path, pool_root: Path | None = None,
             dev_mode: bool = False, load_failure_policy: str | None = None) -> dict:
    """``cell``'s fleet plan on free (or configured) ports; an lmcache-mp cell's servers get a ZMQ and an
    HTTP port each, clear of the replicas' (one server shared, one per replica isolated, none off).
    An external fleet's plan is its endpoints. ``dev_mode``: the replicas open /reset_prefix_cache;
    ``load_failure_policy``: vLLM's kv_load_failure_policy (kvpool.engine.plan.kv_transfer_config)."""
    if external.is_external(config):
        return external_plan(config, cell, model)
    ports, source = _ports(config, config["replicas"])
    server_ports = None
    if count := server_port_count(cell, config["replicas"]):
        server_ports = free_ports(config["engine"]["host"], count, exclude=ports)
    return fleet_plan(config, cell, model, Path(cell_dir).resolve(), ports, source, server_ports=server_ports,
                      pool_root=pool_root, dev_mode=dev_mode, load_failure_policy=load_failure_policy)


def checked_ports(plan: Plan, servers=None) -> dict:
    """The plan with its replicas' ports, and its servers' unless they run already (``servers``: a memory
    pool's, whose ports are theirs, not taken), checked free; taken auto ports move."""
    plan = resolve_ports(plan)
    return plan if servers else resolve_server_ports(plan)


def fresh_pool(root: Path, plan: Plan) -> None:
    """Empty ``root`` (a cell's, a Study B block's or a router unit's own pool folder) and create the
    plan's pool directories in it."""
    if root.exists():
        shutil.rmtree(root)
    for directory in set(plan_pool_dirs(plan)):
        directory.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def unit_pool(config: dict, root: Path, plan: Plan):
    """A unit's own pool (a Study B block's, a length unit's, a router unit's): emptied before its fleet
    starts and removed when the unit ends, however it ends (unless keep_pools), so a failed unit leaves
    nothing on the tier that the space check does not expect."""
    fresh_pool(root, plan)
    try:
        yield root
    finally:
        if not config["keep_pools"]:
            shutil.rmtree(root, ignore_errors=True)


def reference_replica(config: dict, model: str) -> dict:
    """The plan of one replica with no pool, on a free (or the first configured) port."""
    ports, source = _ports(config, 1)
    return checked_ports(reference_plan(config, model, ports[0], source))

"""The experiment matrix: every cell the config forms, in a stable order, and what each backend says of a cell's
pool (``kvpool.engine.backends``): whether it is a server's memory, and which cell's pool must be gone first."""

from __future__ import annotations

import itertools
from pathlib import Path

from kvpool.cells import Cell
from kvpool.engine.backends import pool_backend


def cells(config: dict) -> list[Cell]:
    """Every cell of the configured matrix: backend, chunk size, tier and arm, where the backend forms cells on
    the tier (an lmcache-redis pool is its server's memory wherever the tier points), once per server setting the
    backend forms it for (lmcache-mp's GPU workers and servers)."""
    return [
        Cell(backend, arm, chunk, tier, workers, servers)
        for backend, chunk, tier, arm in itertools.product(
            config["backends"], config["chunk_sizes"], config["tiers"], config["arms"]
        )
        if pool_backend(backend).forms_cells(config, tier)
        for workers, servers in pool_backend(backend).server_settings(config, arm, tier)
    ]


def measured(config: dict, workdir: Path) -> list[Cell]:
    """The matrix's cells whose reuse phase has finished in ``workdir``, in matrix order."""
    return [cell for cell in cells(config) if (workdir / "results" / "cells" / cell.name / "reuse.json").exists()]


def is_memory_pool(config: dict, cell: Cell) -> bool:
    """Whether ``cell``'s pool is a server's memory alone (an LMCache MP server's L1 on a memory tier, or a Redis
    server), which lives only as long as the server and puts no files on its tier."""
    return pool_backend(cell.backend).memory_pool(config, cell)


def pool_predecessor(config: dict, cell: Cell) -> Cell | None:
    """The cell whose pool must be gone before ``cell`` populates, or None.

    With ``keep_pools: false`` a tier is sized for one cell's pool of files at a time, so the cells
    of a tier that write files run one after another in matrix order: each waits for the previous
    one's reuse phase, which removes its pool. A memory pool writes none (its server's RAM goes with
    the server), so it neither waits nor is waited for. With pools kept, cells are independent.
    """
    if config["keep_pools"] or is_memory_pool(config, cell):
        return None
    same_tier = [other for other in cells(config) if other.tier == cell.tier and not is_memory_pool(config, other)]
    position = same_tier.index(cell)
    return same_tier[position - 1] if position else None

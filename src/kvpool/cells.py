"""The experiment matrix: one cell per (backend, arm, chunk size, tier), and where each keeps its pool.

An lmcache-mp cell has one more dimension, the server's GPU worker threads (``lmcache_mp.gpu_workers``).
It is written into the backend's folder name (``backend~lmcache-mp+gpu_workers=2``) only when set, so the
cells of LMCache's own default keep their folder, and adding a value builds only the cells that have it.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

CELL_PATTERN = "backend~{backend}/arm~{arm}/chunk~{chunk}/tier~{tier}"
MP_BACKEND = "lmcache-mp"
REDIS_BACKEND = "lmcache-redis"
BACKENDS = ("lmcache-fs", "lmcache-local-disk", MP_BACKEND, REDIS_BACKEND)
# An lmcache-mp cell's backend folder with its server setting: lmcache-mp, or lmcache-mp+gpu_workers=N.
GPU_WORKERS = "+gpu_workers="
# The backend wildcard: any backend, lmcache-mp with or without its setting.
BACKEND_LABEL = "|".join([*(re.escape(backend) for backend in BACKENDS if backend != MP_BACKEND),
                          rf"{re.escape(MP_BACKEND)}(?:{re.escape(GPU_WORKERS)}[1-9][0-9]*)?"])


def backend_of(label: str) -> str:
    """The backend of a backend folder's name, without its server setting."""
    return label.partition(GPU_WORKERS)[0]


@dataclass(frozen=True)
class Cell:
    backend: str
    arm: str
    chunk: int
    tier: str
    # lmcache-mp only: the server's GPU worker threads (`lmcache server --max-gpu-workers`), which run
    # its stores and retrieves, each connected engine's on one thread; None leaves LMCache's default.
    gpu_workers: int | None = None

    @property
    def label(self) -> str:
        """The backend with its server setting, as the cell's folder and the tables' backend column name it."""
        return self.backend if self.gpu_workers is None else f"{self.backend}{GPU_WORKERS}{self.gpu_workers}"

    @property
    def name(self) -> str:
        return CELL_PATTERN.format(backend=self.label, arm=self.arm, chunk=self.chunk, tier=self.tier)

    @classmethod
    def from_label(cls, label: str, arm: str, chunk: int, tier: str) -> Cell:
        """The cell whose backend folder is ``label`` (``lmcache-mp+gpu_workers=2``, say)."""
        if not re.fullmatch(BACKEND_LABEL, label):
            raise ValueError(f"{label!r} is not a backend kvpool knows ({', '.join(BACKENDS)}; lmcache-mp may "
                             f"carry {GPU_WORKERS}N)")
        workers = label.partition(GPU_WORKERS)[2]
        return cls(backend_of(label), arm, int(chunk), tier, int(workers) if workers else None)

    @classmethod
    def from_wildcards(cls, wildcards) -> Cell:
        return cls.from_label(wildcards.backend, wildcards.arm, int(wildcards.chunk), wildcards.tier)

    @classmethod
    def from_name(cls, name: str) -> Cell:
        """The cell of a folder name, ``backend~B/arm~A/chunk~C/tier~T``."""
        fields = dict(part.split("~", 1) for part in name.split("/"))
        return cls.from_label(fields["backend"], fields["arm"], int(fields["chunk"]), fields["tier"])


def cells(config: dict) -> list[Cell]:
    """Every cell of the configured matrix, in a stable order. An lmcache-redis pool is its server's
    memory wherever the tier points, so that backend forms cells only on ``lmcache_redis.tiers``; an
    lmcache-mp cell is formed once per value of ``lmcache_mp.gpu_workers``."""
    return [
        Cell(backend, arm, chunk, tier, workers)
        for backend, chunk, tier, arm in itertools.product(
            config["backends"], config["chunk_sizes"], config["tiers"], config["arms"]
        )
        if backend != REDIS_BACKEND or tier in config["lmcache_redis"]["tiers"]
        for workers in (config["lmcache_mp"]["gpu_workers"] if backend == MP_BACKEND else [None])
    ]


def measured(config: dict, workdir: Path) -> list[Cell]:
    """The matrix's cells whose reuse phase has finished in ``workdir``, in matrix order."""
    return [cell for cell in cells(config) if (workdir / "results" / "cells" / cell.name / "reuse.json").exists()]


def is_memory_pool(config: dict, cell: Cell) -> bool:
    """Whether ``cell``'s pool is a server's memory alone (an LMCache MP server's L1 on a memory tier,
    or a Redis server), which lives only as long as the server and puts no files on its tier."""
    if cell.backend == REDIS_BACKEND:
        return True
    return cell.backend == MP_BACKEND and cell.tier in config["lmcache_mp"]["memory_tiers"]


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


def tier_root(config: dict, tier: str, workdir: Path | None = None) -> Path:
    """The directory holding ``tier``'s pools; relative paths are under the working directory."""
    path = Path(config["tiers"][tier])
    return path if path.is_absolute() else (workdir or Path.cwd()) / path


def run_pools(config: dict, tier: str, workdir: Path | None = None) -> Path:
    """The folder of this working directory's pools in ``tier``.

    Named after the working directory (its name and a hash of its absolute path), so runs from two
    working directories that share a tier path (the default /dev/shm/kvpool, say) never touch each
    other's pools.
    """
    workdir = (workdir or Path.cwd()).resolve()
    digest = hashlib.sha256(str(workdir).encode()).hexdigest()[:8]
    return tier_root(config, tier, workdir) / "kvpool-pools" / f"{workdir.name}-{digest}"


def pool_root(config: dict, cell: Cell, workdir: Path | None = None) -> Path:
    """This cell's own folder inside its tier; nothing outside it is ever deleted."""
    return run_pools(config, cell.tier, workdir) / cell.name


def pool_dirs(config: dict, cell: Cell, workdir: Path | None = None, root: Path | None = None) -> list[Path]:
    """Pool directory per replica: one shared by all, or one each in the isolated arm (under ``root``,
    by default the cell's own folder)."""
    root = root or pool_root(config, cell, workdir)
    if cell.arm == "shared":
        return [root / "shared"] * config["replicas"]
    return [root / f"replica-{i}" for i in range(config["replicas"])]

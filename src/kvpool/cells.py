"""The experiment matrix: one cell per (backend, arm, chunk size, tier), and where each keeps its pool.

An lmcache-mp cell has two more dimensions: the server's GPU worker threads (``lmcache_mp.gpu_workers``),
and, for a shared pool on a drive tier, one server for the fleet or one per replica over the one shared L2
folder (``lmcache_mp.servers``). Each is written into the backend's folder name only when it is not
LMCache's default (``backend~lmcache-mp+gpu_workers=2``, ``backend~lmcache-mp+servers=per-replica``), so
the cells of the defaults keep their folder, and adding a value builds only the cells that have it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class Arm(StrEnum):
    """A cell's arm: its replicas on one shared pool, each on a pool of its own, or no KV connector at all
    (vLLM's own prefix cache only: Study B's OFF blocks, kvpool.engine.plan)."""
    SHARED = "shared"
    ISOLATED = "isolated"
    OFF = "off"


class Backend(StrEnum):
    """The KV pools kvpool measures (the config's ``backends``)."""
    FS = "lmcache-fs"
    LOCAL_DISK = "lmcache-local-disk"
    MP = "lmcache-mp"
    REDIS = "lmcache-redis"
    VLLM_FS = "vllm-fs"


CELL_PATTERN = "backend~{backend}/arm~{arm}/chunk~{chunk}/tier~{tier}"
BACKENDS = tuple(Backend)
# An lmcache-mp cell's backend folder with its server settings: lmcache-mp, lmcache-mp+gpu_workers=N,
# lmcache-mp+servers=per-replica, or both in that order.
GPU_WORKERS = "+gpu_workers="
SERVERS = "+servers="
ONE_SERVER, SERVER_PER_REPLICA = "one", "per-replica"
# The backend wildcard: any backend, lmcache-mp with or without its settings.
# (Only lmcache-mp's server has settings a cell is formed for: kvpool.engine.backends.lmcache_mp.)
SETTINGS_SUFFIX = rf"(?:{re.escape(GPU_WORKERS)}[1-9][0-9]*)?(?:{re.escape(SERVERS + SERVER_PER_REPLICA)})?"
BACKEND_LABEL = "|".join(re.escape(label) + (SETTINGS_SUFFIX if label is Backend.MP else "") for label in Backend)


def backend_of(label: str) -> str:
    """The backend of a backend folder's name, without its server settings."""
    return label.partition("+")[0]


@dataclass(frozen=True)
class Cell:
    backend: str
    arm: str
    chunk: int
    tier: str
    # lmcache-mp only: the server's GPU worker threads (`lmcache server --max-gpu-workers`), which run
    # its stores and retrieves, each connected engine's on one thread; None leaves LMCache's default.
    gpu_workers: int | None = None
    # lmcache-mp only: one server for the shared pool, or one per replica over its one L2 folder (a drive
    # tier's; a RAM L1 is one server's and cannot be shared by several).
    servers: str = ONE_SERVER

    def __post_init__(self):
        # The fields stay plain str, not the enums': plans and configs holding them are written with
        # yaml.safe_dump, which cannot represent a StrEnum. An unknown arm or backend is refused here.
        for field, kind in (("backend", Backend), ("arm", Arm)):
            value = getattr(self, field)
            if value not in set(kind):
                raise ValueError(f"{value!r} is not a{'n' if field == 'arm' else ''} {field} kvpool knows "
                                 f"({', '.join(kind)})")
            object.__setattr__(self, field, str(kind(value).value))

    def keys(self, arm: bool = True) -> dict:
        """The columns that name the cell in every table: its folder, backend (with its server settings),
        arm (unless ``arm`` is False), chunk size and tier."""
        keys = {"cell": self.name, "backend": self.label, "arm": self.arm, "chunk": self.chunk, "tier": self.tier}
        if not arm:
            del keys["arm"]
        return keys

    @property
    def label(self) -> str:
        """The backend with its server settings, as the cell's folder and the tables' backend column name it."""
        label = self.backend if self.gpu_workers is None else f"{self.backend}{GPU_WORKERS}{self.gpu_workers}"
        return label if self.servers == ONE_SERVER else f"{label}{SERVERS}{self.servers}"

    @property
    def server_per_replica(self) -> bool:
        """Whether each replica has a pool server of its own: the isolated arm's, or a shared pool's with
        ``servers: per-replica``."""
        return self.arm == Arm.ISOLATED or self.servers == SERVER_PER_REPLICA

    @property
    def name(self) -> str:
        return CELL_PATTERN.format(backend=self.label, arm=self.arm, chunk=self.chunk, tier=self.tier)

    @classmethod
    def from_label(cls, label: str, arm: str, chunk: int, tier: str) -> Cell:
        """The cell whose backend folder is ``label`` (``lmcache-mp+gpu_workers=2``, say)."""
        if not re.fullmatch(BACKEND_LABEL, label):
            raise ValueError(f"{label!r} is not a backend kvpool knows ({', '.join(BACKENDS)}; lmcache-mp may "
                             f"carry {GPU_WORKERS}N and {SERVERS}{SERVER_PER_REPLICA})")
        rest, _, servers = label.partition(SERVERS)
        workers = rest.partition(GPU_WORKERS)[2]
        return cls(backend_of(label), arm, int(chunk), tier, int(workers) if workers else None,
                   servers or ONE_SERVER)

    @classmethod
    def from_wildcards(cls, wildcards) -> Cell:
        return cls.from_label(wildcards.backend, wildcards.arm, int(wildcards.chunk), wildcards.tier)

    @classmethod
    def from_name(cls, name: str) -> Cell:
        """The cell of a folder name, ``backend~B/arm~A/chunk~C/tier~T``."""
        fields = dict(part.split("~", 1) for part in name.split("/"))
        return cls.from_label(fields["backend"], fields["arm"], int(fields["chunk"]), fields["tier"])


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
    if cell.arm == Arm.SHARED:
        return [root / Arm.SHARED.value] * config["replicas"]
    return [root / f"replica-{i}" for i in range(config["replicas"])]

"""What a pool backend declares, once, for every part of kvpool that treats pools differently.

A backend is a module of this package holding one ``PoolBackend``: how its replicas are launched (their
connector, its settings and environment), which pool servers it starts, what the shared and isolated arms
mean for it, how its pool is emptied and sized, how a hit is proven from its counters, which of kvpool's
checks apply to it and why the others do not, and what it refuses. Nothing outside this package asks which
backend a cell has: it asks the cell's backend (``kvpool.engine.backends.pool_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpool.cells import ONE_SERVER, Arm, Cell
from kvpool.engine.plan_types import ReplicaPlan, ServerPlan

# kvpool's checks a backend may leave out, each with its reason (``PoolBackend.not_applicable``). A pool in a
# server's memory (``memory_pool``) has no files to drop, hash or read back unchanged: those checks say so
# themselves.
BYTE_DIGESTS = "byte_digests"  # each chunk's bytes compared across the arms' pools (kv_bytes.csv)


@dataclass(frozen=True)
class ReplicaLaunch:
    """How one replica of a cell reaches its pool: vLLM's ``--kv-transfer-config``, an LMCache config file
    (``lmcache_config``, written to ``lmcache_config_file``), the pool server it uses, the environment the
    backend adds, and vLLM's ``--shutdown-timeout`` where the backend needs one. The off arm's has no connector
    (``kv_transfer`` None)."""
    kv_transfer: dict | None
    lmcache_config_file: str | None = None
    lmcache_config: dict | None = None
    server: int | None = None
    env: dict = field(default_factory=dict)
    shutdown_timeout_s: int | None = None


SERVER, FOLDER = "server", "folder"  # the kinds of Capacity


@dataclass(frozen=True)
class Capacity:
    """How a capacity unit limits the backend's pool: ``kind`` is ``"server"`` (the server's memory, set at
    its start or capped after populate) or ``"folder"`` (a filesystem of the capacity's size); ``refuses`` is
    what refuses stores once the pool is full by design, where nothing is evicted; ``capped_after_populate``:
    the limit is set once the whole working set is in (a Redis server's maxmemory), not at the start;
    ``held_in``: where the limited pool lives, as a refusal names it."""
    kind: str
    held_in: str
    refuses: str | None = None
    capped_after_populate: bool = False


class PoolBackend:
    """One pool backend. Subclasses set the class attributes and override what differs; the defaults are an
    in-process pool of files: no servers, a folder per pool, every check applies."""

    name: str
    # one line for the docs' backend table
    summary: str
    # what each arm is for this backend: one pool for every replica, or one each
    arms: dict[str, str]
    # how the pool is emptied between units, and how a hit is proven per follow-up
    emptied: str
    hit_proof: str
    # the pool servers it starts: their kind in the plan ("lmcache", "redis") and the ports each takes
    server_kind: str | None = None
    ports_per_server: int = 0
    # whether replicas can find each other's KV in it (a shared arm that can hit at all)
    shares: bool = True
    # whether its stores reach the pool's files only after the answer (no signal): the preflight waits for the
    # probe's chunks, and records how many were there at the answer
    stores_after_answer: bool = False
    # whether the replica's connector keeps what a reload brought up in a tier of its own (vLLM's offloading CPU
    # tier), which the reset before a document's later follow-up must empty too (/reset_prefix_cache's
    # reset_external), or that follow-up would not read the pool
    connector_tier: bool = False
    # whether Study B's fault injection can corrupt a stored chunk the replicas then read (a file per chunk)
    corruptible: bool = False
    # the LMCache setting that names the pool's folder (kvpool.engine.pool_url), where one does
    folder_key: str | None = None
    # the config sections its plans read beyond the common ones
    sections: tuple[str, ...] = ()
    # how a capacity unit limits it; None where it cannot be limited, with ``capacity_refusal`` saying why
    capacity: Capacity | None = None
    capacity_refusal: str = ""
    # a caveat the report prints for its cells (None: nothing beyond the common ones)
    caveat: str | None = None
    # why it cannot serve a hybrid model (linear-attention layers), where it cannot (None: it is measured)
    hybrid_refusal: str | None = None

    # -- the matrix -------------------------------------------------------------------------------------
    def forms_cells(self, config: dict, tier: str) -> bool:
        """Whether the backend forms cells on ``tier``."""
        return True

    def server_settings(self, config: dict, arm: str, tier: str) -> list[tuple[int | None, str]]:
        """The (GPU workers, servers) settings a cell of ``arm`` on ``tier`` is formed once for."""
        return [(None, ONE_SERVER)]

    def memory_pool(self, config: dict, cell: Cell) -> bool:
        """Whether the pool is a server's memory alone: it lives as long as the server and writes no files."""
        return False

    def one_fleet(self, config: dict, cell: Cell) -> bool:
        """Whether populate, drop and reuse run on one fleet (Study A's cell), or the reuse needs a fresh one."""
        return True

    # -- launching --------------------------------------------------------------------------------------
    def servers(self, config: dict, cell: Cell, dirs: list[Path], ports: list[int], host: str,
                base_env: dict) -> list[ServerPlan]:
        """The cell's pool servers (one for the shared arm, one per replica otherwise), on ``ports``."""
        return []

    def replica_launch(self, config: dict, cell: Cell, index: int, pool_dir: Path, server: ServerPlan | None,
                       cell_dir: Path, load_failure_policy: str | None) -> ReplicaLaunch:
        raise NotImplementedError

    def repointed(self, replica: ReplicaPlan, server: ServerPlan) -> ReplicaPlan:
        """``replica`` reaching ``server`` after the server moved to another port."""
        return replica

    # -- refusals ---------------------------------------------------------------------------------------
    def problems(self, config: dict) -> list[str]:
        """Why ``config`` cannot run this backend (it is in ``backends``), each naming the key; empty when it can."""
        return []

    def followup_problem(self, config: dict, cell: Cell) -> str | None:
        """Why several follow-ups per document could not each be a cold reload from ``cell``'s pool."""
        return None

    # -- measuring --------------------------------------------------------------------------------------
    def not_applicable(self, config: dict, cell: Cell) -> dict[str, str]:
        """kvpool's checks (``POOL_FILES``, ``BYTE_DIGESTS``, ...) that do not apply to ``cell``, each with why."""
        return {}

    def populate_settle(self, config: dict, cell: Cell) -> dict:
        """How long populate's end waits for the pool's stores, as ``settled_stores``'s settings."""
        return {}

    def pool_measure(self) -> str | None:
        """For a memory pool: the server metric its size after populate is read from."""
        return None

    def capacity_config(self, config: dict, cell: Cell, limit: int) -> dict:
        """The config a capacity unit's plan is made from, its pool limited to ``limit`` KV bytes."""
        return config

    def eviction_policy(self, config: dict) -> str:
        """The limited pool's eviction policy, as a capacity unit records it."""
        raise ValueError(f"{self.name} cannot be limited: {self.capacity_refusal}")


def arm_meanings(shared: str, isolated: str) -> dict[str, str]:
    return {Arm.SHARED.value: shared, Arm.ISOLATED.value: isolated}

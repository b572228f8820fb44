"""``lmcache-local-disk``: LMCache's local disk backend, Study A's literal setting. Its index of what is stored
lives in each replica's memory and its lookup never reads the folder, so replicas do not find each other's
chunks even in one folder: its shared arm is the study's configuration, measured as it behaves."""

from __future__ import annotations

from pathlib import Path

from kvpool.cells import Backend, Cell
from kvpool.engine import pool_url
from kvpool.engine.backends import lmcache_inprocess
from kvpool.engine.backends.base import PoolBackend, ReplicaLaunch, arm_meanings


class LMCacheLocalDisk(PoolBackend):
    name = Backend.LOCAL_DISK.value
    hybrid_refusal = lmcache_inprocess.HYBRID_REFUSAL
    summary = "LMCache's local_disk backend (Study A's setting): files in a folder, indexed per replica"
    arms = arm_meanings("every replica's local_disk names one folder (each still indexes only its own stores)",
                        "each replica's names a folder of its own")
    emptied = "the pool folder is removed; each replica's index goes with its restart"
    hit_proof = lmcache_inprocess.HIT_PROOF
    folder_key = pool_url.LOCAL_DISK
    shares = False
    capacity_refusal = "its index lives in each replica, so a cross-replica follow-up never reads the pool"

    def replica_launch(self, config: dict, cell: Cell, index: int, pool_dir: Path, server, cell_dir: Path,
                       load_failure_policy: str | None) -> ReplicaLaunch:
        # local_disk evicts past its size cap: room for the whole workload and then some
        budget_gb = max(1.0, 4 * config["min_pool_bytes"] / 1e9)
        pool = {**lmcache_inprocess.folder_pool(self.folder_key, cell, pool_dir), "max_local_disk_size": budget_gb}
        return lmcache_inprocess.launch(config, cell, index, cell_dir, pool, load_failure_policy)


    def followup_problem(self, config: dict, cell: Cell) -> str:
        return ("lmcache-local-disk keeps the serving replica's own stores in its index, so a document's second "
                "follow-up would find what its first stored")


BACKEND = LMCacheLocalDisk()

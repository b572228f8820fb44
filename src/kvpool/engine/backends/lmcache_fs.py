"""``lmcache-fs``: LMCache's in-process connector with an ``fs://`` remote pool, one file per chunk in the pool's
folder. Its lookup checks the folder on every request, so a chunk any replica wrote is found by every other;
writes are a temporary file and a rename. Nothing is evicted: a full filesystem fails further stores."""

from __future__ import annotations

from pathlib import Path

from kvpool.cells import Backend, Cell
from kvpool.engine import pool_url
from kvpool.engine.backends import lmcache_inprocess
from kvpool.engine.backends.base import FOLDER, Capacity, PoolBackend, ReplicaLaunch, arm_meanings

FILE_POLICY = "none: a full filesystem fails new stores"


class LMCacheFS(PoolBackend):
    name = Backend.FS.value
    hybrid_refusal = lmcache_inprocess.HYBRID_REFUSAL
    summary = "LMCache in each replica, an fs:// remote pool: one file per chunk in the pool folder"
    arms = arm_meanings("every replica's remote_url names one folder", "each replica's names a folder of its own")
    emptied = "the pool folder is removed (the replicas' own caches by a restart or /reset_prefix_cache)"
    hit_proof = lmcache_inprocess.HIT_PROOF
    folder_key = pool_url.REMOTE_URL
    corruptible = True
    capacity = Capacity(FOLDER, "a sized folder on its tier", refuses="the pool's filesystem, sized to the capacity")

    def replica_launch(self, config: dict, cell: Cell, index: int, pool_dir: Path, server, cell_dir: Path,
                       load_failure_policy: str | None) -> ReplicaLaunch:
        pool = {**lmcache_inprocess.folder_pool(self.folder_key, cell, pool_dir), "remote_serde": "naive"}
        return lmcache_inprocess.launch(config, cell, index, cell_dir, pool, load_failure_policy)


    def eviction_policy(self, config: dict) -> str:
        return FILE_POLICY


BACKEND = LMCacheFS()

"""``lmcache-redis``: LMCache's in-process connector with a ``redis://`` remote pool, against Redis servers kvpool
starts per cell (``kvpool.engine.redis_pool``). The pool is the server's memory wherever a tier points, so the
backend forms cells on ``lmcache_redis.tiers`` alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvpool.cells import Backend, Cell
from kvpool.engine import redis_pool
from kvpool.engine.backends import lmcache_inprocess
from kvpool.engine.backends.base import SERVER, Capacity, PoolBackend, ReplicaLaunch, arm_meanings
from kvpool.engine.plan_types import ReplicaPlan, ServerPlan


class LMCacheRedis(PoolBackend):
    name = Backend.REDIS.value
    hybrid_refusal = lmcache_inprocess.HYBRID_REFUSAL
    summary = "LMCache in each replica, a redis:// remote pool on Redis servers kvpool starts per cell"
    arms = arm_meanings("one Redis server for every replica", "one Redis server per replica")
    emptied = "the servers stop; nothing is persisted (no RDB snapshot, no AOF)"
    hit_proof = lmcache_inprocess.HIT_PROOF + ", with the servers' KV bytes and keys over each phase"
    server_kind = "redis"
    ports_per_server = 1
    sections = ("lmcache_redis",)
    capacity = Capacity(SERVER, "the Redis server's memory", capped_after_populate=True)

    def forms_cells(self, config: dict, tier: str) -> bool:
        return tier in config["lmcache_redis"]["tiers"]

    def memory_pool(self, config: dict, cell: Cell) -> bool:
        return True

    def servers(self, config: dict, cell: Cell, dirs: list[Path], ports: list[int], host: str,
                base_env: dict) -> list[ServerPlan]:
        return [ServerPlan(index=index, kind=self.server_kind, host=host, port=port, http_port=None,
                           workdir=str(dirs[index]), env=dict(base_env),
                           argv=redis_pool.server_argv(config, host, port, dirs[index]))
                for index, port in enumerate(ports)]

    def replica_launch(self, config: dict, cell: Cell, index: int, pool_dir: Path, server: ServerPlan | None,
                       cell_dir: Path, load_failure_policy: str | None) -> ReplicaLaunch:
        pool = {"remote_url": redis_pool.url(server.host, server.port), "remote_serde": "naive"}
        return lmcache_inprocess.launch(config, cell, index, cell_dir, pool, load_failure_policy, server.index)

    def repointed(self, replica: ReplicaPlan, server: ServerPlan) -> ReplicaPlan:
        return dataclasses.replace(replica, lmcache_config={
            **replica.lmcache_config, "remote_url": redis_pool.url(server.host, server.port)})

    def problems(self, config: dict) -> list[str]:
        return redis_pool.problems(config)

    def pool_measure(self) -> str:
        return redis_pool.POOL_BYTES

    def eviction_policy(self, config: dict) -> str:
        return config["capacity"]["policy"]


BACKEND = LMCacheRedis()

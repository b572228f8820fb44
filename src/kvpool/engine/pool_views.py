"""A pool as a capacity unit reads and limits it, one view per backend (``VIEWS``): what the pool holds now,
the most it held in any read, what it evicted, and whether it holds a document whole.

- ``RedisPool``: a Redis server (``lmcache-redis``), read over a connection of its own and capped after
  populate by ``maxmemory`` (``redis_maxmemory``);
- ``MPPool``: an LMCache MP server's L1 (``lmcache-mp``), read from its Prometheus counters; its limit is its
  L1 size, set at its start (``mp.l1_size_gib_for``);
- ``FilePool``: a pool of files (``lmcache-fs``) on a filesystem of the capacity's size
  (``kvpool.engine.sized_pool``, ``sized_pool_folder``), read from its folder; nothing is evicted.

``pool_of`` opens the view a unit's fleet needs. The two servers' views keep no record per document
(``ServerPool``): a follow-up's silent miss is judged by their evictions instead.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from kvpool.cells import Backend
from kvpool.engine import mp, pool_files, redis_pool, sized_pool
from kvpool.engine.backends import lmcache_fs
from kvpool.engine.plan import plan_pool_dirs
from kvpool.engine.plan_types import Plan


class PoolView:
    """What a capacity unit reads of its pool, whatever its backend: what it holds now (``state``: its KV
    bytes and evicted keys, with what else the backend tells), the most KV any read saw (``peak_kv_bytes``),
    its evictions so far (``evicted``; ``settled``: once its stores and evictions stop), its limit as set
    (``limit``), and whether it holds a document whole (``stored`` records what a document's populate left,
    ``holds`` answers; None where the backend keeps no record per document)."""

    backend: str
    peak_kv_bytes: int

    def state(self) -> dict:
        raise NotImplementedError

    def evicted(self) -> int:
        raise NotImplementedError

    def settled(self) -> int:
        raise NotImplementedError

    def limit(self, empty: dict, limit: int, policy: str) -> dict:
        raise NotImplementedError

    def stored(self, doc_id: int) -> None:
        raise NotImplementedError

    def holds(self, doc_id: int) -> bool | None:
        raise NotImplementedError


def redis_maxmemory(empty_overhead: int, limit: int) -> int:
    """A Redis server's ``maxmemory`` for ``limit`` KV bytes: its own overhead while empty (its structures
    and idle clients: ``used_memory_overhead``) plus the limit. Redis evicts once its memory passes
    maxmemory, and its dataset holds every KV value and more (each chunk's metadata key, the allocator's
    size classes), so the KV it holds never exceeds ``limit``; clients' buffers filled by large writes
    count against maxmemory too, so at times it holds less."""
    return empty_overhead + limit


@contextlib.contextmanager
def sized_pool_folder(plan: Plan, limit: int):
    """A pool of files' shared folder sized to ``limit`` bytes for the unit (``sized_pool``), as the folder
    and its mount; a server's pool has its limit of its own, and this yields None. The one place a unit
    decides between the two: ``pool_of`` follows it."""
    if plan.servers:
        yield None
        return
    (folder,) = set(plan_pool_dirs(plan))  # the shared arm's one folder
    with sized_pool.sized_folder(folder, limit) as mounted:
        yield Path(folder), mounted


@contextlib.contextmanager
def pool_of(servers, sized: tuple[Path, dict] | None = None, doc_chunks: int = 0):
    """The capacity unit's view of its pool: ``FilePool`` on a ``sized`` folder (``sized_pool_folder``'s),
    else ``MPPool`` or ``RedisPool`` (on a connection of its own) on its server."""
    if sized is not None:
        yield FilePool(*sized, doc_chunks)
        return
    (server,) = servers  # the shared arm's one server
    if server.entry.kind == "lmcache":
        yield MPPool(server)
        return
    with server.connection() as conn:
        yield RedisPool(conn)


class ServerPool(PoolView):
    """A pool server's view keeps no record per document: a follow-up's silent miss is judged by its
    evictions (``account``)."""

    def stored(self, doc_id: int) -> None:
        return None

    def holds(self, doc_id: int) -> None:
        return None


class RedisPool(ServerPool):
    """A Redis server as a capacity unit reads and limits it: its KV held and keys evicted, capped after
    populate by ``maxmemory``."""

    backend = Backend.REDIS

    def __init__(self, conn):
        self.conn, self.peak_kv_bytes = conn, 0  # the most KV a read saw

    def state(self) -> dict:
        held, memory = redis_pool.pool_metrics(self.conn), self.conn.info("memory")
        found = {"kv_bytes": int(held[redis_pool.POOL_BYTES]), "chunks": int(held[redis_pool.POOL_CHUNKS]),
                 "keys": int(self.conn.dbsize()), "used_memory": int(held[redis_pool.USED_MEMORY]),
                 "dataset_memory": int(memory["used_memory_dataset"]),
                 "overhead_memory": int(memory["used_memory_overhead"]),
                 "evicted_keys": self.evicted()}
        self.peak_kv_bytes = max(self.peak_kv_bytes, found["kv_bytes"])
        return found

    def evicted(self) -> int:
        return int(self.conn.info("stats")["evicted_keys"])

    def limit(self, empty: dict, limit: int, policy: str) -> dict:
        """Cap the populated server: Redis evicts down to ``maxmemory`` at once."""
        maxmemory = redis_maxmemory(empty["overhead_memory"], limit)
        self.conn.config_set("maxmemory-policy", policy)
        self.conn.config_set("maxmemory", maxmemory)
        self.peak_kv_bytes = 0  # populate's whole pool was before the limit
        return {"maxmemory": maxmemory, "policy": policy}

    def settled(self, poll_s: float = 0.1, timeout_s: float = 10.0) -> int:
        """The server's evicted keys once its keys and evictions stop changing (LMCache may store a
        request's chunks after its answer): two reads ``poll_s`` apart that agree, or the last one at
        ``timeout_s``."""
        def now():
            return int(self.conn.dbsize()), self.evicted()

        last, deadline = now(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            current = now()
            if current == last:
                break
            last = current
        return last[1]


class MPPool(ServerPool):
    """An LMCache MP server's L1 as a capacity unit reads it, from the server's Prometheus counters: the
    KV held (L1 bytes in use) and the chunks evicted. Its limit is its L1 size, set at its start."""

    backend = Backend.MP

    HELD, EVICTED, WRITTEN = mp.L1_BYTES, "lmcache_mp_l1_evicted_chunks_total", "lmcache_mp_l1_write_chunks_total"
    TICKS = "lmcache_mp_l1_eviction_loop_ticks_total"

    def __init__(self, server):
        self.server, self.peak_kv_bytes, self._settled = server, 0, None

    def _read(self) -> dict[str, float]:
        metrics = self.server.metrics()
        self.peak_kv_bytes = max(self.peak_kv_bytes, int(metrics.get(self.HELD, 0)))
        return metrics

    @classmethod
    def evicted_in(cls, metrics: dict[str, float]) -> int:
        """The chunks evicted, from one read of the server's counters. LMCache's evicted-chunks counter is lazy
        (it carries a ``cache_salt`` attribute, so it is exported only once a chunk was evicted): a server
        whose counters were read without it has evicted nothing."""
        return int(metrics.get(cls.EVICTED, 0))

    def state(self) -> dict:
        metrics = self._read()
        return {"kv_bytes": int(metrics.get(self.HELD, 0)), "evicted_keys": self.evicted_in(metrics),
                "written_chunks": int(metrics.get(self.WRITTEN, 0)),
                "usage_ratio": metrics.get("lmcache_mp_l1_usage_ratio")}

    def evicted(self) -> int:
        return self.evicted_in(self._read())

    def limit(self, empty: dict, limit: int, policy: str) -> dict:
        """Nothing to set: the L1 was the limit from the server's start (its plan's ``l1_size_gib``)."""
        return {"l1_size_bytes": int(self.server.entry.l1_size_gib * 2**30), "policy": policy}

    def settled(self, poll_s: float = 0.2, timeout_s: float = 15.0) -> int:
        """The chunks the server evicted once its writes and evictions stop: unchanged over two ticks of its
        eviction loop (1 s each; the loop decides from L1's usage, which no write has changed since), or
        at ``timeout_s``. Unchanged since the last settled read, it is returned at once."""
        def now(metrics):
            return int(metrics.get(self.WRITTEN, 0)), self.evicted_in(metrics)

        def ticks(metrics):  # a server without the loop's counter: two seconds stand for its two ticks
            return metrics.get(self.TICKS, time.monotonic() - started)

        started = time.monotonic()
        metrics = self._read()
        last, since = now(metrics), ticks(metrics)
        if last == self._settled:
            return last[1]
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            metrics = self._read()
            if now(metrics) != last:
                last, since = now(metrics), ticks(metrics)
            elif ticks(metrics) >= since + 2:
                break
        self._settled = last
        return last[1]


class FilePool(PoolView):
    """A pool of files on a filesystem of the capacity's size (``sized_pool``), read from its folder: the KV
    held (the chunk files' bytes; LMCache writes a temp file and renames it once whole), and which chunk
    files each document's populate left. Nothing is evicted: a store that finds it full fails."""

    backend = Backend.FS
    SUFFIX, TEMP = ".data", pool_files.TEMP_SUFFIX
    refuses = lmcache_fs.BACKEND.capacity.refuses  # what refuses its stores by design

    def __init__(self, folder: Path, mounted: dict, doc_chunks: int):
        self.folder, self.mounted, self.doc_chunks = Path(folder), mounted, doc_chunks
        self.peak_kv_bytes, self.files_of, self._seen = 0, {}, set()

    def _files(self) -> dict[str, int]:
        found = {}
        for entry in os.scandir(self.folder):
            with contextlib.suppress(FileNotFoundError):  # a temp file renamed or removed as it is read
                found[entry.name] = entry.stat().st_size
        return found

    def _chunks(self, files: dict[str, int] | None = None) -> dict[str, int]:
        """The whole chunk files of one listing of the folder (``files``, else a new one), and the peak."""
        listed = self._files() if files is None else files
        chunks = {name: size for name, size in listed.items() if name.endswith(self.SUFFIX)}
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(chunks.values()))
        return chunks

    def state(self) -> dict:
        files = self._files()
        chunks = self._chunks(files)
        return {"kv_bytes": sum(chunks.values()), "chunks": len(chunks), "evicted_keys": 0,
                "temp_files": sum(name.endswith(self.TEMP) for name in files),
                "free_bytes": sized_pool.free_bytes(self.folder)}

    def evicted(self) -> int:
        return 0

    def limit(self, empty: dict, limit: int, policy: str) -> dict:
        """Nothing to set: the filesystem was the limit from the unit's start."""
        return {"filesystem": self.mounted, "policy": policy}

    def settled(self, poll_s: float = 0.2, timeout_s: float = 15.0) -> int:
        """Once the folder stops changing (LMCache stores a request's chunks after its answer): two listings
        ``poll_s`` apart that agree with no temp file in them, or the last at ``timeout_s``. Returns the
        evictions, none."""
        last, deadline = self._files(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            current = self._files()
            if current == last and not any(name.endswith(self.TEMP) for name in current):
                break
            last = current
        return 0

    def stored(self, doc_id: int) -> None:
        """Record the chunk files ``doc_id``'s populate request left, once its stores have landed."""
        self.settled()
        new = set(self._chunks()) - self._seen
        self.files_of[doc_id], self._seen = new, self._seen | new

    def holds(self, doc_id: int) -> bool:
        """Whether the pool holds the document whole: its populate left a chunk file for every whole chunk of
        it, and each is still there."""
        mine = self.files_of.get(doc_id, set())
        return len(mine) >= self.doc_chunks and mine <= set(self._chunks())


# The backends a capacity unit can limit, and the view of each.
VIEWS: dict[str, type[PoolView]] = {view.backend: view for view in (RedisPool, MPPool, FilePool)}

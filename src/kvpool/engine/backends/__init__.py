"""The pool backends kvpool measures, one module each (``base.PoolBackend`` says what each declares), and the
one lookup the rest of kvpool asks: ``pool_backend(cell.backend)``. Adding a backend is a module here, a value of
``kvpool.cells.Backend`` and a row of docs/method.md's backend table."""

from __future__ import annotations

from kvpool.cells import Backend, backend_of
from kvpool.engine.backends import lmcache_fs, lmcache_local_disk, lmcache_mp, lmcache_redis, vllm_fs
from kvpool.engine.backends.base import PoolBackend

REGISTRY: dict[str, PoolBackend] = {module.BACKEND.name: module.BACKEND for module in (
    lmcache_fs, lmcache_local_disk, lmcache_mp, lmcache_redis, vllm_fs)}
if set(REGISTRY) != {member.value for member in Backend}:
    raise ImportError(f"kvpool.cells.Backend and the backend modules disagree: {sorted(REGISTRY)}")


def pool_backend(name: str) -> PoolBackend:
    """The backend of a backend name or folder label (``lmcache-mp+gpu_workers=2``, say)."""
    return REGISTRY[backend_of(name)]


def serving(server_kind: str) -> PoolBackend:
    """The backend whose pool servers are of ``server_kind`` (a plan's ``ServerPlan.kind``)."""
    return next(pool for pool in REGISTRY.values() if pool.server_kind == server_kind)


def configured(config: dict) -> list[PoolBackend]:
    """The configured backends, in the config's order."""
    return [pool_backend(name) for name in config["backends"]]

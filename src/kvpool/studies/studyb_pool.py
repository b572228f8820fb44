"""What an ON block of Study B stores in its pool, and whether an MP server's memory L1 holds it (kvpool.studies.studyb
runs the blocks; kvpool.config asks for the refusal before any runs)."""

from __future__ import annotations

import math

from kvpool.cells import Backend
from kvpool.engine import mp
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.studies.studyb import resolved, session_length


def pool_chunks(study: dict, config: dict) -> int:
    """The chunks an ON block's pool holds at its end (each block starts with an empty pool): a warm-up's one, each
    chain's document with its question, each session's last turn with its answer, as whole chunks. On
    docs/results/h100-shape-b: 68, the MP server's chunk writes in each ON block."""
    chunk, answer = study["chunk"], config["workload"]["output_tokens"]
    chains = study["chains"] * sum((context + study["question_tokens"]) // chunk for context in study["contexts"])
    sessions = len(study["placements"]) * study["sessions"] * (session_length(study, study["turns"], answer) // chunk)
    windows = len(study["placements"]) * sum(study["windows"]) \
        * (session_length(study, study["window_turns"], answer) // chunk)
    return study["warmups"] + chains + sessions + windows


def problems(config: dict) -> list[str]:
    """Why the ON blocks' pool cannot hold what a block stores: an MP server's memory L1 that would evict (LMCache
    evicts silently and the connector recomputes, LMCache #5290), at the bytes the pool holds a token (a hybrid's
    every layer). Empty when it fits or the pool is not an MP server's memory."""
    study = resolved(config)
    settings = config["lmcache_mp"]
    if study["backend"] != Backend.MP or study["tier"] not in settings["memory_tiers"]:
        return []
    per_token = engine_pool_bytes_per_token(config)
    if per_token is None:
        return []
    chunks = pool_chunks(study, config)
    needed = chunks * study["chunk"] * per_token
    try:
        have = mp.l1_size_gib(config, study["tier"]) * 2**30 * settings["l1_fill"]
    except ValueError:
        return []  # lmcache-mp's own problems name the unsized L1
    if needed <= have:
        return []
    return [f"study_b: an ON block's pool holds {chunks} chunks of {study['chunk']} tokens, {needed / 2**30:.2f} GiB "
            f"at {per_token} bytes a token, and lmcache_mp.l1_size_gib {settings['l1_size_gib']} holds "
            f"{have / 2**30:.2f} GiB at l1_fill {settings['l1_fill']}; set lmcache_mp.l1_size_gib to at least "
            f"{math.ceil(needed / settings['l1_fill'] / 2**30)}, or lower study_b.contexts, sessions or windows (an "
            "evicted chunk is recomputed, not reported: LMCache #5290)"]

"""Seeded documents of exactly ``doc_tokens`` tokens, each with one follow-up that extends it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from kvpool.engine.model import vocabulary


def make_workload(token_ids: list[int], documents: int, doc_tokens: int, followup_tokens: int, seed: int,
                  followups_per_document: int = 1) -> list[dict]:
    """Documents and follow-ups as token-id lists drawn from ``token_ids``; the same seed gives the same prompts.

    A follow-up is its whole document plus ``followup_tokens`` new tokens, so only the document can
    come from a cache. The first token of each document is unique to it, so no two documents share a
    cacheable prefix. With ``followups_per_document`` > 1 each item also lists its follow-ups
    (``followups``, the first being ``followup``): the later ones draw their new tokens from a stream of
    their own, so the documents and first follow-ups stay those of one follow-up per document.
    """
    if documents > len(token_ids):
        raise ValueError(f"{documents} documents need {documents} distinct first tokens; "
                         f"the vocabulary has {len(token_ids)}")
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_ids)
    firsts = rng.choice(pool, size=documents, replace=False)
    workload = []
    for doc_id in range(documents):
        body = rng.choice(pool, size=doc_tokens - 1).tolist()
        document = [int(firsts[doc_id])] + body
        followup = document + rng.choice(pool, size=followup_tokens).tolist()
        workload.append({"doc_id": doc_id, "document": document, "followup": followup})
    for item in workload if followups_per_document > 1 else []:
        more = [np.random.default_rng([seed, item["doc_id"], number]).choice(pool, size=followup_tokens).tolist()
                for number in range(1, followups_per_document)]
        item["followups"] = [item["followup"], *(item["document"] + tokens for tokens in more)]
    return workload


def write_workload(path: Path, workload: list[dict]) -> None:
    with open(path, "w") as f:
        for item in workload:
            f.write(json.dumps(item) + "\n")


def read_workload(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def probe_prompts(token_ids: list[int], chunk: int, seed: int) -> tuple[list[int], list[int]]:
    """A two-chunk probe prompt and its extension, drawn from a random stream of their own."""
    rng = np.random.default_rng([seed, 0x70726F6265])  # "probe"
    probe = rng.choice(np.asarray(token_ids), size=2 * chunk + 1).tolist()
    return probe, probe + rng.choice(np.asarray(token_ids), size=8).tolist()


log = logging.getLogger(__name__)


def make_prompts(model: str, workload_cfg: dict, out: str) -> None:
    items = make_workload(vocabulary(model), workload_cfg["documents"], workload_cfg["doc_tokens"],
                                  workload_cfg["followup_tokens"], workload_cfg["seed"],
                                  workload_cfg["followups_per_document"])
    write_workload(Path(out), items)
    log.info("wrote %d documents of %d tokens", len(items), workload_cfg["doc_tokens"])

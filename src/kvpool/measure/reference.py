"""The split-matched reference: each measured request's greedy answer against a replica with no pool that
computed the same prompt in the same split.

A request's *split* is how many of its prompt tokens came from a cache, its own prefix cache or the pool
(``usage.prompt_tokens_details.cached_tokens``); vLLM computed the rest. Different splits run different
kernels, and with bf16 a near-tied greedy token can flip between them, so a recompute proves the pool's KV
only when it was computed in the measured request's split. The reference replica (no KV connector, prefix
caching on) reproduces a split ``s`` by caching exactly the prompt's first ``s`` tokens (one request of
those token ids) and then sending the whole prompt, both under a cache salt of their own: vLLM reuses the
cached blocks and computes the rest. Its own ``cached_tokens`` proves the split it achieved.

vLLM caches whole blocks only. A split that does not end on a block boundary (a pool hit of a whole
prompt less its last token, say) is reproduced to the block below it: the comparison is then at the
nearest split a prefix cache can give, and says so (``nearest``). A request whose split no reference row
reaches is counted as not verified, never as passed.

Study A's reference is computed before the cells, from the splits the workload's arithmetic predicts
(:func:`predicted_requests`: cold, the document's whole chunks per chunk size, the document itself, the
whole prompt again); each unit's gate then checks every measured split against it. Units with prompts of
their own (Study B's blocks, the length units) compute the splits they measured after their fleet stops
(:func:`missing`, then :func:`compute`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvpool.engine.client import complete
from kvpool.measure.checks import check, not_verified

COLUMNS = ["key", "doc_id", "followup", "path", "requested_split", "achieved_split", "prompt_tokens",
           "output_text", "error"]
# Where a Study A reference row's prompt split came from.
COLD, AFTER_DOCUMENT, POOL_CHUNKS, REPEAT = "cold", "after_document", "pool_chunks", "repeat"
# The recompute paths kept as information beside the split-matched verdict.
INFORMATION_PATHS = (COLD, AFTER_DOCUMENT)


def payload_sha256(prompt: list[int]) -> str:
    """A prompt's identity across blocks and units: the SHA-256 of its token ids as JSON."""
    return hashlib.sha256(json.dumps(prompt, separators=(",", ":")).encode()).hexdigest()


def followup_key(doc_id, followup=0) -> str:
    """A Study A follow-up's key: its document and its number among the document's follow-ups."""
    followup = 0 if followup is None or pd.isna(followup) else int(followup)
    return f"doc{int(doc_id)}/followup{followup}"


@dataclass(frozen=True)
class Request:
    """One reference computation: ``prompt`` with its first ``split`` tokens cached first (0: cold)."""

    key: str
    prompt: tuple[int, ...]
    split: int
    path: str
    doc_id: int | None = None
    followup: int | None = None

    @property
    def salt(self) -> str:
        """The request's cache salt: one per prompt and split (vLLM takes up to 128 characters, no "/" or
        "@"); a repeat reuses the cold computation's blocks, the same prompt twice under one salt."""
        split = 0 if self.path == REPEAT else self.split
        return "kvpool-ref-" + hashlib.sha256(f"{self.key}|{split}".encode()).hexdigest()[:32]


def predicted_requests(workload: list[dict], chunk_sizes: list[int]) -> list[Request]:
    """Study A's reference: per follow-up, cold (split 0, an isolated arm's recompute), the document's
    whole chunks per chunk size (a shared-pool hit), the document (a hit in the serving replica's own
    cache, as a router's) and the whole prompt again (a repeated request)."""
    requests = []
    for item in workload:
        document = len(item["document"])
        for number, prompt in enumerate(followups(item)):
            key = followup_key(item["doc_id"], number)
            meta = {"doc_id": item["doc_id"], "followup": number}
            requests.append(Request(key, tuple(prompt), 0, COLD, **meta))
            requests.append(Request(key, tuple(prompt), len(prompt) - 1, REPEAT, **meta))
            requests.append(Request(key, tuple(prompt), document, AFTER_DOCUMENT, **meta))
            for chunk in sorted({document // c * c for c in chunk_sizes} - {0, document}):
                requests.append(Request(key, tuple(prompt), chunk, POOL_CHUNKS, **meta))
    return requests


def followups(item: dict) -> list[list[int]]:
    """A Study A workload item's follow-ups in order (one, or ``workload.followups_per_document``)."""
    return item.get("followups") or [item["followup"]]


async def compute(session, url: str, requests: list[Request], output_tokens: int, timeout_s: float,
                  progress=None) -> list[dict]:
    """Each request on the reference replica at ``url``, one at a time: the prefix of its split first,
    then the whole prompt, both under its own cache salt. Rows in :data:`COLUMNS`."""
    rows = []
    for request in requests:
        prefix_error = ""
        if request.split > 0 and request.path != REPEAT:
            prefix = await complete(session, url, list(request.prompt[:request.split]), 1, timeout_s,
                                    cache_salt=request.salt)
            prefix_error = prefix.error
        if request.path == REPEAT:  # the cold computation, under the same salt, left the prompt's blocks
            await complete(session, url, list(request.prompt), 1, timeout_s, cache_salt=request.salt)
        result = await complete(session, url, list(request.prompt), output_tokens, timeout_s,
                                cache_salt=request.salt)
        error = result.error or (f"the prefix request failed: {prefix_error}" if prefix_error else "")
        rows.append({"key": request.key, "doc_id": request.doc_id, "followup": request.followup, "path": request.path,
                     "requested_split": request.split, "achieved_split": result.cached_tokens,
                     "prompt_tokens": result.prompt_tokens, "output_text": result.output_text, "error": error})
        if progress is not None:
            progress.update()
    return rows


def normalized(reference: pd.DataFrame | None) -> pd.DataFrame:
    """Reference rows in :data:`COLUMNS`; older files (``results/reference/outputs.csv`` before splits were
    recorded: a ``cold`` and an ``after_document`` row per document, with the reference's own
    ``cached_tokens``) read as rows whose achieved split is what they cached."""
    if reference is None or reference.empty:
        return pd.DataFrame(columns=COLUMNS)
    frame = reference.copy()
    if "key" not in frame:
        followup = frame["followup"] if "followup" in frame else pd.Series(0, index=frame.index)
        frame["key"] = [followup_key(d, f) for d, f in zip(frame["doc_id"], followup, strict=True)]
    if "achieved_split" not in frame:
        frame["achieved_split"] = frame["cached_tokens"]
    if "requested_split" not in frame:
        frame["requested_split"] = np.where(frame["path"] == COLD, 0, np.nan)
    for column in COLUMNS:
        if column not in frame:
            frame[column] = np.nan
    for column in ("error", "output_text"):  # text, though a column read back with no value at all is float
        frame[column] = frame[column].astype(object).fillna("")
    return frame[COLUMNS]


def measured_splits(rows: pd.DataFrame) -> pd.Series:
    """Each measured request's split: the prompt tokens it took from a cache (``cached_tokens``)."""
    return pd.to_numeric(rows["cached_tokens"], errors="coerce")


def _match(reference: pd.DataFrame, key: str, split) -> tuple[str, pd.DataFrame]:
    """The reference rows a measured request of ``key`` and ``split`` is compared with: ``exact`` (the
    reference achieved that split), ``nearest`` (it was asked for that split and vLLM's whole blocks
    gave it less) or ``unmatched``."""
    rows = reference[(reference["key"] == key) & (reference["error"] == "")]
    if pd.isna(split):
        return "unmatched", rows.iloc[0:0]
    exact = rows[rows["achieved_split"] == split]
    if len(exact):
        return "exact", exact
    nearest = rows[rows["requested_split"] == split]
    if len(nearest):
        return "nearest", nearest
    return "unmatched", rows.iloc[0:0]


def comparisons(measured: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Per measured request (``key``, ``cached_tokens``, ``output_text``, ``error``): how it was matched,
    the reference's split and answer, and whether the answers are equal. Failed requests are left out
    (every gate counts them as errors)."""
    reference = normalized(reference)
    ok = measured[measured["error"].fillna("") == ""]
    rows = []
    for key, split, output in zip(ok["key"], measured_splits(ok), ok["output_text"].fillna(""), strict=True):
        how, found = _match(reference, key, split)
        answers = set(found["output_text"])
        row = {"key": key, "measured_split": split, "match": how, "output_text": output,
               "reference_split": float(found["achieved_split"].iloc[0]) if len(found) else np.nan,
               "reference_output": next(iter(answers)) if len(answers) == 1 else None}
        if how != "unmatched" and len(answers) > 1:  # the reference disagrees with itself at this split
            row["match"] = "reference_inconsistent"
        row["equal"] = row["reference_output"] is not None and row["reference_output"] == output
        rows.append(row)
    return pd.DataFrame(rows, columns=["key", "measured_split", "match", "reference_split", "output_text",
                                       "reference_output", "equal"])


def output_check(measured: pd.DataFrame, reference: pd.DataFrame | None, what: str = "follow-up") -> dict:
    """The gate's output check: every measured answer equal to a pool-less recompute of the same prompt in
    the same split (``exact``) or the nearest split vLLM's whole blocks can give (``nearest``). It fails
    on any unequal answer, and is not verified when no request could be compared, or with no reference
    at all (a run re-read with ``measured_only`` that never made one)."""
    table = comparisons(measured, reference)
    compared = table[table["match"].isin(["exact", "nearest"])]
    counts = {"compared": len(compared), "equal": int(compared["equal"].sum()),
              "exact": int((table["match"] == "exact").sum()), "nearest": int((table["match"] == "nearest").sum()),
              "unmatched": int((table["match"] == "unmatched").sum()),
              "reference_inconsistent": int((table["match"] == "reference_inconsistent").sum())}
    threshold = f"every {what}'s answer equal to a pool-less recompute in its split"
    examples = [f"{row.key}: measured split {row.measured_split:.0f}, reference split {row.reference_split:.0f} "
                f"({row.match}): {row.output_text!r} against {row.reference_output!r}"
                for row in compared[~compared["equal"]].head(3).itertuples()]
    unmatched = sorted({int(s) for s in table.loc[table["match"] == "unmatched", "measured_split"].dropna()})[:5]
    extra = {"examples": examples, "splits_without_reference": unmatched}
    if not len(compared):
        reason = (f"no {what} could be compared: this working directory has no recompute reference "
                  "(results/reference/outputs.csv)" if reference is None else
                  f"no {what} could be compared: no reference row has its prompt in its split "
                  f"(splits {unmatched})" if len(table) else f"no {what} was answered")
        return {**not_verified(reason, counts), **extra}
    return {**check(counts["equal"] == counts["compared"], counts, threshold), **extra}


def agreement(measured: pd.DataFrame, reference: pd.DataFrame | None) -> dict:
    """How many answered requests equal each information path's recompute (``cold``, the whole prompt
    from nothing; ``after_document``, on the document cached first): counts, never the verdict."""
    reference = normalized(reference)
    ok = measured[measured["error"].fillna("") == ""]
    found = {}
    for path in INFORMATION_PATHS:
        answers = reference[(reference["path"] == path) & (reference["error"] == "")].drop_duplicates("key")
        expected = answers.set_index("key")["output_text"]
        if len(expected):
            equal = sum(expected.get(key) == output for key, output in zip(ok["key"], ok["output_text"], strict=True))
            found[path] = {"equal": int(equal), "of": len(ok)}
    return found


def missing(measured: pd.DataFrame, reference: pd.DataFrame | None) -> list[tuple[str, int]]:
    """(key, split) of every answered request that no reference row matches yet, in first-seen order."""
    table = comparisons(measured, reference)
    left = table[table["match"] == "unmatched"].dropna(subset=["measured_split"])
    return list(dict.fromkeys((key, int(split)) for key, split in zip(left["key"], left["measured_split"],
                                                                        strict=True)))


def requests_for(needed: list[tuple[str, int]], prompts: dict[str, list[int]]) -> list[Request]:
    """Reference requests for ``needed`` (key, split) pairs whose prompt ``prompts`` holds, each prompt's
    in ascending split; a split of the whole prompt less its last token after a cold one of the same
    prompt reuses the cold computation's blocks (:data:`REPEAT`) instead of computing the prefix again."""
    wanted: dict[str, set[int]] = {}
    for key, split in needed:
        if key in prompts:
            wanted.setdefault(key, set()).add(split)
    requests = []
    for key, splits in wanted.items():
        prompt = tuple(prompts[key])
        for split in sorted(splits):
            path = REPEAT if split == len(prompt) - 1 and 0 in splits else "split"
            requests.append(Request(key, prompt, split, COLD if split == 0 else path))
    return requests


def twin_rows(rows: pd.DataFrame, path: str) -> pd.DataFrame:
    """Answers of requests that ran without a pool (a Study B OFF block's), as reference rows: each
    achieved its own split, which its ``cached_tokens`` proves."""
    ok = rows[rows["error"].fillna("") == ""]
    return pd.DataFrame({"key": ok["key"], "doc_id": np.nan, "followup": np.nan, "path": path,
                         "requested_split": np.nan, "achieved_split": pd.to_numeric(ok["cached_tokens"]),
                         "prompt_tokens": ok["prompt_tokens"], "output_text": ok["output_text"].fillna(""),
                         "error": ""}, columns=COLUMNS)

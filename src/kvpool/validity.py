"""The validity gate of one cell: every check with its measured value and threshold."""

from __future__ import annotations

import pandas as pd


def check(ok: bool, value, threshold) -> dict:
    """One check of a gate: whether it passed, the measured value and what it needed."""
    return {"ok": bool(ok), "value": value, "threshold": threshold}


def hit_fractions(reuse: pd.DataFrame, doc_tokens: int) -> pd.Series:
    """Share of each follow-up's document that came from the pool (external KV transfer)."""
    return reuse["external_hit_tokens"].fillna(0).astype(float) / doc_tokens


def cold_reads(drop: dict, max_resident_fraction: float) -> dict:
    """The pool was out of the page cache right before the first request (a drop record of
    pool.drop_from_page_cache); a memory-backed tier has no device read to force."""
    if drop["memory_backed"]:
        return check(True, "memory-backed tier: no device read to force", None)
    return check(drop["resident_fraction"] <= max_resident_fraction, drop["resident_fraction"],
                  max_resident_fraction)


# The reference path (phases.reference) each arm's outputs must equal.
REFERENCE_PATH = {"shared": "after_document", "isolated": "cold"}


def evaluate(cell_arm: str, config: dict, populate: pd.DataFrame, reuse: pd.DataFrame, reference: pd.DataFrame,
             drop_before_reuse: dict, pool_bytes: int, preflight: dict, chunk: int | None = None,
             write_errors: list[str] = (), pool_unchanged: dict | None = None,
             not_verified: dict[str, str] | None = None) -> dict:
    """``{"valid": bool, "checks": {name: {"ok", "value", "threshold"}}}`` for one cell of chunk size
    ``chunk`` (default: the smallest configured, whose hit bound is the loosest).

    ``pool_unchanged`` (kvbytes.unchanged: populate's files against the pool after reuse) is None for
    records of runs that did not hash the pool at populate's end; the check is then left out.
    ``not_verified`` names checks that could not be made (an external fleet's, kvpool.external) with
    why: they leave ``checks`` for a ``not_verified`` entry, and count neither way."""
    documents = config["workload"]["documents"]
    doc_tokens = config["workload"]["doc_tokens"]
    messages = pd.concat([populate["error"], reuse["error"]]).fillna("")
    errors = int((messages != "").sum())
    cross = reuse["prefill_replica"] != reuse["serve_replica"]
    fractions = hit_fractions(reuse, doc_tokens)
    checks = {
        # the first distinct errors say why (a dead replica's exit code and log tail, say)
        "zero_errors": {**check(errors == 0, errors, 0),
                        "examples": list(dict.fromkeys(messages[messages != ""]))[:3]},
        "all_documents_served": check(len(reuse) == documents and len(populate) == documents,
                                       {"populate": len(populate), "reuse": len(reuse)}, documents),
        "cross_replica": check(len(reuse) > 0 and bool(cross.all()), float(cross.mean()) if len(reuse) else 0.0, 1.0),
        "pool_bytes": check(pool_bytes >= config["min_pool_bytes"], pool_bytes, config["min_pool_bytes"]),
        # a store that failed (a full tier) leaves a pool that misses; the replicas' logs say why
        "pool_writes": {**check(not write_errors, len(write_errors), 0), "examples": list(write_errors)[:3]},
        "preflight": check(preflight["ok"], {"hit_tokens": preflight["hit_tokens"],
                                              "outputs_match": preflight.get("outputs_match")},
                            "> 0 hit tokens, outputs equal" if preflight["expect_shared"] else "0 hit tokens"),
    }
    if pool_unchanged is not None:
        # reuse must read the bytes populate stored: one flipped bit in a chunk fails the cell
        checks["pool_unchanged"] = {
            **check(pool_unchanged["changed"] == 0 and pool_unchanged["missing"] == 0,
                     {k: pool_unchanged[k] for k in ("files", "changed", "missing")}, "0 changed, 0 missing"),
            "examples": [pool_unchanged["example"]] if pool_unchanged["example"] else []}
    checks["cold_reads"] = cold_reads(drop_before_reuse, config["max_resident_fraction"])
    if cell_arm == "shared":
        worst = float(fractions.min()) if len(fractions) else 0.0
        checks["pool_hits"] = check(worst >= config["min_hit_fraction"], worst, config["min_hit_fraction"])
        # populate stored the documents' whole chunks and nothing else: a follow-up that loaded more
        # read chunks an earlier reuse left in the pool (its own new tokens), not a cold pool
        most = int(reuse["external_hit_tokens"].fillna(0).max()) if len(reuse) else 0
        chunk = chunk or min(config["chunk_sizes"])
        whole = doc_tokens // chunk * chunk
        checks["hits_within_document"] = check(most <= whole, most, whole)
    else:
        loaded = int(reuse["external_hit_tokens"].fillna(0).sum())
        checks["isolation"] = check(loaded == 0, loaded, 0)
    # Each arm against the recompute it replays: a pool hit against the document's own KV reused in
    # place, an isolated replica against a cold recompute. Equal KV bytes give equal greedy tokens;
    # KV damaged in transfer does not.
    path = REFERENCE_PATH[cell_arm]
    if reference is None:  # no recompute replica ran (an external fleet's fleet.reference: false)
        reference = pd.DataFrame(columns=["doc_id", "output_text", "path"])
    if "path" in reference:
        reference = reference[reference["path"] == path]
    expected = reference.set_index("doc_id")["output_text"]
    matches = reuse.apply(lambda row: expected.get(row["doc_id"]) == row["output_text"], axis=1)
    checks["output_matches_recompute"] = {
        **check(len(reuse) > 0 and bool(matches.all()), int(matches.sum()) if len(reuse) else 0, len(reuse)),
        "reference_path": path,
    }
    for name in not_verified or {}:
        checks.pop(name, None)
    result = {"valid": all(c["ok"] for c in checks.values()), "checks": checks}
    if not_verified:
        result["not_verified"] = dict(not_verified)
    return result


def failures(validity: dict) -> list[str]:
    """Human-readable reasons a cell is invalid."""
    return [f"{name}: value {c['value']!r}, threshold {c['threshold']!r}"
            + (f"; e.g. {c['examples'][0]}" if c.get("examples") else "")
            for name, c in validity["checks"].items() if not c["ok"]]

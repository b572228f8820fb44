"""The validity gate of one cell: every check with its status, its measured value and its threshold."""

from __future__ import annotations

import pandas as pd

from kvpool.cells import Arm
from kvpool.measure import reference as split_reference
from kvpool.measure.checks import check, failures, not_applicable, verdict  # noqa: F401 (failures: re-exported)
from kvpool.measure.checks import not_verified as unverified


def hit_fractions(reuse: pd.DataFrame, doc_tokens: int) -> pd.Series:
    """Share of each follow-up's document that came from the pool (external KV transfer)."""
    return reuse["external_hit_tokens"].fillna(0).astype(float) / doc_tokens


def cold_reads(drop: dict, max_resident_fraction: float, later: list[dict] = ()) -> dict:
    """The pool was out of the page cache right before the first request (a drop record of
    pool.drop_from_page_cache) and before each later reload (``later``); on a memory-backed tier there is
    no device read to force, so the check cannot fail there and says so."""
    if drop["memory_backed"]:
        return not_applicable(f"memory-backed tier ({drop.get('pool_in') or 'the pool is in RAM'}): "
                              "no device read to force")
    if not later:
        return check(drop["resident_fraction"] <= max_resident_fraction, drop["resident_fraction"],
                     max_resident_fraction)
    worst = max(d["resident_fraction"] for d in [drop, *later])
    return check(worst <= max_resident_fraction, worst, max_resident_fraction, drops=1 + len(later))


def own_cache_unused(rows: pd.DataFrame) -> dict | None:
    """No follow-up found anything in its serving replica's own prefix cache (its local-cache-hit
    counter delta is 0): cross-replica, and after each reset of a document's later follow-ups. None for
    records from before the counter was kept."""
    if "local_cache_hit_tokens" not in rows or rows["local_cache_hit_tokens"].isna().all():
        return None
    local = rows["local_cache_hit_tokens"].fillna(0).astype(int)
    return check(bool((local == 0).all()), int(local.sum()), 0)


def unchanged_check(unchanged: dict, drop: dict) -> dict:
    """Reuse read the bytes populate stored: one flipped bit in a stored chunk fails the cell. A pool held
    in a server's memory (an MP server's L1) has no file to hash: not applicable there."""
    if unchanged["files"] == 0 and drop.get("memory_backed"):
        return not_applicable(f"no pool file to hash: the pool is {drop.get('pool_in') or 'in memory'}; the "
                              "answers against the recompute (output_matches_recompute) check its KV instead")
    return {**check(unchanged["files"] > 0 and unchanged["changed"] == 0 and unchanged["missing"] == 0,
                    {k: unchanged[k] for k in ("files", "changed", "missing")}, "> 0 files, 0 changed, 0 missing"),
            "examples": [unchanged["example"]] if unchanged["example"] else []}


def populate_loaded_nothing(populate: pd.DataFrame) -> dict:
    """Populate prefilled every document from nothing: its replica's external-KV-transfer counter (the
    record's ``external_hit_tokens``, a /metrics delta) did not move. Every document starts with a token of
    its own and the cell's pool is emptied before populate, so a document loaded then came from a pool that
    held it before the cell began (a foreign or warm one), and reuse's hits would measure that pool."""
    if not len(populate):
        return not_applicable("populate recorded no documents (all_documents_served says why)")
    if "external_hit_tokens" not in populate or populate["external_hit_tokens"].isna().all():
        return not_applicable("populate's records hold no pool-hit counts (recorded before kvpool read the "
                              "replicas' external-KV-transfer counter)")
    loaded = populate["external_hit_tokens"].fillna(0).astype(int)
    warm = populate.assign(loaded=loaded)[loaded > 0]
    return {**check(warm.empty, int(loaded.sum()), 0),
            "examples": [f"document {row.doc_id} loaded {row.loaded} tokens from a pool during populate"
                         for row in warm.head(3).itertuples()]}


def stored_in_own_pool(own_pool: dict | None, expected_chunks: int) -> dict:
    """Populate's stores are in the cell's own pool: after populate its folder held a file per whole chunk of
    every document (a Redis pool: a key per chunk, read from the cell's own servers), or, for an LMCache MP
    server's L1, which cannot be listed, the cell's own servers counted bytes. LMCache keeping the pool
    elsewhere (a folder it read out of its URL as another) leaves the cell's folder short or empty.

    ``own_pool``: populate.json's ``pool`` (files, bytes, and the servers' ``source`` for a pool in their
    memory) with ``chunks``, the files or keys hashed from the cell's pool at populate's end."""
    if own_pool is None:
        return not_applicable("no record of the cell's pool after populate was given")
    if expected_chunks == 0:
        return not_applicable("the documents are shorter than one chunk: populate stores no whole chunk")
    chunks = own_pool.get("chunks", own_pool.get("files"))
    if chunks is None:
        return not_applicable("the cell's pool after populate was not counted (recorded before kvpool counted it)")
    if chunks == 0 and own_pool.get("source"):  # an MP server's L1: its own count of what it holds
        return check(own_pool["bytes"] > 0, own_pool["bytes"], "> 0 bytes", source=own_pool["source"])
    return check(chunks >= expected_chunks, chunks, expected_chunks)


def followup_keys(rows: pd.DataFrame) -> pd.DataFrame:
    """Study A request records with each follow-up's reference key (document and follow-up number)."""
    numbers = rows["followup"] if "followup" in rows else pd.Series(0, index=rows.index)
    return rows.assign(key=[split_reference.followup_key(d, f) for d, f in zip(rows["doc_id"], numbers,
                                                                                 strict=True)])


def outputs_check(rows: pd.DataFrame, reference: pd.DataFrame | None, what: str = "follow-up") -> dict:
    """Study A's output check of ``rows`` (kvpool.measure.reference.output_check) with the cold and
    after-document recomputes' agreement beside it, as information."""
    keyed = followup_keys(rows)
    return {**split_reference.output_check(keyed, reference, what),
            "information": split_reference.agreement(keyed, reference)}


def served_check(phases: list[dict], max_model_len: int, chunk: int) -> dict:
    """Whether every replica of every phase ran what its plan says (``phases``: each phase's replica index ->
    what it served), each mismatch named: a setting overridden somewhere kvpool does not look would
    otherwise measure another cell than its folder's name."""
    wrong = []
    for phase in phases:
        for index, served in phase.items():
            if served.get("error"):
                wrong.append(served["error"])
                continue
            if served["max_model_len"] != max_model_len:
                wrong.append(f"replica {index} serves max_model_len {served['max_model_len']}, the plan "
                             f"{max_model_len}")
            if served["chunk_sizes"] and served["chunk_sizes"] != [chunk]:
                wrong.append(f"replica {index}'s LMCache runs chunk_size {served['chunk_sizes']}, the cell {chunk}")
    return {**check(not wrong, len(wrong), 0), "examples": wrong[:3]}


def with_served(result: dict, meta: dict, max_model_len: int, chunk: int) -> dict:
    """A unit's gate (``{"valid", "checks"}``) with ``served_as_planned`` for its fleet (``meta["served"]``, what
    kvpool.measure.timed read from each replica) added and the verdict judged again. A unit recorded before
    kvpool read what replicas serve keeps its gate as it was."""
    if "served" not in meta:
        return result
    checks = {**result["checks"], "served_as_planned": served_check([meta["served"]], max_model_len, chunk)}
    return {**result, "checks": checks, "valid": verdict(checks)}


def evaluate(cell_arm: str, config: dict, populate: pd.DataFrame, reuse: pd.DataFrame, reference: pd.DataFrame,
             drop_before_reuse: dict, pool_bytes: int, preflight: dict, chunk: int | None = None,
             write_errors: list[str] = (), pool_unchanged: dict | None = None,
             not_verified: dict[str, str] | None = None, reload_drops: list[dict] = (),
             server_errors: list[str] | None = None, served: list[dict] | None = None,
             own_pool: dict | None = None) -> dict:
    """``{"valid": bool, "checks": {name: {"ok", "value", "threshold"}}}`` for one cell of chunk size
    ``chunk`` (default: the smallest configured, whose hit bound is the loosest).

    ``pool_unchanged`` (kvbytes.unchanged: populate's files against the pool after reuse) is None for
    records of runs that did not hash the pool at populate's end; the check is then left out.
    ``not_verified`` names checks that could not be made (an external fleet's, kvpool.engine.external) with
    why: each becomes a not-verified check, which counts neither way. ``server_errors`` (a cell whose pool
    is served: an LMCache MP or Redis server) are what its servers' records say went wrong (a server that
    died, a pool that could not be read back); any fails the cell, named. ``served`` (each phase's replicas'
    own word, kvpool.engine.processes.Replica.served) must match the plan: the configured model length, and the
    cell's chunk size wherever a replica's LMCache logged one. ``own_pool`` (``stored_in_own_pool``) is what
    populate left in the cell's own pool folder or servers."""
    documents = config["workload"]["documents"]
    followups = documents * config["workload"].get("followups_per_document", 1)
    doc_tokens = config["workload"]["doc_tokens"]
    chunk = chunk or min(config["chunk_sizes"])
    messages = pd.concat([populate["error"], reuse["error"]]).fillna("")
    errors = int((messages != "").sum())
    cross = reuse["prefill_replica"] != reuse["serve_replica"]
    fractions = hit_fractions(reuse, doc_tokens)
    checks = {
        # the first distinct errors say why (a dead replica's exit code and log tail, say)
        "zero_errors": {**check(errors == 0, errors, 0),
                        "examples": list(dict.fromkeys(messages[messages != ""]))[:3]},
        "all_documents_served": check(len(reuse) == followups and len(populate) == documents,
                                       {"populate": len(populate), "reuse": len(reuse)},
                                       {"populate": documents, "reuse": followups}),
        "cross_replica": check(len(reuse) > 0 and bool(cross.all()), float(cross.mean()) if len(reuse) else 0.0, 1.0),
        "pool_bytes": check(pool_bytes >= config["min_pool_bytes"], pool_bytes, config["min_pool_bytes"]),
        # made whatever the config says (min_pool_bytes may be 0): a pool LMCache kept outside the cell's
        # folder, or one an earlier run left warm, must not pass
        "populate_loaded_nothing": populate_loaded_nothing(populate),
        "populate_stored_in_own_pool": stored_in_own_pool(own_pool, documents * (doc_tokens // chunk)),
        # a store that failed (a full tier) leaves a pool that misses; the replicas' logs say why
        "pool_writes": {**check(not write_errors, len(write_errors), 0), "examples": list(write_errors)[:3]},
        "preflight": check(preflight["ok"], {"hit_tokens": preflight["hit_tokens"],
                                              "outputs_match": preflight.get("outputs_match")},
                            "> 0 hit tokens, outputs equal" if preflight["expect_shared"] else "0 hit tokens"),
    }
    if served:
        checks["served_as_planned"] = served_check(served, config["engine"]["max_model_len"], chunk)
    if server_errors is not None:
        checks["pool_servers"] = {**check(not server_errors, len(server_errors), 0),
                                   "examples": list(server_errors)[:3]}
    if pool_unchanged is not None:
        checks["pool_unchanged"] = unchanged_check(pool_unchanged, drop_before_reuse)
    checks["cold_reads"] = cold_reads(drop_before_reuse, config["max_resident_fraction"], reload_drops)
    if (unused := own_cache_unused(reuse)) is not None:
        checks["own_cache_unused"] = unused
    if cell_arm == Arm.SHARED:
        worst = float(fractions.min()) if len(fractions) else 0.0
        checks["pool_hits"] = check(worst >= config["min_hit_fraction"], worst, config["min_hit_fraction"])
        # populate stored the documents' whole chunks and nothing else: a follow-up that loaded more
        # read chunks an earlier reuse left in the pool (its own new tokens), not a cold pool
        most = int(reuse["external_hit_tokens"].fillna(0).max()) if len(reuse) else 0
        whole = doc_tokens // chunk * chunk
        checks["hits_within_document"] = check(most <= whole, most, whole)
    else:
        loaded = int(reuse["external_hit_tokens"].fillna(0).sum())
        checks["isolation"] = check(loaded == 0, loaded, 0)
    # Each follow-up against a replica with no pool that computed its prompt in the same split: the
    # document's whole chunks cached first for a pool hit, nothing for an isolated arm's recompute.
    # Equal KV in an equal split gives equal greedy tokens; KV damaged in transfer does not.
    checks["output_matches_recompute"] = outputs_check(reuse, reference)
    for name, reason in (not_verified or {}).items():
        checks[name] = unverified(reason)
    return {"valid": verdict(checks), "checks": checks}

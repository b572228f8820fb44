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

from kvpool.pool import pool_files

DIGEST_COLUMNS = ["copy", "key", "bytes", "blake2b", "stored_in"]
COMPARISONS = {
    "store_across_arms": "document chunks as the prefilling replica stored them: shared arm against isolated arm",
    "recompute_against_store": "isolated arm: the serving replica's cold recompute of a document chunk against "
                               "the prefilling replica's stored copy",
    "after_load_against_cold": "chunks the serving replica stored during a follow-up: shared arm (computed on "
                               "loaded KV) against isolated arm (computed from nothing)",
}

def read_digests(path: Path | str) -> pd.DataFrame:
    """A cell's ``pool-digests.csv``; names and digests stay text (a hex digest can look numeric)."""
    return pd.read_csv(path, dtype={"copy": str, "key": str, "blake2b": str, "stored_in": str},
                       keep_default_na=False)


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def pool_digests(dirs: list[Path], stored_before_reuse: set[str]) -> pd.DataFrame:
    """One row per file in the pool directories: which copy (directory), key, size, digest, and
    whether it was already there when reuse began. Files are hashed on several threads (hashlib
    releases the GIL), so a 26 GB pool takes seconds from RAM."""
    files = [(directory, path) for directory in dict.fromkeys(map(Path, dirs)) for path in pool_files([directory])]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda item: file_digest(item[1]), files))
    rows = [{"copy": d.name, "key": str(p.relative_to(d)), "bytes": p.stat().st_size, "blake2b": digest,
             "stored_in": "populate" if str(p) in stored_before_reuse else "reuse"}
            for (d, p), digest in zip(files, digests, strict=True)]
    return pd.DataFrame(rows, columns=DIGEST_COLUMNS)


def stored_files(dirs: list[Path]) -> set[str]:
    """The pool's file paths now (no reads): what populate stored, taken right before reuse."""
    return {str(path) for path in pool_files(dirs)}


def _agreement(left: pd.DataFrame, right: pd.DataFrame) -> dict:
    """How many keys both sides hold, and on how many every copy has one digest."""
    keys = sorted(set(left["key"]) & set(right["key"]))
    both = pd.concat([left[left["key"].isin(keys)], right[right["key"].isin(keys)]])
    distinct = both.groupby("key")["blake2b"].nunique()
    differ = sorted(distinct[distinct > 1].index)
    return {"keys": len(keys), "equal": len(keys) - len(differ), "differ": len(differ),
            "example_key": differ[0] if differ else ""}


def compare_arms(shared: pd.DataFrame, isolated: pd.DataFrame, document_whole_chunks: bool) -> pd.DataFrame:
    """The three comparisons of COMPARISONS for one (backend, chunk, tier), each with whether its
    chunks should agree bit for bit.

    Document chunks are the same computation in both arms, so they should. A follow-up chunk is
    only when the pool's prefix is the whole document (``document_whole_chunks``); otherwise the
    chunk also holds the document's tail, which the shared arm computes after the load with a
    different split of the work, and on the CPU stack that alone changes low-order bits.
    """
    shared_store = shared[shared["stored_in"] == "populate"]
    isolated_store = isolated[isolated["stored_in"] == "populate"]
    # the isolated serving replica recomputes the document too; only keys no populate stored are follow-up chunks
    isolated_reuse = isolated[isolated["stored_in"] == "reuse"]
    isolated_followup = isolated_reuse[~isolated_reuse["key"].isin(isolated_store["key"])]
    rows = {
        "store_across_arms": _agreement(shared_store, isolated_store),
        "recompute_against_store": _agreement(isolated_reuse[isolated_reuse["key"].isin(isolated_store["key"])],
                                              isolated_store),
        "after_load_against_cold": _agreement(shared[shared["stored_in"] == "reuse"], isolated_followup),
    }
    exact = {"store_across_arms": True, "recompute_against_store": True,
             "after_load_against_cold": document_whole_chunks}
    return pd.DataFrame([{"comparison": name, **row, "bit_exact_expected": exact[name], "meaning": COMPARISONS[name]}
                         for name, row in rows.items()])


NOT_APPLICABLE = "not applicable"


def kv_bytes_table(digests: dict[tuple[str, int, str, str], pd.DataFrame], doc_tokens: int,
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
        elif {"shared", "isolated"} <= arms.keys():
            frame = compare_arms(arms["shared"], arms["isolated"], doc_tokens % chunk == 0)
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
    """What one (backend, chunk, tier)'s three comparisons say together, in a sentence or two.

    Only comparisons expected to agree bit for bit take part. The document chunks are the same
    computation in the stores of both arms and in the isolated arm's recompute, so: stores that
    reproduce but differ from the recompute mean the store did not copy what was computed (a
    faulty load may hide behind that); stores and recompute that agree while the follow-up chunk
    on loaded KV differs mean the load.
    """
    rows = group.set_index("comparison")
    if NOT_APPLICABLE in rows.index:
        return f"Not applicable: {rows.loc[NOT_APPLICABLE, 'meaning']}"
    exact = rows[rows["bit_exact_expected"].astype(bool) & (rows["keys"] > 0)]
    if exact.empty:
        return "Nothing to compare bit for bit: no comparison of this setting holds chunks that must agree."
    differ = exact[exact["differ"] > 0]
    if differ.empty:
        return ("Every chunk that must agree bit for bit does (" + ", ".join(
            f"{name} {row['equal']} of {row['keys']}" for name, row in exact.iterrows()) + "): the pool's bytes show no damage.")

    def count(name: str) -> str:
        row = rows.loc[name]
        return f"{row['differ']} of {row['keys']}"

    store_ok = "store_across_arms" not in differ.index
    recompute_bad = "recompute_against_store" in differ.index
    if recompute_bad and rows.loc["store_across_arms", "differ"] * 2 < rows.loc["store_across_arms", "keys"]:
        reproduced = "reproduce across arms" if store_ok else \
            f"mostly reproduce across arms ({count('store_across_arms')} differ)"
        return (f"Store side: {count('recompute_against_store')} stored document chunks differ from the same tokens "
                f"computed again, while the stores themselves {reproduced}. The store did not copy what was "
                "computed; whether the load is faulty too cannot be told while the stored copies are damaged.")
    if recompute_bad:
        return (f"Not reproducible: the stores differ across arms ({count('store_across_arms')}) and from a "
                f"recompute ({count('recompute_against_store')}); on this stack the bytes cannot place damage.")
    if not store_ok:
        return (f"The stores are not reproducible ({count('store_across_arms')} document chunks differ across "
                "arms) though a recompute matches the stored copy.")
    return (f"Load side: the document chunks agree, yet {count('after_load_against_cold')} follow-up chunks "
            "computed on KV loaded from the pool differ from a cold computation: the KV attended over after a "
            "load was not the KV that was stored.")


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

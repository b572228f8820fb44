"""What the units run on a cell's pool after its reuse phase share (a load level, the peer replay, a
reload between two follow-ups of Study A's reuse, a Study B window): the pool put back to what populate
left and the check that it was, and the checks of their requests and answers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvpool.engine.pool_files import pool_files
from kvpool.measure import validity
from kvpool.measure.checks import check, not_verified


def restore_pool(dirs: list[Path], populate_digests: pd.DataFrame) -> dict:
    """Back to what populate left: remove every pool file populate did not store (an earlier level's
    serving replicas stored documents and follow-up chunks). What populate stored is left as it is;
    the level's gate checks it is unchanged."""
    kept = set(zip(populate_digests["copy"], populate_digests["key"], strict=True))
    removed = 0
    for directory in dict.fromkeys(map(Path, dirs)):
        for path in pool_files([directory]):
            if (directory.name, str(path.relative_to(directory))) not in kept:
                path.unlink()
                removed += 1
    return {"removed_files": removed, "kept_files": len(kept)}


def files_restored(unchanged: dict) -> dict:
    """The ``pool_restored`` check of a pool of files: populate's files unchanged (kvbytes.unchanged)."""
    return check(unchanged["changed"] == 0 and unchanged["missing"] == 0, unchanged, "populate's files unchanged")


def repopulated(cell_rows: pd.DataFrame, cell_meta: dict, rows: pd.DataFrame, meta: dict) -> dict:
    """What a memory pool's level populated (``rows``, ``meta``) against the cell's own populate:
    placement (document -> replica), errors, the preflight, and the bytes its servers held afterwards."""
    def placement(frame: pd.DataFrame) -> dict:
        return dict(zip(frame["doc_id"].astype(int), frame["prefill_replica"].astype(int), strict=True))

    return {"repopulated": True, "same_placement": placement(cell_rows) == placement(rows),
            "errors": int((rows["error"].fillna("") != "").sum()), "preflight_ok": bool(meta["preflight"]["ok"]),
            "bytes": int(meta["pool"]["bytes"]), "cell_bytes": int(cell_meta["pool"]["bytes"])}


def memory_restored(restored: dict) -> dict:
    """The ``pool_restored`` check of a memory pool populated again for its level (``repopulated``)."""
    ok = (restored["same_placement"] and restored["errors"] == 0 and restored["preflight_ok"]
          and restored["bytes"] == restored["cell_bytes"])
    return check(ok, restored, "populated again without errors, in the same placement, to the cell's pool bytes")


def request_checks(rows: pd.DataFrame) -> dict:
    """What every unit of the load chain asks of its requests: no errors, every follow-up cross-replica."""
    errors = int((rows["error"].fillna("") != "").sum())
    cross = rows["prefill_replica"] != rows["serve_replica"]
    return {"zero_errors": check(errors == 0, errors, 0),
            "cross_replica": check(bool(len(rows)) and bool(cross.all()), float(cross.mean()) if len(rows) else 0.0,
                                   1.0)}


def outputs_check(rows: pd.DataFrame, reference: pd.DataFrame | None, in_flight: int, batch_invariant: bool) -> dict:
    """A level's answers against the split-matched reference (kvpool.measure.reference). With more than one
    request in flight the batch a request shares changes the kernels' numerics, so its answer is only
    comparable under vLLM's batch-invariant kernels; without them the check is not verified, and says why."""
    if in_flight > 1 and not batch_invariant:
        answered = int((rows["error"].fillna("") == "").sum())
        return not_verified(f"{answered} answers sent up to {in_flight} at a time: the batch each shared changes "
                            "the numerics, so they are not comparable with a recompute sent alone; "
                            "engine.batch_invariant: true (vLLM's batch-invariant kernels) makes them so",
                            {"answers": answered, "in_flight": in_flight})
    return validity.outputs_check(rows, reference)

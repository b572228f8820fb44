"""Readers of what older kvpool runs recorded, so that every committed run under docs/results reads into the
same tables as it did when it was measured.

One small reader per record kind and the version that lacks a field: each returns the record (or a recorded
config's section) with the value the current code reads, as the older run meant it, and passes a record
written by the current code through unchanged. The studies call them where they read a record, and keep no
branch of their own on how old a record is.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvpool.cells import Arm


def study_b(study: dict) -> dict:
    """A config's ``study_b``: one recorded before Study B's windows has neither ``windows`` (none ran)
    nor ``window_turns`` (4, the default since)."""
    study = dict(study)
    study.setdefault("windows", [])
    study.setdefault("window_turns", 4)
    return study


def peer_replay(replay: dict, first_order: str) -> dict:
    """A config's ``peer``: one recorded before ``peer.arms`` replayed the cells of both arms, and one
    recorded before ``peer.orders`` replayed in one order, ``first_order`` (ascending)."""
    replay = dict(replay)
    replay.setdefault("arms", (Arm.SHARED, Arm.ISOLATED))
    replay.setdefault("orders", (first_order,))
    return replay


def capacity_pool(pool: dict) -> dict:
    """A capacity unit's ``pool`` record: one recorded before the unit kept the most KV any read saw while
    the limit held (``peak_kv_bytes``) has none, 0: only the reads after the cap and at the end count."""
    return pool if "peak_kv_bytes" in pool else {**pool, "peak_kv_bytes": 0}


def capacity_requests(frame: pd.DataFrame) -> pd.DataFrame:
    """A capacity unit's request records: those recorded before each request read its own GPU energy have
    no ``gpu_energy_j`` (read as empty, so the window's energy is used)."""
    return frame if "gpu_energy_j" in frame else frame.assign(gpu_energy_j=np.nan)


def evicted_before(row: dict, default: int) -> int:
    """A capacity unit's populate row's eviction count as populate began storing its document: a row
    recorded before populate read it has none, ``default`` (populate ran with no limit, so nothing was
    evicted before its end)."""
    return default if pd.isna(row.get("evicted_before", np.nan)) else int(row["evicted_before"])


def kept_apart_unverified(record: dict) -> list[str]:
    """The checks a cell's validity.json recorded before checks had statuses kept apart as not verified
    (``not_verified``, an external fleet's: name -> why); a newer record keeps them among its checks."""
    return list(record.get("not_verified", {}))

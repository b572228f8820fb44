"""The load table's rows (``results/load.csv``): every cell at every level, ``c1`` being its reuse phase,
with latency, delivered rate, hits, drive and power, and vLLM's own split of the time. kvpool.report.load
writes it and its Markdown."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvpool.cells import Cell
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.measure.telemetry import energy_mean_power, phase_power
from kvpool.stats import PERCENTILES, reported_percentile


def load_row(cell: Cell, level: str, records: pd.DataFrame, meta: dict, drive: dict, power: dict, valid: bool,
             config: dict, per_token: int | None = None) -> dict:
    """One cell at one load level: latency with bootstrap 95% intervals, what the fleet delivered
    (achieved rate, output tokens and goodput per second of the level's window), hits, drive and power;
    ``per_token`` is the model's KV bytes per token (None where it cannot be read: no KV loaded rate)."""
    ok = records[records["error"].fillna("") == ""]
    ttft, e2e = ok["ttft_s"].astype(float), ok["e2e_s"].astype(float)
    wall = meta["wall_s"]
    hit_tokens = float(ok["external_hit_tokens"].fillna(0).astype(float).sum())
    row = {**cell.keys(),
           "level": level, "level_kind": "rate" if level.startswith("r") else "concurrency",
           "level_value": float(level[1:]), "valid": bool(valid), "requests": len(records), "ttft_n": len(ttft)}
    for q in PERCENTILES:
        found = reported_percentile(ttft, q)
        row.update({f"ttft_p{q}_s": found["value"], f"ttft_p{q}_ci_low_s": found["ci_low"],
                    f"ttft_p{q}_ci_high_s": found["ci_high"], f"ttft_p{q}_basis": found["basis"]})
    outputs = (meta.get("checks") or {}).get("output_matches_recompute")
    row["outputs_checked"] = outputs.get("status", "passed" if outputs.get("ok") else "failed") if outputs \
        else "not recorded"
    row.update({
        "e2e_p50_s": float(np.percentile(e2e, 50)) if len(e2e) else np.nan,
        "achieved_rps": len(ok) / wall if wall else np.nan,
        "output_tokens_per_s": len(ok) * config["workload"]["output_tokens"] / wall if wall else np.nan,
        "goodput_rps": float((ttft <= config["slo_s"]).sum()) / wall if wall else np.nan,
        "hit_fraction": float(records["external_hit_tokens"].fillna(0).astype(float).mean()
                              / config["workload"]["doc_tokens"]) if len(records) else np.nan,
        "errors": int(len(records) - len(ok)),
        # the KV the serving replicas loaded from the pool per second of the window: the measured hit
        # tokens times the model's KV bytes per token; a memory pool's reload rate, which no drive shows
        "loaded_gb_per_s": hit_tokens * per_token / wall / 1e9 if wall and per_token else np.nan,
        "drive_read_gb_per_s": drive.get("read_gb_per_s") if drive.get("available") else np.nan,
        "queue_depth_p95": drive["aqu_sz"]["p95"] if drive.get("available") else np.nan,
        "mean_power_w": power.get("mean_power_w"),
        "energy_per_request_j": power.get("energy_per_request_j"),
    })
    return {key: (np.nan if value is None else value) for key, value in row.items()}


# vLLM's own split of a request's time (kvpool.engine.metrics.TIMINGS) as a level's load-table columns
TIME_SPLIT = {"queue_s": "queue_mean_s", "prefill_s": "prefill_mean_s", "decode_s": "decode_mean_s",
              "server_ttft_s": "server_ttft_mean_s"}


def time_split(records: pd.DataFrame, meta: dict) -> dict:
    """A level's mean seconds per request in each part of vLLM's split: from the serving replicas'
    histograms over the window (a load level's ``window_times``), or, for the reuse phase (one request
    at a time), the mean of the requests' own times. NaN where neither was recorded."""
    times, split = meta.get("window_times") or {}, {}
    for part, column in TIME_SPLIT.items():
        if part in times:
            split[column] = np.nan if times[part]["mean_s"] is None else times[part]["mean_s"]
        else:
            own = pd.to_numeric(records[part], errors="coerce").dropna() if part in records else pd.Series()
            split[column] = float(own.mean()) if len(own) else np.nan
    return split


def load_table(config: dict, cells_run: list[Cell], reuse: dict, levels: dict,
               ceilings: list[str] | None = None) -> pd.DataFrame:
    """One row per cell and level (``c1`` is the cell's reuse phase; ``reuse`` maps a cell to its
    reuse.csv, reuse.json, validity.json and telemetry summary; ``levels`` maps (cell, level) to the
    level's csv and json). Where the tiers' ``ceilings`` hold the host-to-GPU link, each level's KV
    loaded per second is also given as a share of it (``link_use``)."""
    per_token, rows, units = engine_pool_bytes_per_token(config), [], []
    for cell in cells_run:
        files = reuse[cell]
        summary_ = read_json(files["telemetry"])["reuse"]
        cell_gate = read_json(files["validity"])
        units.append((read_records(files["csv"]), {**read_json(files["meta"]), **cell_gate}))
        rows.append(load_row(cell, "c1", *units[-1], summary_["drive"], phase_power(summary_),
                             cell_gate["valid"], config, per_token))
        for (level_cell, level), paths in levels.items():
            if level_cell == cell:
                units.append((read_records(paths["csv"]), read_json(paths["meta"])))
                meta = units[-1][1]
                power = energy_mean_power(meta["summary"]["power"], meta["telemetry"].get("duration_s"))
                rows.append(load_row(cell, level, *units[-1], meta["summary"]["drive"], power,
                                     meta["valid"], config, per_token))
    if any("window_times" in meta for _, meta in units):  # vLLM's split of the time (tables recorded before: none)
        rows = [{**row, **time_split(*unit)} for row, unit in zip(rows, units, strict=True)]
    table = pd.DataFrame(rows)
    links = {path.split("/")[-2]: read_json(path).get("link") for path in ceilings or []}
    if any((link or {}).get("gb_per_s") for link in links.values()):  # the share of the GPU link the reloads used
        table["link_ceiling_gb_per_s"] = table["tier"].map(
            lambda tier: (links.get(tier) or {}).get("gb_per_s") or np.nan).astype(float)
        table["link_use"] = table["loaded_gb_per_s"] / table["link_ceiling_gb_per_s"]
    return table

"""The report: Study A's tables and figures, and what the study did not show, from measured results alone.

Everything here reads the results tree; nothing is re-measured. Invalid cells are drawn and listed,
flagged, and kept out of every aggregate.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.stats import bootstrap

from kvpool import mp
from kvpool.cells import Cell
from kvpool.files import read_frame_or_empty, read_json, read_records
from kvpool.summary import arm_metrics
from kvpool.telemetry import drive_per_tick
from kvpool.validity import failures

PERCENTILES = (50, 95, 99)


def percentile_ci(values, q: float, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Bootstrap (percentile method) confidence interval of the q-th percentile; NaN with under 2 values."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if len(values) < 2 or np.all(values == values[0]):
        return (float(values[0]), float(values[0])) if len(values) else (np.nan, np.nan)
    result = bootstrap((values,), lambda x, axis: np.percentile(x, q, axis=axis), confidence_level=confidence,
                       n_resamples=2000, method="percentile", random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


@dataclass
class Results:
    """A finished run's measurements, one frame per kind, every row tagged with its cell."""

    cells: pd.DataFrame            # one row per cell: keys, valid, reasons, wall clock, power, ...
    requests: pd.DataFrame         # every reuse follow-up
    drive: pd.DataFrame            # every drive sample (populate and reuse)
    power: pd.DataFrame            # every power / replica sample
    tiers: dict                    # tier -> ceiling record
    manifest: dict
    config: dict
    notes: list[str] = field(default_factory=list)


def _cell_keys(cell: Cell, valid: bool) -> dict:
    return {"cell": cell.name, "backend": cell.backend, "arm": cell.arm, "chunk": cell.chunk, "tier": cell.tier,
            "valid": valid}


def collect(root: Path, cells: list[Cell], config: dict) -> Results:
    """Read every cell folder (and the tier ceilings) under ``root`` (a working directory)."""
    rows, requests, drives, powers = [], [], [], []
    manifest = {}
    for cell in cells:
        folder = root / "results" / "cells" / cell.name
        validity = read_json(folder / "validity.json")
        keys = _cell_keys(cell, validity["valid"])
        records = read_records(folder / "reuse.csv")
        requests.append(records.assign(**keys))
        reuse_meta = read_json(folder / "reuse.json")
        summary = read_json(folder / "telemetry" / "summary.json")
        manifest = manifest or read_json(folder / "manifest.json")
        origin = summary["populate"]["started_at"]
        for name, frames in (("drive.csv", drives), ("power.csv", powers)):
            frame = read_frame_or_empty(folder / "telemetry" / name)
            if len(frame.columns):  # no file rows at all: the phase sampled no drive
                frames.append(frame.assign(**keys, since_start_s=frame["t_s"] - origin))
        power = summary["reuse"]["power"]
        followups = max(1, len(records))
        rows.append({
            **keys,
            "reasons": "; ".join(failures(validity)),
            "followups": len(records),
            "errors": int((records["error"].fillna("") != "").sum()),
            "wall_s": reuse_meta["wall_s"],
            "mean_power_w": power["mean_power_w"],
            "energy_per_followup_j": power["energy_per_request_j"],
            "replica_cpu_s_per_followup": sum(r["cpu_s"] for r in power["replicas"].values()) / followups,
            "read_gb_per_s": summary["reuse"]["drive"].get("read_gb_per_s"),
            "read_active_gb_per_s": summary["reuse"]["drive"].get("read_active_gb_per_s"),
            "cold_reads": _cold_read_note(reuse_meta["drop_before_reuse"]),
            "phases": {p: (summary[p]["started_at"] - origin, summary[p]["finished_at"] - origin)
                       for p in ("populate", "reuse")},
        })
    tiers = {}
    for tier in config["tiers"]:
        path = root / "results" / "tiers" / tier / "ceiling.json"
        if path.exists():
            tiers[tier] = read_json(path)
    return Results(pd.DataFrame(rows), pd.concat(requests, ignore_index=True),
                   pd.concat(drives, ignore_index=True) if drives else pd.DataFrame(),
                   pd.concat(powers, ignore_index=True) if powers else pd.DataFrame(), tiers, manifest, config)


def _cold_read_note(drop: dict) -> str:
    if drop["memory_backed"]:
        return "memory-backed tier (no device read to force)"
    return f"verified: {100 * drop['resident_fraction']:.2f}% of {drop['bytes'] / 1e6:.0f} MB resident before reuse"


def ttft_table(results: Results) -> pd.DataFrame:
    """Table 1's figures per cell (summary.arm_metrics) plus bootstrap 95% CIs on the TTFT percentiles;
    invalid cells stay, flagged."""
    rows = []
    cfg = results.config
    for _, cell in results.cells.iterrows():
        records = results.requests[results.requests["cell"] == cell["cell"]]
        metrics = arm_metrics(records, cell["wall_s"], cfg["warm_s"], cfg["slo_s"], cfg["workload"]["doc_tokens"],
                              mean_power_w=cell["mean_power_w"], energy_j=cell["energy_per_followup_j"] * len(records)
                              if pd.notna(cell["energy_per_followup_j"]) else None)
        ttft = records.loc[records["error"].fillna("") == "", "ttft_s"].to_numpy(dtype=float)
        row = {k: cell[k] for k in ("backend", "chunk", "tier", "arm", "valid")}
        for q in PERCENTILES:
            low, high = percentile_ci(ttft, q)
            row.update({f"ttft_p{q}_s": metrics[f"ttft_p{q}_s"], f"ttft_p{q}_ci_low_s": low,
                        f"ttft_p{q}_ci_high_s": high})
        row.update({"followups": metrics["followups"], "errors": metrics["errors"], "wall_s": metrics["wall_clock_s"],
                    "reload_rate": metrics["reload_rate"], "slo_attainment": metrics["slo_attainment"],
                    "mean_power_w": metrics["mean_power_w"], "energy_per_followup_j": metrics["energy_per_followup_j"],
                    "replica_cpu_s_per_followup": cell["replica_cpu_s_per_followup"]})
        rows.append(row)
    return pd.DataFrame(rows)


def headline(table: pd.DataFrame) -> pd.DataFrame:
    """Isolated over shared per (backend, chunk, tier), from valid cells only."""
    valid = table[table["valid"]]
    rows = []
    for keys, group in valid.groupby(["backend", "chunk", "tier"], sort=False):
        arms = group.set_index("arm")
        if {"shared", "isolated"} <= set(arms.index):
            rows.append({"backend": keys[0], "chunk": keys[1], "tier": keys[2],
                         **{f"{m}_ratio": arms.loc["isolated", m] / arms.loc["shared", m]
                            for m in ("ttft_p50_s", "ttft_p99_s", "wall_s")}})
    return pd.DataFrame(rows, columns=["backend", "chunk", "tier", "ttft_p50_s_ratio", "ttft_p99_s_ratio",
                                       "wall_s_ratio"])


def tier_table(results: Results) -> pd.DataFrame:
    """Table 2 per shared cell with bootstrap CIs on the drive percentiles and TTFT."""
    rows = []
    for _, cell in results.cells[results.cells["arm"] == "shared"].iterrows():
        ceiling = results.tiers.get(cell["tier"], {})
        row = {k: cell[k] for k in ("backend", "chunk", "tier", "valid")}
        drive = results.drive[(results.drive.get("cell") == cell["cell"]) & (results.drive.get("phase") == "reuse")] \
            if not results.drive.empty else pd.DataFrame()
        # The same series telemetry.summarize_drive reduces: r_await over samples with reads, queue
        # depth summed over the tier's disks per tick.
        r_await = drive.loc[drive["r_per_s"] > 0, "r_await_ms"] if not drive.empty else pd.Series(dtype=float)
        queue = drive_per_tick(drive)["aqu_sz"] if not drive.empty else pd.Series(dtype=float)
        for column, source, q in (("r_await_p50_ms", r_await, 50), ("r_await_p95_ms", r_await, 95),
                                  ("queue_depth_p95", queue, 95)):
            values = source.to_numpy(dtype=float)
            low, high = percentile_ci(values, q)
            row.update({column: np.percentile(values, q) if len(values) else np.nan,
                        f"{column}_ci_low": low, f"{column}_ci_high": high})
        ttft = results.requests.loc[results.requests["cell"] == cell["cell"], "ttft_s"].to_numpy(dtype=float)
        for q in (50, 95):
            low, high = percentile_ci(ttft, q)
            row.update({f"ttft_p{q}_s": np.percentile(ttft, q) if len(ttft) else np.nan,
                        f"ttft_p{q}_ci_low_s": low, f"ttft_p{q}_ci_high_s": high})
        row.update(read_gb_per_s=cell["read_gb_per_s"], read_active_gb_per_s=cell["read_active_gb_per_s"],
                   ceiling_gb_per_s=ceiling.get("gb_per_s"), rated_gb_per_s=ceiling.get("rated_gb_per_s"),
                   reload_efficiency=(cell["read_active_gb_per_s"] / ceiling["gb_per_s"])
                   if cell["read_active_gb_per_s"] and ceiling.get("gb_per_s") else np.nan,
                   ceiling_method=ceiling.get("method"))
        rows.append(row)
    return pd.DataFrame(rows)


def pool_server_table(root: Path, cells: list[Cell]) -> pd.DataFrame:
    """What each lmcache-mp cell's servers counted per phase (``pool_server`` in populate.json and
    reuse.json): lookups, L1 and L2 chunks, the L1 bytes held at the phase's end, L2 stores pending."""
    rows = []
    for cell in (c for c in cells if c.backend == mp.BACKEND):
        for phase in ("populate", "reuse"):
            meta = read_json(root / "results" / "cells" / cell.name / f"{phase}.json")
            for server, record in meta.get("pool_server", {}).items():
                counters = {name.removeprefix("lmcache_mp_"): value for name, value in record["metrics"].items()}
                rows.append({"cell": cell.name, "phase": phase, "server": int(server),
                             "pending_l2_stores": record["drain"]["pending_l2_stores"], **counters})
    return pd.DataFrame(rows)


def caveats(results: Results) -> list[str]:
    """What a reader must know before quoting a number, generated from this run."""
    cfg, engine = results.config, results.config["engine"]
    notes = [
        "Concurrency 1: follow-ups are sent one at a time, so these figures describe a lightly loaded fleet.",
        f"Scope: {cfg['replicas']} replicas of {engine['model'] or 'a random-weights model built locally'} "
        f"({engine['kind']}), {cfg['workload']['documents']} documents of {cfg['workload']['doc_tokens']} tokens, "
        "one machine, one router policy (round robin, never prefix aware).",
        "Hash keys: " + ("PYTHONHASHSEED=0 on every replica." if cfg["hash_keys"] == "pythonhashseed"
                         else "LMCache sha256_cbor content hash.") + " The populate preflight checked them.",
    ]
    if (results.cells["backend"] == "lmcache-mp").any():
        notes.append("lmcache-mp cells: the LMCache server keys chunks by a blake3 content hash, so hash_keys does "
                     "not apply to them; their preflight checked that replicas find each other's chunks.")
    for _, cell in results.cells.iterrows():
        notes.append(f"Cold reads, {cell['cell']}: {cell['cold_reads']}.")
    if results.cells["mean_power_w"].isna().all():
        notes.append("No GPU power source on this machine (NVML unavailable): power figures show replica CPU "
                     "seconds per follow-up instead, and energy per follow-up is not measured.")
    invalid = results.cells[~results.cells["valid"]]
    if len(invalid):
        notes.append(f"{len(invalid)} cell(s) failed the validity gate; they are drawn and listed, flagged, and "
                     "left out of every ratio.")
    return notes


def image_data_uri(path: Path) -> str:
    kind = "svg+xml" if path.suffix == ".svg" else "png"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def render_page(template: Path, out: Path, context: dict) -> None:
    """Fill the Jinja2 page template; figures are embedded, so the page opens offline on its own."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(template.parent), autoescape=select_autoescape(["html"]))
    env.filters["data_uri"] = image_data_uri
    env.filters["to_yaml"] = lambda data: yaml.safe_dump(data, sort_keys=False, width=120)
    out.write_text(env.get_template(template.name).render(**context))

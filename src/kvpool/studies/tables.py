"""Study A's tables, computed from its cells' records: the per-cell table with its bootstrap intervals and
Table 1 (isolated against shared) drawn from it, the per-tier table and Table 2 (drive tiers) drawn from
that. kvpool.report.tables writes them and their Markdown; the report and every other reader take the files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvpool.cells import SERVERS, Arm, Cell
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.measure import link
from kvpool.measure.files import read_frame_or_empty, read_json
from kvpool.measure.records import read_records
from kvpool.measure.telemetry import drive_per_tick, phase_power
from kvpool.measure.validity import failures
from kvpool.stats import ONE_WINDOW, PERCENTILES, mean_ci, proportion_ci, ratio_ci, reported_percentile

# (metric, unit, ratio meaningful): the rows of the headline table, in the study's order.
TABLE1_ROWS = [
    ("ttft_p50_s", "s", True),
    ("ttft_p95_s", "s", True),
    ("ttft_p99_s", "s", True),
    ("reload_rate", "fraction", False),
    ("slo_attainment", "fraction", False),
    ("wall_clock_s", "s", True),
    ("mean_power_w", "W", True),
    ("energy_per_followup_j", "J", True),
    ("errors", "count", False),
    ("mean_pool_hit_fraction", "fraction", False),
    ("followups", "count", False),
]
# Table 1's two arms side by side, each value in a column named after its arm.
TABLE1_ARMS = (Arm.ISOLATED, Arm.SHARED)
TABLE1_COLUMNS = ["backend", "chunk", "tier", "metric", "unit", "isolated", "shared", "ratio",
                  "isolated_valid", "shared_valid", "isolated_ci_low", "isolated_ci_high", "shared_ci_low",
                  "shared_ci_high", "isolated_n", "shared_n", "isolated_basis", "shared_basis", "ratio_ci_low",
                  "ratio_ci_high"]


def arm_metrics(reuse: pd.DataFrame, wall_s: float, warm_s: float, slo_s: float, doc_tokens: int,
                mean_power_w: float | None = None, energy_j: float | None = None) -> dict:
    """The headline numbers of one arm. Failed requests count against reload rate and SLO attainment; a
    percentile from fewer samples than :data:`MIN_SAMPLES` asks is the largest sample
    (:func:`reported_percentile`)."""
    ok = reuse[reuse["error"].fillna("") == ""]
    ttft = ok["ttft_s"].astype(float)
    n = len(reuse)
    return {
        **{f"ttft_p{q}_s": reported_percentile(ttft, q)["value"] for q in PERCENTILES},
        "reload_rate": float((ttft <= warm_s).sum() / n) if n else np.nan,
        "slo_attainment": float((ttft <= slo_s).sum() / n) if n else np.nan,
        "wall_clock_s": wall_s,
        "mean_power_w": np.nan if mean_power_w is None else mean_power_w,
        "energy_per_followup_j": np.nan if energy_j is None or not n else energy_j / n,
        "errors": int(n - len(ok)),
        "mean_pool_hit_fraction": float(reuse["external_hit_tokens"].fillna(0).mean() / doc_tokens) if n else np.nan,
        "followups": n,
    }


def cell_row(cell: Cell, records: pd.DataFrame, wall_s: float, power: dict, validity: dict, config: dict) -> dict:
    """One cell's row of the per-cell table: Table 1's figures (:func:`arm_metrics`), each with what it rests
    on: TTFT percentiles with their sample count, basis and bootstrap 95% interval over the requests that did
    not fail, proportions with their Wilson interval, the document's share loaded with a bootstrap interval
    of its mean; wall clock, power and energy are one window's."""
    metrics = arm_metrics(records, wall_s, config["warm_s"], config["slo_s"], config["workload"]["doc_tokens"],
                          mean_power_w=power["mean_power_w"], energy_j=power["gpu_energy_j"])
    ttft = records.loc[records["error"].fillna("") == "", "ttft_s"].to_numpy(dtype=float)
    n = len(records)
    row = {**cell.keys(arm=False), "arm": cell.arm,  # the arm last, as cells.csv has it
           "valid": validity["valid"], "reasons": "; ".join(failures(validity)), "ttft_n": len(ttft)}
    for q in PERCENTILES:
        found = reported_percentile(ttft, q)
        row.update({f"ttft_p{q}_s": found["value"], f"ttft_p{q}_ci_low_s": found["ci_low"],
                    f"ttft_p{q}_ci_high_s": found["ci_high"], f"ttft_p{q}_basis": found["basis"]})
    row.update({k: metrics[k] for k in ("reload_rate", "slo_attainment", "wall_clock_s", "mean_power_w",
                                        "energy_per_followup_j", "errors", "mean_pool_hit_fraction", "followups")})
    for name, limit in (("reload_rate", config["warm_s"]), ("slo_attainment", config["slo_s"])):
        row[f"{name}_ci_low"], row[f"{name}_ci_high"] = proportion_ci(int((ttft <= limit).sum()), n)
    fractions = records["external_hit_tokens"].fillna(0).astype(float) / config["workload"]["doc_tokens"]
    row["mean_pool_hit_fraction_ci_low"], row["mean_pool_hit_fraction_ci_high"] = mean_ci(fractions)
    row["replica_cpu_s_per_followup"] = (sum(r["cpu_s"] for r in power["replicas"].values()) / max(1, len(records)))
    return row


def _support(row, metric: str) -> tuple[int | None, str, float, float]:
    """What one cell's ``metric`` rests on in the per-cell table: samples, basis and 95% interval."""
    def get(column):
        return row[column] if column in row and pd.notna(row[column]) else np.nan

    if metric.startswith("ttft_p"):
        q = metric.removeprefix("ttft_p").removesuffix("_s")
        base = metric.removesuffix("_s")
        return (get("ttft_n"), row.get(f"ttft_p{q}_basis", f"p{q}"), get(f"{base}_ci_low_s"),
                get(f"{base}_ci_high_s"))
    if metric in ("reload_rate", "slo_attainment", "mean_pool_hit_fraction"):
        return get("followups"), "proportion" if metric != "mean_pool_hit_fraction" else "mean", \
            get(f"{metric}_ci_low"), get(f"{metric}_ci_high")
    if metric in ("wall_clock_s", "mean_power_w", "energy_per_followup_j"):
        return 1, ONE_WINDOW, np.nan, np.nan
    return get("followups"), "count", np.nan, np.nan


def table1(cells: pd.DataFrame, ttft: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    """Long-form Table 1 from the per-cell table: one row per (backend, chunk, tier, metric), the two
    arms side by side, each value with its sample count, basis and 95% interval. The ratio is isolated over
    shared, so "8.4x" reads as how many times better sharing is; with ``ttft`` (cell -> its answered
    requests' TTFTs) a TTFT percentile's ratio gets its own bootstrap interval."""
    rows = []
    # a shared MP pool of a server per replica is compared with the isolated arm of its backend, whose
    # replicas have a server each already (no isolated cell carries the setting)
    isolated = {(row["backend"], row["chunk"], row["tier"]): row
                for _, row in cells[cells["arm"] == Arm.ISOLATED].iterrows()}
    for (backend, chunk, tier), group in cells.groupby(["backend", "chunk", "tier"], sort=False):
        arms = {row["arm"]: row for _, row in group.iterrows()}
        baseline = isolated.get((backend.partition(SERVERS)[0], chunk, tier))
        if Arm.ISOLATED not in arms and baseline is not None:
            arms[Arm.ISOLATED] = baseline
        for metric, unit, has_ratio in TABLE1_ROWS:
            value = {arm: arms[arm][metric] if arm in arms else np.nan for arm in TABLE1_ARMS}
            iso, sha = value[Arm.ISOLATED], value[Arm.SHARED]
            ratio = iso / sha if has_ratio and pd.notna(iso) and pd.notna(sha) and sha else np.nan
            row = {"backend": backend, "chunk": chunk, "tier": tier, "metric": metric, "unit": unit,
                   "isolated": iso, "shared": sha, "ratio": ratio,
                   "isolated_valid": arms[Arm.ISOLATED]["valid"] if Arm.ISOLATED in arms else None,
                   "shared_valid": arms[Arm.SHARED]["valid"] if Arm.SHARED in arms else None,
                   "ratio_ci_low": np.nan, "ratio_ci_high": np.nan}
            for arm in TABLE1_ARMS:
                n, basis, low, high = _support(arms[arm], metric) if arm in arms else (None, "not run", np.nan,
                                                                                        np.nan)
                row.update({f"{arm}_n": n, f"{arm}_basis": basis, f"{arm}_ci_low": low, f"{arm}_ci_high": high})
            if ttft is not None and metric.startswith("ttft_p") and pd.notna(ratio):
                q = int(metric.removeprefix("ttft_p").removesuffix("_s"))
                row["ratio_ci_low"], row["ratio_ci_high"] = ratio_ci(ttft[arms[Arm.ISOLATED]["cell"]],
                                                                     ttft[arms[Arm.SHARED]["cell"]], q)
            rows.append(row)
    return pd.DataFrame(rows, columns=TABLE1_COLUMNS)


def headline(table: pd.DataFrame) -> pd.DataFrame:
    """Isolated over shared per (backend, chunk, tier), from Table 1's long form (``results/table1.csv``)
    where both arms are valid: TTFT p50 with its bootstrap interval and sample counts, TTFT p99 (or the
    largest samples' ratio, as its basis says) and wall clock."""
    rows = []
    valid = table[table["isolated_valid"].astype(str).eq("True") & table["shared_valid"].astype(str).eq("True")]
    for keys, group in valid.groupby(["backend", "chunk", "tier"], sort=False):
        by = group.set_index("metric")
        p50, p99 = by.loc["ttft_p50_s"], by.loc["ttft_p99_s"]
        rows.append({"backend": keys[0], "chunk": keys[1], "tier": keys[2], "ttft_p50_s_ratio": p50["ratio"],
                     "ttft_p50_s_ratio_ci_low": p50["ratio_ci_low"], "ttft_p50_s_ratio_ci_high": p50["ratio_ci_high"],
                     "isolated_n": p50["isolated_n"], "shared_n": p50["shared_n"],
                     "ttft_p99_s_ratio": p99["ratio"], "ttft_p99_basis": f"{p99['isolated_basis']} / "
                     f"{p99['shared_basis']}", "wall_clock_s_ratio": by.loc["wall_clock_s", "ratio"]})
    return pd.DataFrame(rows, columns=HEADLINE_COLUMNS)


HEADLINE_COLUMNS = ["backend", "chunk", "tier", "ttft_p50_s_ratio", "ttft_p50_s_ratio_ci_low",
                    "ttft_p50_s_ratio_ci_high", "isolated_n", "shared_n", "ttft_p99_s_ratio", "ttft_p99_basis",
                    "wall_clock_s_ratio"]


TIER_SIGNALS = [
    ("drive_read_gb_per_s", "GB/s", "pool bytes read from the drive over the reuse phase's length"),
    ("drive_read_active_gb_per_s", "GB/s", "mean read rate over the samples that saw reads"),
    ("rated_read_gb_per_s", "GB/s", "the drive's rated sequential read (config tier_rated_read_gbps)"),
    ("ceiling_read_gb_per_s", "GB/s", "sequential read measured on this tier in the same run"),
    ("reload_efficiency", "fraction", "active read rate over the measured ceiling"),
    ("avg_read_kb", "KiB", "average read request size"),
    ("queue_depth_p95", "requests", "p95 of aqu-sz"),
    ("r_await_p50_ms", "ms", "p50 of r_await over samples with reads"),
    ("r_await_p95_ms", "ms", "p95 of r_await over samples with reads"),
    ("ttft_p50_s", "s", "cross-replica TTFT p50 of the shared arm"),
    ("ttft_p95_s", "s", "cross-replica TTFT p95 of the shared arm"),
    ("temperature_c", "C", "drive temperature after reuse (hwmon, else SMART)"),
    ("percent_used", "%", "NVMe wear after reuse"),
    ("avail_spare", "%", "NVMe available spare after reuse"),
]
# Shown where the tiers' ceilings hold the host-to-GPU link (kvpool.measure.link; runs before it have none)
LINK_SIGNALS = [
    ("reload_gb_per_s", "GB/s", "KV a follow-up loaded from the pool over its TTFT, median (the TTFT also holds "
                                "the rest of the prefill and a decode step: a lower bound on the reload's rate)"),
    ("link_ceiling_gb_per_s", "GB/s", "host-to-GPU copy from pinned memory, 1 GiB, measured in the same run"),
    ("link_efficiency", "fraction", "reload rate over the link's ceiling"),
]


def _health_value(health: list[dict], key: str):
    for disk in health:
        if key == "temperature_c" and disk.get("hwmon_temperature_c") is not None:
            return disk["hwmon_temperature_c"]
        if disk.get("smart_log", {}).get(key) is not None:
            return disk["smart_log"][key]
    return np.nan


def reload_rates(records: pd.DataFrame, per_token: int) -> pd.Series:
    """Each answered follow-up's pool reload rate in GB/s: the KV it loaded (its measured hit tokens times the
    model's KV bytes per token) over its TTFT; follow-ups that loaded nothing are left out."""
    ok = records[(records["error"].fillna("") == "") & (records["external_hit_tokens"].fillna(0) > 0)]
    return ok["external_hit_tokens"].astype(float) * per_token / ok["ttft_s"].astype(float) / 1e9


def tier_signals(reuse_summary: dict, records: pd.DataFrame, ceiling: dict, per_token: int | None = None) -> dict:
    """Table 2's signals for one tier from its reuse-phase telemetry, request records and read ceiling, and
    where the ceiling holds the host-to-GPU link, the reload's rate against it (``per_token``: the model's
    KV bytes per token).

    Drive signals are NaN on a tier without a drive (memory-backed), never zero.
    """
    drive = reuse_summary["drive"]
    get = (lambda *keys: _dig(drive, *keys)) if drive.get("available") else (lambda *keys: np.nan)
    ok = records[records["error"].fillna("") == ""]["ttft_s"].astype(float)
    active_gb = get("read_active_gb_per_s")
    health = reuse_summary["health_after"]
    return {
        "drive_read_gb_per_s": get("read_gb_per_s"),
        "drive_read_active_gb_per_s": active_gb,
        "rated_read_gb_per_s": ceiling.get("rated_gb_per_s") or np.nan,
        "ceiling_read_gb_per_s": ceiling["gb_per_s"],
        "reload_efficiency": active_gb / ceiling["gb_per_s"] if pd.notna(active_gb) else np.nan,
        "avg_read_kb": get("avg_read_kb"),
        "queue_depth_p95": get("aqu_sz", "p95"),
        "r_await_p50_ms": get("r_await_ms", "p50"),
        "r_await_p95_ms": get("r_await_ms", "p95"),
        "ttft_p50_s": reported_percentile(ok, 50)["value"],
        "ttft_p95_s": reported_percentile(ok, 95)["value"],
        "temperature_c": _health_value(health, "temperature_c"),
        "percent_used": _health_value(health, "percent_used"),
        "avail_spare": _health_value(health, "avail_spare"),
        **(_link_signals(records, ceiling["link"], per_token) if "link" in ceiling else {}),
    }


def _link_signals(records: pd.DataFrame, found: dict, per_token: int | None) -> dict:
    rates = reload_rates(records, per_token) if per_token else pd.Series(dtype=float)
    reload = reported_percentile(rates.to_numpy(dtype=float), 50)
    return {"reload_gb_per_s": reload["value"], "reload_gb_per_s_ci_low": reload["ci_low"],
            "reload_gb_per_s_ci_high": reload["ci_high"], "reload_gb_per_s_n": reload["n"],
            "link_ceiling_gb_per_s": found.get("gb_per_s") or np.nan,
            "link_efficiency": link.efficiency(reload["value"], found)}


def _dig(data: dict, *keys):
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return np.nan if data is None else data


def tier_row(cell: Cell, reuse_summary: dict, records: pd.DataFrame, drive: pd.DataFrame, ceiling: dict,
             per_token: int | None = None) -> dict:
    """One shared cell's row of the per-tier table: :func:`tier_signals` (the telemetry's figures) with
    bootstrap 95% intervals from the reuse phase's raw samples (``drive``: its iostat rows), the same
    series the telemetry reduced: r_await over samples with reads, queue depth summed over the tier's
    disks per tick."""
    row = {**cell.keys(arm=False),
           **tier_signals(reuse_summary, records, ceiling, per_token), "ceiling_method": ceiling.get("method")}
    reuse = drive[drive["phase"] == "reuse"] if len(drive) else drive
    r_await = reuse.loc[reuse["r_per_s"] > 0, "r_await_ms"] if len(reuse) else pd.Series(dtype=float)
    queue = drive_per_tick(reuse)["aqu_sz"] if len(reuse) else pd.Series(dtype=float)
    ok = records.loc[records["error"].fillna("") == "", "ttft_s"]
    for signal, values, q in (("r_await_p50_ms", r_await, 50), ("r_await_p95_ms", r_await, 95),
                              ("queue_depth_p95", queue, 95), ("ttft_p50_s", ok, 50), ("ttft_p95_s", ok, 95)):
        found = reported_percentile(values.to_numpy(dtype=float), q)
        row.update({f"{signal}_ci_low": found["ci_low"], f"{signal}_ci_high": found["ci_high"],
                    f"{signal}_n": found["n"], f"{signal}_basis": found["basis"]})
    return row


def tier_compare(tiers: pd.DataFrame) -> pd.DataFrame:
    """Study A's Table 2 from the per-tier table: long rows (backend, chunk, signal, unit, meaning) with
    one column per tier."""
    rows = []
    names = list(dict.fromkeys(tiers["tier"]))
    for (backend, chunk), group in tiers.groupby(["backend", "chunk"], sort=False):
        by_tier = group.set_index("tier")
        for name, unit, meaning in TIER_SIGNALS + [s for s in LINK_SIGNALS if s[0] in tiers.columns]:
            basis = {t: by_tier.loc[t, f"{name}_basis"] if t in by_tier.index and f"{name}_basis" in by_tier
                     else None for t in names}
            rows.append({"backend": backend, "chunk": chunk, "signal": name, "unit": unit, "meaning": meaning,
                         **{t: by_tier.loc[t, name] if t in by_tier.index else np.nan for t in names},
                         # where too few samples make a percentile, the value is their maximum
                         "basis": "; ".join(f"{t}: {b}" for t, b in basis.items()
                                            if isinstance(b, str) and b.startswith("max of"))})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class DrawnTable:
    """One of Study A's tables (``table``: Table 1 or Table 2) and the long table it is drawn from
    (``units``: the per-cell or per-tier table, every figure with its intervals)."""

    units: pd.DataFrame
    table: pd.DataFrame


def table1_of(config: dict, cells: list[Cell], reuse_csvs: list[str], reuse_jsons: list[str],
              validity_jsons: list[str], telemetry_jsons: list[str]) -> DrawnTable:
    """The per-cell table (every figure of every cell, with its intervals) and Study A's Table 1 drawn
    from it, from each cell's reuse records, reuse.json, validity.json and telemetry summary."""
    records = {cell.name: read_records(path) for cell, path in zip(cells, reuse_csvs, strict=True)}
    rows = [cell_row(cell, records[cell.name], read_json(reuse_json)["wall_s"],
                             phase_power(read_json(telemetry_json)["reuse"]), read_json(validity_json), config)
            for cell, reuse_json, validity_json, telemetry_json in zip(
                cells, reuse_jsons, validity_jsons, telemetry_jsons, strict=True)]
    per_cell = pd.DataFrame(rows)
    ttft = {name: frame.loc[frame["error"].fillna("") == "", "ttft_s"].to_numpy(dtype=float)
            for name, frame in records.items()}
    return DrawnTable(per_cell, table1(per_cell, ttft))


def table2_of(config: dict, shared_cells: list[Cell], summaries: list[str], reuse_csvs: list[str],
              drive_csvs: list[str], ceilings: list[str]) -> DrawnTable:
    """The per-tier table (each shared cell's drive and TTFT figures, with intervals) and Study A's
    Table 2 drawn from it, from each shared cell's telemetry summary, reuse records and drive samples,
    and each tier's ceiling."""
    ceiling_by_tier = {path.split("/")[-2]: read_json(path) for path in ceilings}
    per_token = engine_pool_bytes_per_token(config)
    rows = [tier_row(cell, read_json(summary_path)["reuse"], read_records(reuse_csv),
                             read_frame_or_empty(drive_csv), ceiling_by_tier[cell.tier], per_token)
            for cell, summary_path, reuse_csv, drive_csv in zip(
                shared_cells, summaries, reuse_csvs, drive_csvs, strict=True)]
    tiers = pd.DataFrame(rows)
    return DrawnTable(tiers, tier_compare(tiers))

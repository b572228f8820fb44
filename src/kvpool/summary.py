"""Study A's Table 1 from the measured reuse records: isolated against shared, per backend, chunk and tier."""

from __future__ import annotations

import numpy as np
import pandas as pd

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
TABLE1_COLUMNS = ["backend", "chunk", "tier", "metric", "unit", "isolated", "shared", "ratio",
                  "isolated_valid", "shared_valid"]


def arm_metrics(reuse: pd.DataFrame, wall_s: float, warm_s: float, slo_s: float, doc_tokens: int,
                mean_power_w: float | None = None, energy_j: float | None = None) -> dict:
    """The headline numbers of one arm. Failed requests count against reload rate and SLO attainment."""
    ok = reuse[reuse["error"].fillna("") == ""]
    ttft = ok["ttft_s"].astype(float)
    n = len(reuse)
    p50, p95, p99 = (np.percentile(ttft, [50, 95, 99]) if len(ttft) else (np.nan,) * 3)
    return {
        "ttft_p50_s": p50, "ttft_p95_s": p95, "ttft_p99_s": p99,
        "reload_rate": float((ttft <= warm_s).sum() / n) if n else np.nan,
        "slo_attainment": float((ttft <= slo_s).sum() / n) if n else np.nan,
        "wall_clock_s": wall_s,
        "mean_power_w": np.nan if mean_power_w is None else mean_power_w,
        "energy_per_followup_j": np.nan if energy_j is None or not n else energy_j / n,
        "errors": int(n - len(ok)),
        "mean_pool_hit_fraction": float(reuse["external_hit_tokens"].fillna(0).mean() / doc_tokens) if n else np.nan,
        "followups": n,
    }


def table1(per_cell: list[dict]) -> pd.DataFrame:
    """Long-form Table 1: one row per (backend, chunk, tier, metric), the two arms side by side.

    ``per_cell`` items hold ``backend, chunk, tier, arm, valid`` and the ``metrics`` of :func:`arm_metrics`.
    The ratio is isolated over shared, so "8.4x" reads as how many times better sharing is.
    """
    rows = []
    frame = pd.DataFrame(per_cell)
    for (backend, chunk, tier), group in frame.groupby(["backend", "chunk", "tier"], sort=False):
        arms = {row["arm"]: row for _, row in group.iterrows()}
        for metric, unit, has_ratio in TABLE1_ROWS:
            iso = arms["isolated"]["metrics"][metric] if "isolated" in arms else np.nan
            sha = arms["shared"]["metrics"][metric] if "shared" in arms else np.nan
            ratio = iso / sha if has_ratio and pd.notna(iso) and pd.notna(sha) and sha else np.nan
            rows.append({"backend": backend, "chunk": chunk, "tier": tier, "metric": metric, "unit": unit,
                         "isolated": iso, "shared": sha, "ratio": ratio,
                         "isolated_valid": arms["isolated"]["valid"] if "isolated" in arms else None,
                         "shared_valid": arms["shared"]["valid"] if "shared" in arms else None})
    return pd.DataFrame(rows, columns=TABLE1_COLUMNS)


def _fmt(value, unit: str) -> str:
    if pd.isna(value):
        return "n/a"
    if unit == "fraction":
        return f"{100 * value:.0f}%"
    if unit == "count":
        return f"{int(value)}"
    return f"{value:.3g} {unit}"


def table1_markdown(table: pd.DataFrame) -> str:
    """One Markdown table per (backend, chunk, tier), laid out like the study's Table 1."""
    parts = []
    for (backend, chunk, tier), group in table.groupby(["backend", "chunk", "tier"], sort=False):
        first = group.iloc[0]
        flags = {arm: ("valid" if first[f"{arm}_valid"] else "INVALID") if first[f"{arm}_valid"] is not None
                 else "not run" for arm in ("isolated", "shared")}
        lines = [f"### backend {backend}, chunk {chunk}, tier {tier}", "",
                 f"| Metric | Isolated ({flags['isolated']}) | Shared ({flags['shared']}) | Isolated / shared |",
                 "|---|---|---|---|"]
        for _, row in group.iterrows():
            ratio = f"{row['ratio']:.1f}x" if pd.notna(row["ratio"]) else "n/a"
            lines.append(f"| {row['metric']} | {_fmt(row['isolated'], row['unit'])} | "
                         f"{_fmt(row['shared'], row['unit'])} | {ratio} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"

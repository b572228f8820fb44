"""The run's tables as a person reads them on the page: one value per column with its unit, intervals in
brackets, a cell by its label, no raw column name."""

from __future__ import annotations

import pandas as pd

from kvpool.cells import Cell
from kvpool.report.format import change_cells, fmt_interval, fmt_supported, fmt_value, pct


def _with_interval(row: pd.Series, column: str, unit: str, low: str, high: str) -> str:
    shown = fmt_value(row[column], unit)
    return shown if shown == "n/a" else shown + fmt_interval(row.get(low), row.get(high), unit)


def cells_for_reading(cells: pd.DataFrame) -> pd.DataFrame:
    """The per-cell table as a person reads it: one value per column with its unit, TTFT percentiles
    with their 95% interval in brackets, three significant digits."""
    rows = []
    for _, row in cells.iterrows():
        shown = {"cell": f"{row['backend']} / chunk {row['chunk']} / {row['tier']} / {row['arm']}",
                 "gate": "valid" if row["valid"] else "INVALID"}
        for q in (50, 95, 99):
            basis = row.get(f"ttft_p{q}_basis")
            shown[f"TTFT p{q}"] = (f"{basis}: {fmt_value(row[f'ttft_p{q}_s'], 's')}"
                                   if isinstance(basis, str) and basis.startswith("max of")
                                   else _with_interval(row, f"ttft_p{q}_s", "s", f"ttft_p{q}_ci_low_s",
                                                       f"ttft_p{q}_ci_high_s"))
        shown.update({"n": f"{row['ttft_n']:.0f}" if pd.notna(row.get("ttft_n")) else "n/a",
                      "reload ≤ warm_s": _with_interval(row, "reload_rate", "fraction", "reload_rate_ci_low",
                                                        "reload_rate_ci_high"),
                      "SLO attainment": _with_interval(row, "slo_attainment", "fraction", "slo_attainment_ci_low",
                                                       "slo_attainment_ci_high"),
                      "wall clock": fmt_value(row["wall_clock_s"], "s"),
                      "GPU power": fmt_value(row["mean_power_w"], "W"),
                      "energy / follow-up": fmt_value(row["energy_per_followup_j"], "J"),
                      "document loaded": fmt_value(row["mean_pool_hit_fraction"], "fraction"),
                      "errors": f"{int(row['errors'])} of {int(row['followups'])}"})
        rows.append(shown)
    return pd.DataFrame(rows)


def headline_for_reading(head: pd.DataFrame) -> pd.DataFrame:
    """The isolated / shared ratios as a person reads them: one setting per row, two significant digits,
    the p50's with its 95% interval and the follow-ups it rests on, the p99's with its basis."""
    def interval(row) -> str:
        low, high = row["ttft_p50_s_ratio_ci_low"], row["ttft_p50_s_ratio_ci_high"]
        return f" [{low:.2g}, {high:.2g}]" if pd.notna(low) and pd.notna(high) else ""

    return pd.DataFrame([{"setting": f"{row['backend']} / chunk {row['chunk']} / {row['tier']}",
                          "TTFT p50": f"{row['ttft_p50_s_ratio']:.2g}x{interval(row)}",
                          "follow-ups (isolated / shared)": f"{row['isolated_n']:.0f} / {row['shared_n']:.0f}",
                          "TTFT p99": f"{row['ttft_p99_s_ratio']:.2g}x ({row['ttft_p99_basis']})",
                          "wall clock": f"{row['wall_clock_s_ratio']:.2g}x"} for _, row in head.iterrows()],
                        columns=["setting", "TTFT p50", "follow-ups (isolated / shared)", "TTFT p99", "wall clock"])


def only_maxima(basis) -> bool:
    """Whether a percentile's basis names only maxima ("max of 8", or an arm each: "max of 8 / max of 8"):
    too few samples for the percentile anywhere in it."""
    return isinstance(basis, str) and all(part.strip().startswith("max of") for part in basis.split(" / "))


def fold_maxima(shown: pd.DataFrame, bases: dict[str, pd.Series | None], keys: list[str]
                ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Fold out of a table as read (``shown``) the percentile columns that hold only maxima on every row
    (``bases``: each column's basis, row for row): the table a reader compares, the folded columns beside
    the ``keys`` that name a row (empty where nothing folds), and a line that says what they are."""
    folded = [column for column, basis in bases.items()
              if column in shown and basis is not None and len(basis) and basis.map(only_maxima).all()]
    if not folded:
        return shown, pd.DataFrame(), ""
    counts = sorted({part.strip() for column in folded for basis in bases[column] for part in basis.split(" / ")},
                    key=lambda part: int(part.removeprefix("max of").strip() or 0))
    each = f"{counts[0]} each" if len(counts) == 1 else f"{counts[0]} to {counts[-1].removeprefix('max of ')}"
    names = folded[0] + "".join(", " + column.removeprefix("TTFT ") for column in folded[1:])
    return (shown.drop(columns=folded), shown[keys + folded],
            f"{names}: {each}, too few samples for the percentile (the largest sample shown)")


def kv_bytes_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """The byte-level comparisons as a person reads them: agreement as "equal of keys", and whether the
    comparison must agree bit for bit."""
    return pd.DataFrame([{"setting": f"{row['backend']} / chunk {row['chunk']} / {row['tier']}",
                          "comparison": row["comparison"], "chunks equal": f"{row['equal']} of {row['keys']}",
                          "must agree bit for bit": "yes" if str(row["bit_exact_expected"]) == "True" else "no",
                          "example of a differing chunk": row["example_key"] or ""}
                         for _, row in table.iterrows()],
                        columns=["setting", "comparison", "chunks equal", "must agree bit for bit",
                                 "example of a differing chunk"])


def tiers_for_reading(tiers: pd.DataFrame) -> pd.DataFrame:
    """The per-tier table (shared cells) as a person reads it, as :func:`cells_for_reading`."""
    rows = []
    for _, row in tiers.iterrows():
        rows.append({
            "cell": f"{row['backend']} / chunk {row['chunk']} / {row['tier']}",
            "gate": "valid" if row["valid"] else "INVALID",
            "read (phase)": fmt_value(row["drive_read_gb_per_s"], "GB/s"),
            "read (active)": fmt_value(row["drive_read_active_gb_per_s"], "GB/s"),
            "ceiling": fmt_value(row["ceiling_read_gb_per_s"], "GB/s"),
            "of ceiling": fmt_value(row["reload_efficiency"], "fraction"),
            "avg read": fmt_value(row["avg_read_kb"], "KiB"),
            "queue p95": _with_interval(row, "queue_depth_p95", "", "queue_depth_p95_ci_low",
                                        "queue_depth_p95_ci_high"),
            "r_await p50": _with_interval(row, "r_await_p50_ms", "ms", "r_await_p50_ms_ci_low",
                                          "r_await_p50_ms_ci_high"),
            "r_await p95": _with_interval(row, "r_await_p95_ms", "ms", "r_await_p95_ms_ci_low",
                                          "r_await_p95_ms_ci_high"),
            "TTFT p50": _with_interval(row, "ttft_p50_s", "s", "ttft_p50_s_ci_low", "ttft_p50_s_ci_high"),
            "temperature": fmt_value(row["temperature_c"], "°C"),
            # SMART reports both in percent already
            "wear / spare": f"{row['percent_used']:.0f}% / {row['avail_spare']:.0f}%"
            if pd.notna(row["percent_used"]) and pd.notna(row["avail_spare"]) else "n/a",
        })
    return pd.DataFrame(rows)


def _cell_label(name: str) -> str:
    """A cell's name as the tables show it: backend / arm / chunk / tier, with spaces a line can break at."""
    cell = Cell.from_name(name)
    return f"{cell.label} / {cell.arm} / chunk {cell.chunk} / {cell.tier}"


def _paired_change(row) -> dict:
    """ON against OFF as Study B's own page (results/studyb.md) shows it: the mean paired change, and its
    95% interval with what it lets the page say."""
    change, interval = change_cells(row)
    return {"ON against OFF (mean paired)": change, "95% CI": interval}


def _of(part, whole) -> str:
    return "n/a" if pd.isna(part) or pd.isna(whole) else f"{int(part)} of {int(whole)}"


def locality_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """Study B's locality chains (results/locality.csv) as a person reads them: per context and step, the
    median TTFT OFF and ON, where the ON tokens came from, the paired change and the answers compared."""
    return pd.DataFrame([{
        "context": f"{int(r['context'])} tokens", "step": r["step"],
        "TTFT OFF (median)": fmt_value(r["off_ttft_median_s"], "s"),
        "TTFT ON (median)": fmt_value(r["on_ttft_median_s"], "s"),
        "ON tokens: own cache / pool": f"{r['on_local_hit_tokens']:.0f} / {r['on_external_hit_tokens']:.0f}",
        **_paired_change(r),
        "answers equal": _of(r["outputs_equal"], r["pairs_matched"]),
    } for _, r in table.iterrows()])


def sessions_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """Study B's sessions (per placement) as a person reads them: wall time per session OFF and ON, the
    paired change, and what changed in the turns' TTFT and decode."""
    return pd.DataFrame([{
        "placement": r["placement"],
        "session wall OFF (median)": fmt_value(r["off_wall_median_s"], "s"),
        "session wall ON (median)": fmt_value(r["on_wall_median_s"], "s"),
        **_paired_change(r),
        "turn TTFT change": pct(r["turn_ttft_change_pct"]),
        "decode change": pct(r["decode_change_pct"]),
        "turns' answers equal": _of(r["outputs_equal"], r["turns_matched"]),
    } for _, r in table.iterrows()])


def windows_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """Study B's short concurrency windows as a person reads them: output tokens per second OFF and ON."""
    return pd.DataFrame([{
        "sessions at once": int(r["window"]), "placement": r["placement"],
        "tokens/s OFF (median)": fmt_value(r["off_tokens_per_s_median"], ""),
        "tokens/s ON (median)": fmt_value(r["on_tokens_per_s_median"], ""),
        **_paired_change(r),
        "turn TTFT OFF / ON (median)": f"{fmt_value(r['off_turn_ttft_median_s'], 's')} / "
                                       f"{fmt_value(r['on_turn_ttft_median_s'], 's')}",
    } for _, r in table.iterrows()])


def crossover_for_reading(table: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Where the pool pays (results/crossover.csv) as a person reads it: per context, the measured and
    fitted prefill and reload and the read rate below which the reload stops paying; and, in a sentence,
    the fit itself (the same on every row)."""
    shown = pd.DataFrame([{
        "context": f"{int(r['context'])} tokens",
        "prefill (measured / fit)": f"{fmt_value(r['prefill_s'], 's')} / {fmt_value(r['prefill_fit_s'], 's')}",
        "reload (measured / fit)": f"{fmt_value(r['reload_s'], 's')} / {fmt_value(r['reload_fit_s'], 's')}",
        "speedup": "n/a" if pd.isna(r["speedup"]) else f"{r['speedup']:.3g}x",
        "stops paying below": fmt_value(r["break_even_read_gbps"], "GB/s"),
    } for _, r in table.iterrows()])
    if table.empty or table["fit_read_gbps"].isna().all():
        return shown, "No fit was made (results/crossover.md says why)."
    first = table.iloc[0]
    crossover = ("the reload beats the prefill at every measured context" if pd.isna(first["crossover_tokens"])
                 or first["crossover_tokens"] <= 0 else f"the reload beats the prefill from "
                 f"{first['crossover_tokens']:,.0f} tokens")
    return shown, (f"Reload fit: {fmt_value(first['fit_overhead_s'], 's')} + bytes / "
                   f"{fmt_value(first['fit_read_gbps'], 'GB/s')}; {crossover}.")


def routers_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """results/routers.csv as a person reads it: per unit and phase, TTFT with its interval and where the
    phase's prompt tokens came from."""
    return pd.DataFrame([{
        "cell": _cell_label(r["cell"]), "router": r["router"],
        "phase": r["phase"] if r.get("group", "all") == "all" else f"{r['phase']} ({r['group']})",
        "gate": "valid" if r["valid"] else "INVALID", "requests": int(r["requests"]),
        "TTFT p50": _with_interval(r, "ttft_p50_s", "s", "ttft_p50_ci_low_s", "ttft_p50_ci_high_s"),
        "TTFT p99": fmt_supported(r["ttft_p99_s"], "s", r.get("ttft_p99_basis"), None, None, None),
        "tokens: own cache / pool / computed": " / ".join(fmt_value(r[c], "fraction") for c in
                                                          ("local_cache_fraction", "pool_fraction",
                                                           "computed_fraction")),
        "moved": fmt_value(r["moved_fraction"], "fraction"),
        "busiest replica": fmt_value(r["max_replica_share"], "fraction"),
    } for _, r in table.iterrows()])


def contexts_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """results/contexts.csv as a person reads it: per cell and length, the three TTFTs, the speedup, the
    KV moved and where the pool stops paying."""
    return pd.DataFrame([{
        "cell": _cell_label(r["cell"]), "document": f"{int(r['context'])} tokens",
        "gate": "valid" if r["valid"] else "INVALID",
        "prefill": fmt_value(r["prefill_s"], "s"), "own cache": fmt_value(r["local_s"], "s"),
        "pool reload": fmt_value(r["reload_s"], "s"),
        "speedup": "n/a" if pd.isna(r["speedup"]) else f"{r['speedup']:.3g}x",
        "KV moved": fmt_value(r["kv_bytes"] / 1e6, "MB"),
        "stops paying below": fmt_value(r["break_even_read_gbps"], "GB/s"),
        "crossover": "n/a" if pd.isna(r["crossover_tokens"]) else f"{r['crossover_tokens']:,.0f} tokens",
    } for _, r in table.iterrows()])


def pool_servers_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """What each pool server counted per phase, one line of counters per server: the counters differ by
    backend, so they are listed by name rather than spread over columns most rows leave empty."""
    fixed = {"cell", "phase", "server"}
    return pd.DataFrame([{
        "cell": _cell_label(r["cell"]), "phase": r["phase"], "server": int(r["server"]),
        "counters over the phase": ", ".join(f"{name} {value:.4g}" for name, value in r.items()
                                             if name not in fixed and pd.notna(value)),
    } for _, r in table.iterrows()])

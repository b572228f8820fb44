"""The pool-capacity page (kvpool.studies.capacity): results/capacity.csv, .md and its figure, and the
table as a person reads it, with the operator's number per cell."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from kvpool.cells import Cell
from kvpool.report import figures
from kvpool.studies import capacity


def for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """results/capacity.csv as a person reads it: per cell and capacity, each figure with its unit and
    interval."""
    def energy(row) -> str:
        if pd.isna(row.energy_per_request_j):
            return "n/a"
        if row.energy_basis == "request":
            return (f"{row.energy_per_request_j:.3g} J [{row.energy_per_request_ci_low_j:.3g}, "
                    f"{row.energy_per_request_ci_high_j:.3g}]")
        return f"{row.energy_per_request_j:.3g} J (window)"

    return pd.DataFrame([{
        "cell": f"{row.backend} / chunk {row.chunk} / {row.tier}", "capacity": f"{row.fraction:g}",
        "policy": row.policy, "gate": "valid" if row.valid else "INVALID",
        "from the pool": f"{row.hit_rate:.0%} [{row.hit_rate_low:.0%}, {row.hit_rate_high:.0%}] of {row.requests}",
        "failed": f"{row.errors} of {row.requests + row.errors}", "recomputed or partial": row.recomputed,
        "silent misses": row.silent_misses, "keys evicted": row.evicted_keys,
        "KV held / capacity": f"{row.held_kv_bytes / 1e6:.3g} / {row.capacity_bytes / 1e6:.3g} MB",
        "TTFT p50": f"{row.ttft_p50_s:.3g} s [{row.ttft_p50_ci_low_s:.3g}, {row.ttft_p50_ci_high_s:.3g}]",
        "TTFT mean": f"{row.ttft_mean_s:.3g} s [{row.ttft_mean_ci_low_s:.3g}, {row.ttft_mean_ci_high_s:.3g}]",
        "TTFT p99": f"{row.ttft_p99_s:.3g} s", "energy / follow-up": energy(row),
    } for row in table.itertuples()])


INTRODUCTION = ("Per shared cell and capacity (a fraction of the working set's KV bytes, set as the pool's own "
                "limit: a server's memory, or the size of the filesystem under a pool of files), the window's "
                "follow-ups, their documents drawn by popularity, each to a replica that did not prefill it with "
                "its own cache emptied. Hit rate with its Wilson 95% interval, TTFT p50 and mean with "
                "their bootstrap 95% intervals. Energy per follow-up: each follow-up's own GPU energy (mean, bootstrap "
                "95% interval), or, marked (window), the window's energy over its follow-ups, which counts the "
                "waits for the server's evictions between them.")


def operators_numbers(table: pd.DataFrame) -> list[str]:
    """Per cell, a line with the capacity at which its pool gives 90% of its largest capacity's gain in mean
    TTFT, or why there is none."""
    lines = []
    for _, cell in table.groupby("cell", sort=False):
        first, largest = cell.iloc[0], cell.sort_values("fraction").iloc[-1]
        name = f"{first.backend} / chunk {first.chunk} / {first.tier}"
        if pd.isna(first.recompute_ttft_mean_s):
            lines.append(f"- {name}: no follow-up was recomputed, so there is no recompute TTFT to measure a gain "
                         "from.")
        elif pd.isna(first.capacity_for_90pct_gain):
            lines.append(f"- {name}: no capacity reached 90% of the full-capacity gain among the valid units (a unit "
                         "at 1.0 or more is needed).")
        else:
            lines.append(f"- {name}: 90% of the gain in mean TTFT at capacity {largest.fraction:g} (where "
                         f"{largest.hit_rate:.0%} came from the pool) at about "
                         f"**{first.capacity_for_90pct_gain:.2f}** of the working set (interpolated between the "
                         f"measured capacities; the recompute's mean TTFT is {first.recompute_ttft_mean_s:.3g} s "
                         f"over {first.recomputes_measured} recomputed follow-ups).")
    return lines


def markdown(table: pd.DataFrame) -> str:
    return ("# Pool capacity: what a pool smaller than the working set serves\n\n" + INTRODUCTION + "\n\n"
            + for_reading(table).to_markdown(index=False) + "\n\n" + "\n".join(operators_numbers(table)) + "\n")


def run_capacity_table(units: list[tuple[Cell, float]], *, csvs: list[str], metas: list[str], csv_out: str,
                       md_out: str, figures_dir: str) -> None:
    """results/capacity.csv and .md and their figure: per shared cell and capacity, the window's hit rate,
    recomputes, silent misses, evictions, bytes held, TTFT and energy."""
    table = capacity.table(units, csvs, metas)
    table.to_csv(csv_out, index=False)
    drawn = figures.save(figures.capacity(table), Path(figures_dir), "capacity")
    Path(md_out).write_text(f"{markdown(table)}\n![capacity]({os.path.relpath(drawn['png'], Path(md_out).parent)})\n")

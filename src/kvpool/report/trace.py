"""The trace page (kvpool.studies.trace_replay): results/trace.csv, .md and its figure, per trace unit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from plotnine import aes, facet_grid, geom_line, geom_point, ggplot, labs, scale_colour_manual, theme, theme_bw

from kvpool.cells import Arm, Cell
from kvpool.measure.records import read_records
from kvpool.report import figures
from kvpool.studies import trace_replay

ARM_COLOURS = {**figures.ARM_COLOURS, Arm.OFF: "#7570b3"}


def _share(value: float) -> str:
    return "n/a" if pd.isna(value) else f"{value:.1%}"


def markdown(table: pd.DataFrame) -> str:
    """results/trace.md: per unit, the reuse it recovered against the trace's bounds, its TTFT and SLO goodput."""
    lines = ["# A production trace replayed: the reusable prefill each pool recovered", "",
             "The bound: the prompt tokens of whole blocks an earlier request of the replay had, with one unbounded "
             "cache for the fleet (what a shared pool could serve at most) and with one per replica under the "
             "router's placement (what isolated pools or own caches could). Recovered: the tokens served from the "
             "replica's own cache or the pool, up to each request's bound, over the bound.", "",
             "| cell | router | gate | requests (left out: too long) | bound, tokens | recovered of the bound "
             "| of the placed bound | own cache | pool | silent misses | TTFT p50 [95% CI] (n) | TTFT p99 "
             "| within the SLO [95% CI] | GPU energy per request | pool at the end |", "|" + "---|" * 15]
    for row in table.itertuples():
        interval = (f" [{row.ttft_p50_ci_low_s:.3g}, {row.ttft_p50_ci_high_s:.3g}]"
                    if pd.notna(row.ttft_p50_ci_low_s) else "")
        p99 = f"{row.ttft_p99_s:.3g} s" + (f" ({row.ttft_p99_basis})" if str(row.ttft_p99_basis).startswith("max")
                                            else "")
        energy = "n/a" if pd.isna(row.energy_per_request_j) else f"{row.energy_per_request_j:.3g} J"
        pool = "n/a" if pd.isna(row.pool_bytes_end) else f"{row.pool_bytes_end / 1e9:.3g} GB"
        misses = "n/a" if pd.isna(row.silent_misses) else f"{row.silent_misses:.0f}"
        lines.append(
            f"| {row.backend} / {row.arm} / chunk {row.chunk} / {row.tier} | {row.router} | "
            f"{'valid' if row.valid else '**INVALID**'} | {row.requests} ({row.left_out_too_long}) | "
            f"{row.bound_tokens:,} | {_share(row.recovered_of_bound)} | {_share(row.recovered_of_placed_bound)} | "
            f"{row.own_cache_tokens:,} | {row.pool_tokens:,} | {misses} | "
            f"{row.ttft_p50_s:.3g} s{interval} ({row.ttft_n}) | {p99} | "
            f"{_share(row.slo_attainment)} [{_share(row.slo_ci_low)}, {_share(row.slo_ci_high)}] at {row.slo_s:g} s | "
            f"{energy} | {pool} |")
    if len(table):
        first = table.iloc[0]
        lines += ["", f"Scaling: trace window {first.window_s} s, {first.groups:g} of the prefix groups, "
                  f"{first.block_tokens} tokens a block, arrivals sped up {first.speedup:g}x."]
    return "\n".join(lines) + "\n"


def timeline(units: list[tuple[Cell, str]], csvs: list[str]) -> pd.DataFrame:
    """Per request of every unit, in trace time: the share of the bound recovered so far and its TTFT."""
    parts = []
    for (cell, router), csv in zip(units, csvs, strict=True):
        rows = read_records(csv)
        rows = rows[rows["error"].fillna("") == ""].sort_values("seq")
        served = np.minimum(trace_replay.served_tokens(rows), rows["bound_tokens"].astype(float))
        bound = rows["bound_tokens"].astype(float).cumsum()
        parts.append(pd.DataFrame({
            "arm": cell.arm, "router": router, "setting": f"{cell.label} / chunk {cell.chunk} / {cell.tier}",
            "trace_s": rows["due_s"].astype(float), "ttft_s": rows["ttft_s"].astype(float),
            "recovered": np.where(bound > 0, served.cumsum() / bound.where(bound > 0, 1), np.nan)}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        columns=["arm", "router", "setting", "trace_s", "ttft_s", "recovered"])


def recovered_figure(data: pd.DataFrame):
    """The share of the trace's reusable tokens recovered so far, over trace time, per arm and router."""
    return (ggplot(data.dropna(subset=["recovered"]), aes("trace_s", "recovered", colour="arm"))
            + geom_line() + facet_grid("setting ~ router") + scale_colour_manual(values=ARM_COLOURS)
            + labs(title="Reusable prefill recovered so far (of the fleet-wide bound)", x="trace time, s (scaled)",
                   y="share") + theme_bw() + theme(figure_size=(9, 3.5)))


def ttft_figure(data: pd.DataFrame):
    """Each request's TTFT over trace time, per arm and router."""
    return (ggplot(data, aes("trace_s", "ttft_s", colour="arm")) + geom_point(size=0.8, alpha=0.7)
            + facet_grid("setting ~ router") + scale_colour_manual(values=ARM_COLOURS)
            + labs(title="TTFT per request over the trace", x="trace time, s (scaled)", y="seconds")
            + theme_bw() + theme(figure_size=(9, 3.5)))


def section(trace_csv: str) -> dict:
    """The report's trace section: results/trace.md's table and the figures beside it (``run_trace_table``'s)."""
    folder = Path(trace_csv).with_suffix("")
    table = markdown(pd.read_csv(trace_csv)).split("\n\n")[2]  # the table alone: the page says the rest
    return {"markdown": table, "figures": [{"png": str(folder / f"{stem}.png"), "title": title}
                                           for stem, title in FIGURES.items()]}


FIGURES = {"recovered": "Reusable prefill recovered so far, per arm and router",
           "ttft": "Each request's TTFT over the trace, per arm and router"}


def run_trace_table(units: list[tuple[Cell, str]], *, csvs: list[str], metas: list[str], slo_s: float, csv_out: str,
                    md_out: str, figures_dir: str) -> None:
    """results/trace.csv and .md, and their figures in ``figures_dir``."""
    table = trace_replay.table(units, csvs, metas, slo_s)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text(markdown(table))
    data = timeline(units, csvs)
    out = Path(figures_dir)
    figures.save(recovered_figure(data), out, "recovered")
    figures.save(ttft_figure(data), out, "ttft")

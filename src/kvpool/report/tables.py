"""Study A's tables as a run writes them: the per-cell table and Table 1, the per-tier table and Table 2
(computed in kvpool.studies.tables), each as CSV and Markdown. Rules write them; the report and every
other reader take the files.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvpool.cells import Cell
from kvpool.measure.files import read_json
from kvpool.report.format import fmt_value, table1_arm, table1_ratio
from kvpool.report.published import beside, run_setup
from kvpool.settings import reads
from kvpool.studies.tables import table1_of, table2_of


def table1_markdown(table: pd.DataFrame) -> str:
    """One Markdown table per (backend, chunk, tier), laid out like the study's Table 1: each value with its
    95% interval and sample count, a maximum where too few samples make a percentile, the ratio with its
    own interval."""
    parts = []
    for (backend, chunk, tier), group in table.groupby(["backend", "chunk", "tier"], sort=False):
        first = group.iloc[0]
        flags = {arm: ("valid" if first[f"{arm}_valid"] else "INVALID") if first[f"{arm}_valid"] is not None
                 else "not run" for arm in ("isolated", "shared")}
        lines = [f"### backend {backend}, chunk {chunk}, tier {tier}", "",
                 f"| Metric | Isolated ({flags['isolated']}) | Shared ({flags['shared']}) | Isolated / shared |",
                 "|---|---|---|---|"]
        for _, row in group.iterrows():
            lines.append(f"| {row['metric']} | {table1_arm(row, 'isolated')} | {table1_arm(row, 'shared')} | "
                         f"{table1_ratio(row)} |")
        parts.append("\n".join(lines))
    note = ("Intervals are 95%: bootstrap for TTFT percentiles, means and ratios, Wilson for proportions. A "
            "percentile needs 20 samples (p95) or 100 (p99); below that the table gives the largest sample. Wall "
            "clock, power and energy are one window each.")
    return "\n\n".join(parts) + f"\n\n{note}\n"


def tier_compare_markdown(table: pd.DataFrame) -> str:
    fixed = ["backend", "chunk", "signal", "unit", "meaning", "basis"]
    tiers = [c for c in table.columns if c not in fixed]
    parts = []
    for (backend, chunk), group in table.groupby(["backend", "chunk"], sort=False):
        lines = [f"### backend {backend}, chunk {chunk}", "", "| Signal | " + " | ".join(tiers) + " |",
                 "|---" * (len(tiers) + 1) + "|"]
        for _, row in group.iterrows():
            maxima = dict(part.split(": ", 1) for part in str(row.get("basis") or "").split("; ") if ": " in part)
            cells = [(f"{maxima[t]}: " if t in maxima else "") + fmt_value(row[t], row["unit"]) for t in tiers]
            lines.append(f"| {row['signal']} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    note = ("n/a: not measurable on that tier (a memory-backed tier has no drive) or no source. A p95 needs 20 "
            "samples: below that the table gives the largest, named \"max of n\".")
    return "\n\n".join(parts) + f"\n\n{note}\n"


@reads("warm_s", "slo_s", "workload", "engine", "random_model", "replicas")
def run_table1(config: dict, cells: list[Cell], reuse_csvs: list[str], reuse_jsons: list[str],
                validity_jsons: list[str], telemetry_jsons: list[str], manifests: list[str], *, cells_csv: str,
                csv_out: str, md_out: str) -> None:
    """The per-cell table (``cells_csv``: every figure of every cell, with its intervals), Study A's Table 1 drawn
    from it, and in the Markdown, Study A's own figures beside it under both setups (``manifests``: the cells')."""
    drawn = table1_of(config, cells, reuse_csvs, reuse_jsons, validity_jsons, telemetry_jsons)
    drawn.units.to_csv(cells_csv, index=False)
    drawn.table.to_csv(csv_out, index=False)
    setup = run_setup(config, cells, [read_json(path) for path in manifests])
    Path(md_out).write_text("# Table 1: cross-replica follow-ups, isolated pools against a shared pool\n\n"
                            + table1_markdown(drawn.table) + "\n" + beside(drawn.table, setup))


@reads("engine", "random_model")
def run_tier_compare(config: dict, shared_cells: list[Cell], summaries: list[str], reuse_csvs: list[str],
                     drive_csvs: list[str], ceilings: list[str], *, tiers_csv: str,
                     csv_out: str, md_out: str) -> None:
    """The per-tier table (``tiers_csv``: each shared cell's drive and TTFT figures, with intervals) and
    Study A's Table 2 drawn from it."""
    drawn = table2_of(config, shared_cells, summaries, reuse_csvs, drive_csvs, ceilings)
    drawn.units.to_csv(tiers_csv, index=False)
    drawn.table.to_csv(csv_out, index=False)
    Path(md_out).write_text("# Table 2: drive tiers during the shared arm's reuse phase\n\n"
                            + tier_compare_markdown(drawn.table))

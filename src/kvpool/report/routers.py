"""The routers page (kvpool.studies.routers): results/routers.csv, .md and its figures, per cell, router,
phase and group."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvpool.cells import Cell
from kvpool.report import figures
from kvpool.studies import routers


def markdown(table: pd.DataFrame) -> str:
    """results/routers.md: TTFT and where the prompt tokens came from, per cell, router, phase and group."""
    lines = ["# Routers: where each request went and where its tokens came from", "",
             "A phase's requests that went to a replica new to their document (moved) and to one that had served it "
             "(stayed) are also shown apart: their TTFTs are two populations.", "",
             "| cell | router | phase | requests | gate | n | TTFT p50 [95% CI] | TTFT p99 | own cache | pool "
             "| computed | on a replica new to the document | busiest replica's share |", "|" + "---|" * 13]
    for row in table.itertuples():
        group = getattr(row, "group", "all")
        p99 = f"{row.ttft_p99_s:.3g} s"
        basis = getattr(row, "ttft_p99_basis", "p99")
        if isinstance(basis, str) and basis.startswith("max of"):
            p99 = f"{basis}: {p99}"
        interval = (f" [{row.ttft_p50_ci_low_s:.3g}, {row.ttft_p50_ci_high_s:.3g}]"
                    if pd.notna(row.ttft_p50_ci_low_s) else "")
        lines.append(
            f"| {row.backend} / {row.arm} / chunk {row.chunk} / {row.tier} | {row.router} | {row.phase} | "
            f"{'all' if group == 'all' else group} | {'valid' if row.valid else '**INVALID**'} | "
            f"{getattr(row, 'ttft_n', row.requests)} | {row.ttft_p50_s:.3g} s{interval} | {p99} | "
            f"{row.local_cache_fraction:.0%} | {row.pool_fraction:.0%} | {row.computed_fraction:.0%} | "
            f"{row.moved_fraction:.0%} | {row.max_replica_share:.0%} |")
    return "\n".join(lines) + "\n"


def run_router_table(units: list[tuple[Cell, str]], *, csvs: list[str], metas: list[str], csv_out: str,
                     md_out: str, figures_dir: str) -> None:
    """results/routers.csv and .md, and their figures: per cell, router and phase."""
    table = routers.table(units, csvs, metas)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text(markdown(table))
    out = Path(figures_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stem, (draw, _) in figures.ROUTER_FIGURES.items():
        figures.save(draw(table), out, stem)

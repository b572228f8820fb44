"""The document-length page (kvpool.studies.contexts): results/contexts.csv, .md and its figure, per shared
cell its lengths' medians with the prefill and reload models fitted."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd

from kvpool.cells import Cell
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.report import figures
from kvpool.settings import reads
from kvpool.studies import contexts
from kvpool.studies.crossover import Fit

log = logging.getLogger(__name__)


def _gbps(value) -> str:
    return "n/a" if value is None or pd.isna(value) else f"{value:.2f} GB/s"


def markdown(frame: pd.DataFrame, fits: dict[str, Fit | str]) -> str:
    lines = ["# Document length: where each tier's pool starts paying", "",
             "Per shared cell and length, each document's locality chain (kvpool.studies.contexts): cold on replica A, "
             "local on A, the pool dropped from the page cache, then cross-replica on B. Prefill fitted as "
             "c + a*n + b*n^2, reload as overhead + bytes / read rate, over the valid units.", ""]
    for name, cell in frame.groupby("cell", sort=False):
        fit = fits[name]
        lines.append(f"## {cell['backend'].iloc[0]} / chunk {cell['chunk'].iloc[0]} / {cell['tier'].iloc[0]}")
        lines.append("")
        if isinstance(fit, str):
            lines.append(f"No fit: {fit}.")
        else:
            at = fit.crossover_tokens()
            where = ("at every length (the fit's crossover is 0 tokens)" if at == 0 else "at no length"
                     if np.isnan(at) else f"from a prompt of about {at:,.0f} tokens")
            lines.append(f"Reload fitted as {fit.overhead_s:.3f} s + bytes / {fit.read_rate / 1e9:.2f} GB/s: it beats "
                         f"the prefill {where}.")
        lines += ["", "| document tokens | prompt tokens | gate | prefill (cold) | own cache (local) | pool (cross) "
                  "| prefill / pool | KV loaded | drive read while reading | read rate below which the pool stops "
                  "paying |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in cell.itertuples():
            rate = ("n/a" if pd.isna(row.fit_read_gbps) else "none pays" if pd.isna(row.break_even_read_gbps)
                    else f"{row.break_even_read_gbps:.2f} GB/s")
            lines.append(f"| {row.context:,} | {row.prompt_tokens:,} | {'valid' if row.valid else 'INVALID'} "
                         f"| {row.prefill_s:.3g} s "
                         f"| {row.local_s:.3g} s | {row.reload_s:.3g} s | {row.speedup:.2f}x "
                         f"| {row.kv_bytes / 1e9:.3g} GB | {_gbps(row.drive_read_gb_per_s)} | {rate} |")
        lines.append("")
    return "\n".join(lines)


@reads("engine", "random_model")
def run_contexts_table(config: dict, units: list[tuple[Cell, int]], *, csvs: list[str], metas: list[str],
                       csv_out: str, md_out: str, figures_dir: str) -> None:
    """results/contexts.csv and .md and their figure: per shared cell, its lengths' cold, own-cache and
    pool TTFT medians with the prefill and reload models fitted (kvpool.studies.contexts)."""
    per_token = engine_pool_bytes_per_token(config)
    if per_token is None:
        raise ValueError(f"the length sweep needs the bytes a pool holds per token of the model, and "
                         f"{config['engine']['model']} has no config.json here to read them from")
    shown, fits = contexts.table(contexts.unit_rows(units, csvs, metas), per_token)
    shown.to_csv(csv_out, index=False)
    drawn = figures.save(figures.contexts(shown, fits), Path(figures_dir), "contexts")
    page = markdown(shown, fits)
    Path(md_out).write_text(f"{page}\n![contexts]({os.path.relpath(drawn['png'], Path(md_out).parent)})\n")
    for name, fit in fits.items():
        if isinstance(fit, str):
            log.warning("%s: no fit over its lengths: %s", name, fit)

"""The crossover page (kvpool.studies.crossover): results/crossover.csv, .md and its figure, where a reload
from the pool starts paying against a prefill and the read rate below which it stops."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd

from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.measure.records import read_records
from kvpool.report import figures
from kvpool.settings import reads
from kvpool.studies.crossover import Fit, table

log = logging.getLogger(__name__)


def markdown(frame: pd.DataFrame, result: Fit | str) -> str:
    """The table as a page; ``result`` is table's fit, or why there is none."""
    lines = ["# Where the pool pays: a reload against a prefill, fitted to Study B's chains", ""]
    if isinstance(result, str):
        measured = ", ".join(f"{r.context:,} tokens: {r.prefill_s:.3g} s / {r.reload_s:.3g} s"
                             for r in frame.itertuples())
        return "\n".join(lines + [f"No fit: {result}. Measured prefill / reload: {measured or 'nothing'}.", ""])
    crossover = frame["crossover_tokens"].iloc[0]
    where = ("at every context (the fit's crossover is 0 tokens)" if crossover == 0 else "at no context"
             if np.isnan(crossover) else f"from about {crossover:,.0f} tokens")
    lines += [f"Tier `{frame['tier'].iloc[0]}`. Prefill (OFF, cold) fitted as c + a*n + b*n^2; reload (ON, cross) "
              f"as {result.overhead_s:.3f} s + bytes / {result.read_rate / 1e9:.2f} GB/s. A reload beats the prefill "
              f"{where}.", "",
              "| context | prefill (measured / fitted) | reload (measured / fitted) | speedup | KV bytes "
              "| read rate below which the reload stops paying |", "|---|---|---|---|---|---|"]
    for row in frame.itertuples():
        rate = "none pays" if np.isnan(row.break_even_read_gbps) else f"{row.break_even_read_gbps:.2f} GB/s"
        lines.append(f"| {row.context:,} | {row.prefill_s:.3g} / {row.prefill_fit_s:.3g} s | {row.reload_s:.3g} / "
                     f"{row.reload_fit_s:.3g} s | {row.speedup:.1f}x | {row.kv_bytes / 1e9:.2f} GB | {rate} |")
    return "\n".join(lines + [""])


@reads("engine", "random_model")
def run_crossover(config: dict, study: dict, *, locality_csv: str, csv_out: str, md_out: str, figures_dir: str) -> None:
    """Where the pool pays (kvpool.studies.crossover), from Study B's locality table (``study``: its resolved
    settings, whose tier the reload is read from): the prefill and reload
    models fitted per context, the crossover context and the break-even read rates."""
    per_token = engine_pool_bytes_per_token(config)
    if per_token is None:
        raise ValueError(f"the crossover needs the bytes a pool holds per token of the model, and "
                         f"{config['engine']['model']} has no config.json here to read them from")
    frame, fit = table(read_records(locality_csv), per_token, study["tier"])
    frame.to_csv(csv_out, index=False)
    drawn = figures.save(figures.crossover(frame, fit), Path(figures_dir), "crossover")
    page = markdown(frame, fit)
    Path(md_out).write_text(f"{page}\n![crossover]({os.path.relpath(drawn['png'], Path(md_out).parent)})\n")
    if isinstance(fit, str):
        log.warning("no crossover fit: %s", fit)

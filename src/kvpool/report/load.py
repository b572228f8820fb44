"""The load table as a person reads it (its rows computed in kvpool.studies.load_table), and the rule's
step that writes it: ``results/load.csv`` and ``.md``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvpool.cells import Cell
from kvpool.report.format import fmt_interval, fmt_value
from kvpool.settings import reads
from kvpool.studies.load_table import load_table


def _basis_value(row, q: int) -> str:
    """A row's TTFT percentile as a table shows it, named "max of n" where too few samples make one."""
    basis = row.get(f"ttft_p{q}_basis")
    shown = fmt_value(row[f"ttft_p{q}_s"], "s")
    return f"{basis}: {shown}" if isinstance(basis, str) and basis.startswith("max of") else shown


def load_for_reading(load: pd.DataFrame) -> pd.DataFrame:
    """The load table as a person reads it: one row per cell and level, each value with its unit, TTFT
    p50 with its 95% interval."""
    return pd.DataFrame([{
        "cell": f"{row['backend']} / {row['arm']} / chunk {row['chunk']} / {row['tier']}", "level": row["level"],
        "gate": "valid" if row["valid"] else "INVALID",
        "TTFT p50": fmt_value(row["ttft_p50_s"], "s") + fmt_interval(row["ttft_p50_ci_low_s"],
                                                                      row["ttft_p50_ci_high_s"])
        + (f" (n={row['ttft_n']:.0f})" if pd.notna(row.get("ttft_n")) else ""),
        "TTFT p99": _basis_value(row, 99), "E2E p50": fmt_value(row["e2e_p50_s"], "s"),
        "answers vs recompute": str(row.get("outputs_checked", "n/a")).replace("_", " "),
        "achieved": fmt_value(row["achieved_rps"], "req/s"), "goodput": fmt_value(row["goodput_rps"], "req/s"),
        "output": fmt_value(row["output_tokens_per_s"], "tok/s"),
        "document loaded": fmt_value(row["hit_fraction"], "fraction"),
        "errors": f"{int(row['errors'])} of {int(row['requests'])}",
        "KV loaded": fmt_value(row.get("loaded_gb_per_s", np.nan), "GB/s"),
        **({"of the link": fmt_value(row["link_use"], "fraction")} if "link_use" in row else {}),
        **({"queue / prefill mean": f"{fmt_value(row['queue_mean_s'], 's')} / {fmt_value(row['prefill_mean_s'], 's')}"}
           if "queue_mean_s" in row else {}),
        "drive read": fmt_value(row["drive_read_gb_per_s"], "GB/s"),
        "queue p95": fmt_value(row["queue_depth_p95"], ""), "GPU power": fmt_value(row["mean_power_w"], "W"),
        "energy / request": fmt_value(row["energy_per_request_j"], "J"),
    } for _, row in load.iterrows()])


# What a reader compares across cells and levels (the gate, the rate achieved, TTFT p50 with its interval,
# goodput and the pool's reload rate); the rest of the load table's columns are the detail
LOAD_COMPARED = ["cell", "level", "gate", "achieved", "TTFT p50", "goodput", "KV loaded"]


def load_split(shown: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The load table as read (:func:`load_for_reading`) in two: the columns of :data:`LOAD_COMPARED`, and
    every other column beside the cell and level that name its row."""
    compared = [column for column in LOAD_COMPARED if column in shown]
    return shown[compared], shown[["cell", "level"] + [column for column in shown if column not in compared]]


def load_markdown(table: pd.DataFrame) -> str:
    """The load table as a person reads it (:func:`load_for_reading`), in Markdown."""
    if table.empty:
        return "No load level was measured.\n"
    return load_for_reading(table).to_markdown(index=False) + "\n"


@reads("workload", "slo_s", "engine", "random_model")
def run_load_table(config: dict, cells_run: list[Cell], *, reuse: dict, levels: dict, csv_out: str,
                   md_out: str, ceilings: list[str] | None = None) -> None:
    """``results/load.csv``: one row per cell and level (``c1`` is the cell's reuse phase; ``reuse``
    maps a cell to its reuse.csv, reuse.json, validity.json and telemetry summary; ``levels`` maps
    (cell, level) to the level's csv and json). Where the tiers' ``ceilings`` hold the host-to-GPU link,
    each level's KV loaded per second is also given as a share of it (``link_use``)."""
    table = load_table(config, cells_run, reuse, levels, ceilings)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text("# Under load: each cell's follow-ups per level\n\n" + load_markdown(table))

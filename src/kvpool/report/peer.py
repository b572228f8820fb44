"""The peer replay's table (kvpool.studies.peer: kvpool's client against ``vllm bench serve`` on the same
follow-ups) as a person reads it, and the rule's step that writes ``results/peer.csv`` and ``.md``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvpool.cells import Cell
from kvpool.studies.peer import cell_rows, peer_table


def peer_for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """The replay table as a person reads it: one row per cell or serving replica, each value with its
    unit."""
    return pd.DataFrame([{
        "cell": f"{r['backend']} / {r['arm']} / chunk {r['chunk']} / {r['tier']}", "replica": r["replica"],
        **({"replica order": r["order"]} if "order" in r else {}),
        "gate": "valid" if r["valid"] else "INVALID", "follow-ups": int(r["requests"]),
        "kvpool TTFT p50": f"{r['kvpool_ttft_p50_s']:.4g} s", "vllm bench TTFT p50": f"{r['vllm_ttft_p50_s']:.4g} s",
        "p50 difference": f"{r['p50_difference_pct']:+.1f}%",
        "paired change, median [95% CI]": f"{r['paired_median_change_pct']:+.1f}% "
                                          f"[{r['paired_median_change_ci_low_pct']:+.1f}, "
                                          f"{r['paired_median_change_ci_high_pct']:+.1f}]",
        "TTFT p99 basis": r.get("ttft_p99_basis", "p99"),
        "kvpool TTFT p99": f"{r['kvpool_ttft_p99_s']:.4g} s", "vllm bench TTFT p99": f"{r['vllm_ttft_p99_s']:.4g} s",
    } for _, r in table.iterrows()])


def peer_markdown(table: pd.DataFrame) -> str:
    if table.empty:
        return "No cell was replayed through vllm bench serve.\n"
    whole = cell_rows(table)
    replicas = table[~whole]
    text = ("# kvpool's client against vLLM's (`vllm bench serve`), the same follow-ups to the same replicas\n\n"
            + peer_for_reading(table[whole]).drop(columns="replica").to_markdown(index=False)
            + "\n\nkvpool's numbers are the cell's reuse phase; vLLM's are the replay on the pool restored to what "
            "populate left and a fresh fleet (`load~peer/`).\n")
    if len(replicas):
        text += ("\n## Per serving replica\n\nThe replay sends one replica's follow-ups after the other's; kvpool's "
                 "reuse phase alternates them.\n\n" + peer_for_reading(replicas).to_markdown(index=False) + "\n")
    return text


def run_peer_table(units: list[tuple[Cell, str]], *, reuse: dict, replays: dict, csv_out: str, md_out: str) -> None:
    """``results/peer.csv`` and its Markdown: per replay unit, kvpool's TTFT beside vLLM's client's
    (kvpool.studies.peer.peer_table, which says what ``units``, ``reuse`` and ``replays`` hold)."""
    table = peer_table(units, reuse, replays)
    table.to_csv(csv_out, index=False)
    Path(md_out).write_text(peer_markdown(table))

"""Where a follow-up's time to first token goes: results/breakdown.csv and its figure.

Each request sent alone carries its serving replica's own times: vLLM's queue, prefill and TTFT histograms
(their change around the request, kvpool.engine.metrics.TIMINGS) and, for a pool LMCache serves in the
replica's own process, LMCache's retrieve of the stored KV from its log, matched by the completion's id.
The client's TTFT then splits into parts that add up to it:

- ``queue``: waiting to be scheduled, the pool lookup included (vLLM's scheduler asks the connector how
  many tokens it holds before it schedules the request; LMCache does not time the lookup apart);
- ``transfer``: LMCache's retrieve of the stored KV into the replica's cache, inside the first model step;
- ``prefill``: the rest of that step: the tokens not loaded, and the first token;
- ``server_other``: the rest of the replica's own TTFT (tokenizing, the output's way out);
- ``client``: the client's TTFT beyond the replica's (the HTTP round trip, the stream's first chunk).

Where the backend's retrieve is not in the replica's log (the LMCache MP server does it in its own
process) the row says ``separable`` False, and the load sits in ``queue`` when the connector loads
asynchronously (the request waits for its KV before it is scheduled: the MP connector on the H200, where a
64K reload added 75 ms to the queue and nothing to the prefill) or in ``prefill`` when it loads inside the
model step. A part that comes out negative by more than a millisecond says the times do not nest as above:
the row is flagged (``nested`` False).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.measure.records import read_records
from kvpool.report.figures import placeholder_note, save, short_cell
from kvpool.settings import reads

PARTS = ["queue", "transfer", "prefill", "server_other", "client"]
TOLERANCE_S = 1e-3


def request_parts(records: pd.DataFrame) -> pd.DataFrame:
    """Each answered request's TTFT in ``PARTS`` (seconds), where its replica's times were read; with
    ``separable`` (the transfer measured apart) and ``nested`` (no part below zero)."""
    needed = ["queue_s", "prefill_s", "server_ttft_s"]
    if records.empty or not set(needed) <= set(records.columns):
        return pd.DataFrame(columns=["ttft_s", *PARTS, "separable", "nested"])
    ok = records[(records["error"].fillna("") == "") & records[needed].notna().all(axis=1)].copy()
    transfer = ok["retrieve_s"].astype(float) if "retrieve_s" in ok else pd.Series(np.nan, index=ok.index)
    separable = transfer.notna()
    queue, prefill = ok["queue_s"].astype(float), ok["prefill_s"].astype(float)
    parts = pd.DataFrame({
        "ttft_s": ok["ttft_s"].astype(float),
        "queue": queue,
        "transfer": transfer,
        "prefill": prefill - transfer.fillna(0.0),
        "server_other": ok["server_ttft_s"].astype(float) - queue - prefill,
        "client": ok["ttft_s"].astype(float) - ok["server_ttft_s"].astype(float),
    }, index=ok.index)
    parts["separable"] = separable
    parts["nested"] = (parts[PARTS].fillna(0.0) >= -TOLERANCE_S).all(axis=1)
    return parts


def breakdown_rows(unit: dict, records: pd.DataFrame, kv_bytes_per_token: int | None) -> pd.DataFrame:
    """``unit``'s identifying columns (cell, source, ...) beside each request's parts, its hit tokens and,
    where the transfer was measured, the transfer's rate in GB/s."""
    parts = request_parts(records)
    if parts.empty:
        return parts.assign(**unit)
    hits = records.loc[parts.index, "external_hit_tokens"].astype(float)
    parts.insert(0, "external_hit_tokens", hits)
    rate = hits * (kv_bytes_per_token or np.nan) / parts["transfer"] / 1e9
    parts["transfer_gb_per_s"] = rate.where(parts["transfer"] > 0)
    for key, value in reversed(list(unit.items())):
        parts.insert(0, key, value)
    return parts.reset_index(drop=True)


def summary(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per unit (``keys``), each part's median with the number of requests it rests on, and how many were
    separable and nested."""
    if rows.empty:
        return pd.DataFrame(columns=[*keys, "requests", *PARTS])
    grouped = rows.groupby(keys, sort=False, dropna=False)
    out = grouped[["ttft_s", *PARTS]].median()
    out.insert(0, "requests", grouped.size())
    out["separable"] = grouped["separable"].sum().astype(int)
    out["nested"] = grouped["nested"].sum().astype(int)
    return out.reset_index()


def for_reading(table: pd.DataFrame) -> pd.DataFrame:
    """The summary as a person reads it: each part's median in milliseconds, beside the TTFT's."""
    shown = table.copy()
    for column in ["ttft_s", *PARTS]:
        shown[column] = shown[column].map(lambda s: "n/a" if pd.isna(s) else f"{s * 1e3:.1f}")
    return shown.rename(columns={"ttft_s": "TTFT ms", **{part: f"{part} ms" for part in PARTS}})


def markdown(table: pd.DataFrame) -> str:
    """:func:`for_reading` in Markdown, with what n/a and the counts mean."""
    if table.empty:
        return "No request carried its replica's own times (a run from before kvpool read them).\n"
    shown = for_reading(table)
    note = ("Medians over each unit's requests sent one at a time; queue holds the pool lookup. `n/a` under "
            "transfer: the replica's log has no retrieve for the request, because it loaded nothing (the isolated "
            "arm, a cold step) or because its backend retrieves in a process of its own (the LMCache MP server), "
            "whose load is then in queue (an asynchronous load, before the request is scheduled) or in prefill. "
            "`separable` counts requests whose transfer was measured, `nested` those whose parts are all at least "
            "zero.")
    return shown.to_markdown(index=False) + f"\n\n{note}\n"


def figure(table: pd.DataFrame):
    """Stacked bars: each unit's median parts, which add up to about its median TTFT."""
    from plotnine import aes, coord_flip, geom_col, ggplot, labs, theme, theme_bw

    if table.empty:
        return placeholder_note("Where the TTFT goes", "no request carried its replica's own times")
    long = table.assign(unit=table["cell"].map(short_cell) + " " + table["source"])
    long = long.melt(id_vars=["unit"], value_vars=PARTS, var_name="part", value_name="seconds").dropna()
    long["part"] = pd.Categorical(long["part"], categories=list(reversed(PARTS)), ordered=True)
    return (ggplot(long, aes("unit", "seconds", fill="part")) + geom_col() + coord_flip() + theme_bw()
            + theme(figure_size=(9, 1.2 + 0.45 * long["unit"].nunique()))
            + labs(title="Where a follow-up's TTFT goes (medians)", x="", y="seconds"))


@reads("engine", "random_model")
def run_breakdown(config: dict, units: list[dict], csvs: list[str], *, csv_out: str, md_out: str,
                  figure_dir: str) -> None:
    """results/breakdown.csv (each request's parts), .md (per unit medians) and its figure; ``units`` name
    each csv's cell and source (``reuse`` or ``doc~<tokens>``)."""
    per_token = engine_pool_bytes_per_token(config)
    frames = []
    for unit, path in zip(units, csvs, strict=True):
        records = read_records(path)
        if "step" in records:  # a length unit's chains: the cold prefill and each reload step apart
            frames += [breakdown_rows({**unit, "source": f"{unit['source']} {step}"}, part, per_token)
                       for step, part in records.groupby("step", sort=False)]
        else:
            frames.append(breakdown_rows(unit, records, per_token))
    rows = pd.concat([f for f in frames if not f.empty], ignore_index=True) if any(not f.empty for f in frames) \
        else pd.DataFrame(columns=["cell", "source", "external_hit_tokens", "ttft_s", *PARTS])
    rows.to_csv(csv_out, index=False)
    table = summary(rows, ["cell", "source"])
    Path(md_out).write_text("# Where a follow-up's TTFT goes\n\n" + markdown(table))
    save(figure(table), Path(figure_dir), "breakdown")

"""The report: Study A's figures and what the study did not show, from measured results alone.

Its tables are the run's (computed in kvpool.studies, written by their rules); what is read here is every
request and sample behind the figures, the caveats and the servers' counters. Nothing is
re-measured. Invalid cells are drawn and listed, flagged, and kept out of every aggregate.
"""

from __future__ import annotations

import base64
import html
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from kvpool.cells import Arm, Cell
from kvpool.engine.backends import pool_backend
from kvpool.measure import kvbytes
from kvpool.measure.checks import skipped, tally
from kvpool.measure.files import read_frame_or_empty, read_json
from kvpool.measure.records import read_records
from kvpool.measure.telemetry import energy_mean_power
from kvpool.measure.validity import failures
from kvpool.report import breakdown, capacity, figures, trace
from kvpool.report.figures import ROUTER_FIGURES
from kvpool.report.gate import judge
from kvpool.report.lede import first_sentence, scope_words
from kvpool.report.load import load_for_reading, load_split
from kvpool.report.peer import peer_for_reading
from kvpool.report.reading import (
    cells_for_reading,
    contexts_for_reading,
    crossover_for_reading,
    fold_maxima,
    headline_for_reading,
    kv_bytes_for_reading,
    locality_for_reading,
    pool_servers_for_reading,
    routers_for_reading,
    sessions_for_reading,
    tiers_for_reading,
    windows_for_reading,
)
from kvpool.studies.studyb import gate_failures
from kvpool.studies.tables import headline


@dataclass
class Results:
    """A finished run's measurements, one frame per kind, every row tagged with its cell."""

    cells: pd.DataFrame            # one row per cell: keys, valid, reasons, wall clock, power, ...
    requests: pd.DataFrame         # every reuse follow-up
    drive: pd.DataFrame            # every drive sample (populate and reuse)
    power: pd.DataFrame            # every power / replica sample
    tiers: dict                    # tier -> ceiling record
    manifest: dict
    config: dict
    notes: list[str] = field(default_factory=list)


# What the page reads of each cell, as its rule declares the files (one list per name, in cell order)
CELL_FILES = ("validity", "reuse", "reuse_meta", "populate_meta", "manifest", "telemetry", "drive", "power")


def collect(cells: list[Cell], files: dict[str, list[str]], ceilings: list[str], config: dict) -> Results:
    """Read every cell's records from the paths its rule declares (``files``: each of ``CELL_FILES`` to one
    path per cell, in ``cells`` order) and the tier ceilings (``ceilings``: results/tiers/<tier>/ceiling.json)."""
    missing = [name for name in CELL_FILES if len(files.get(name, [])) != len(cells)]
    if missing:
        raise ValueError(f"the report needs one {', '.join(missing)} file per cell ({len(cells)} cells)")
    rows, requests, drives, powers = [], [], [], []
    manifest = {}
    for i, cell in enumerate(cells):
        path = {name: files[name][i] for name in CELL_FILES}
        validity = read_json(path["validity"])
        keys = {**cell.keys(), "valid": validity["valid"]}
        records = read_records(path["reuse"])
        requests.append(records.assign(**keys))
        reuse_meta = read_json(path["reuse_meta"])
        window = read_json(path["telemetry"])
        manifest = manifest or read_json(path["manifest"])
        origin = window["populate"]["started_at"]
        for name, frames in (("drive", drives), ("power", powers)):
            frame = read_frame_or_empty(path[name])
            if len(frame.columns):  # no file rows at all: the phase sampled no drive
                frames.append(frame.assign(**keys, since_start_s=frame["t_s"] - origin))
        power = energy_mean_power(window["reuse"]["power"], window["reuse"].get("duration_s"))
        followups = max(1, len(records))
        rows.append({
            **keys,
            "reasons": "; ".join(failures(validity)),
            # a check that could not fail here, or could not be made, is said so, never shown as passed
            "checks_passed": tally(validity["checks"])["passed"], "skipped": "; ".join(skipped(validity)),
            "followups": len(records),
            "errors": int((records["error"].fillna("") != "").sum()),
            "wall_s": reuse_meta["wall_s"],
            "mean_power_w": power["mean_power_w"],
            "energy_per_followup_j": power["energy_per_request_j"],
            "replica_cpu_s_per_followup": sum(r["cpu_s"] for r in power["replicas"].values()) / followups,
            "read_gb_per_s": window["reuse"]["drive"].get("read_gb_per_s"),
            "read_active_gb_per_s": window["reuse"]["drive"].get("read_active_gb_per_s"),
            "cold_reads": _cold_read_note(reuse_meta["drop_before_reuse"]),
            "phases": {p: (window[p]["started_at"] - origin, window[p]["finished_at"] - origin)
                       for p in ("populate", "reuse")},
        })
    tiers = {Path(ceiling).parent.name: read_json(ceiling) for ceiling in ceilings}
    return Results(pd.DataFrame(rows), pd.concat(requests, ignore_index=True),
                   pd.concat(drives, ignore_index=True) if drives else pd.DataFrame(),
                   pd.concat(powers, ignore_index=True) if powers else pd.DataFrame(), tiers, manifest, config)


def _cold_read_note(drop: dict) -> str:
    if drop["memory_backed"]:
        return "memory-backed tier (no device read to force)"
    return f"verified: {100 * drop['resident_fraction']:.2f}% of {drop['bytes'] / 1e6:.0f} MB resident before reuse"


def pool_server_table(cells: list[Cell], files: dict[str, list[str]]) -> pd.DataFrame:
    """What each pool server counted per phase (``pool_server`` in populate.json and reuse.json, from
    ``files`` as ``collect`` takes them): an lmcache-mp server's lookups, L1 and L2 chunks, L1 bytes held
    at the phase's end and L2 stores pending; a Redis server's chunks, their KV bytes and its own memory
    at the phase's end."""
    rows = []
    for i, cell in enumerate(cells):
        if pool_backend(cell.backend).server_kind is None:
            continue
        for phase in ("populate", "reuse"):
            meta = read_json(files[f"{phase}_meta"][i])
            for server, record in meta.get("pool_server", {}).items():
                counters = {name.removeprefix("lmcache_mp_"): value for name, value in record["metrics"].items()}
                rows.append({"cell": cell.name, "phase": phase, "server": int(server),
                             "pending_l2_stores": record["drain"]["pending_l2_stores"], **counters})
    return pd.DataFrame(rows)


def caveats(results: Results) -> list[str]:
    """What a reader must know before quoting a number, generated from this run."""
    cfg, engine = results.config, results.config["engine"]
    notes = [
        "Concurrency 1: follow-ups are sent one at a time, so these figures describe a lightly loaded fleet.",
        f"Scope: {cfg['replicas']} replicas of {engine['model'] or 'a random-weights model built locally'} "
        f"({engine['kind']}), {cfg['workload']['documents']} documents of {cfg['workload']['doc_tokens']} tokens, "
        "one machine, one router policy (round robin, never prefix aware).",
        "Hash keys: " + ("PYTHONHASHSEED=0 on every replica." if cfg["hash_keys"] == "pythonhashseed"
                         else "LMCache sha256_cbor content hash.") + " The populate preflight checked them.",
    ]
    notes += [pool.caveat for pool in dict.fromkeys(map(pool_backend, results.cells["backend"]))
              if pool.caveat is not None]
    for _, cell in results.cells.iterrows():
        notes.append(f"Cold reads, {cell['cell']}: {cell['cold_reads']}.")
    if results.cells["mean_power_w"].isna().all():
        notes.append("No GPU power source on this machine (NVML unavailable): power figures show replica CPU "
                     "seconds per follow-up instead, and energy per follow-up is not measured.")
    invalid = results.cells[~results.cells["valid"]]
    if len(invalid):
        notes.append(f"{len(invalid)} cell(s) failed the validity gate; they are drawn and listed, flagged, and "
                     "left out of every ratio.")
    return notes


def image_data_uri(path: Path | str) -> str:
    path = Path(path)  # a section may name its figure as a string (the length units' did, and failed here)
    kind = "svg+xml" if path.suffix == ".svg" else "png"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def render_page(template: Path, out: Path, context: dict) -> None:
    """Fill the Jinja2 page template; figures are embedded, so the page opens offline on its own."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(template.parent), autoescape=select_autoescape(["html"]))
    env.filters["data_uri"] = image_data_uri
    env.filters["to_yaml"] = lambda data: yaml.safe_dump(data, sort_keys=False, width=120)
    out.write_text(env.get_template(template.name).render(**context))


def verdict(cells: pd.DataFrame, failed: list[str], counted: list[str], studyb: dict | None = None) -> dict:
    """The page's first line, from the run's gate (kvpool.report.gate.judge: ``failed`` holds a line per
    failure, ``counted`` the units beyond the cells it rests on): valid only where the gate will pass."""
    valid = not failed
    parts = [f"{int(cells['valid'].sum())} of {len(cells)} cells valid", *(f"{unit} judged" for unit in counted)]
    if studyb is not None:
        parts.append("Study B's blocks " + ("valid" if studyb["valid"] else "INVALID"))
    return {"valid": valid, "word": "VALID" if valid else "INVALID",
            "text": "; ".join(parts) + ("." if valid else ". Failed: " + "; ".join(line.strip() for line in failed))}


def build_report(config: dict, cells: list[Cell], files: dict[str, list[str]], ceilings: list[str], *,
                 cell_table: str, table1_csv: str,
                 tier_table: str | None,
                 kv_bytes: str | None, out_html: str, figures_dir: str, tables_dir: str,
                 load: str | None = None, studyb: dict | None = None, peer: str | None = None,
                 routers: str | None = None, contexts: str | None = None,
                 breakdown: str | None = None, capacity: str | None = None, trace_csv: str | None = None) -> None:
    """Figures (PNG, SVG) and the self-contained page from the run's tables (``cell_table``,
    ``tier_table``, ``kv_bytes``: computed once, by their rules; None where a partial run has none)
    and, for the figures that draw every request and sample, the cells' records (``files`` and
    ``ceilings``, the paths the rule declares: see ``collect``)."""
    results = collect(cells, files, ceilings, config)
    tables, figs = Path(tables_dir), Path(figures_dir)
    tables.mkdir(parents=True, exist_ok=True)
    table1 = pd.read_csv(cell_table, keep_default_na=False, na_values=[""])
    table1["valid"] = table1["valid"].astype(bool)
    table2 = pd.read_csv(tier_table).merge(table1[["cell", "valid"]], on="cell") if tier_table else pd.DataFrame()
    table1_long = pd.read_csv(table1_csv)
    head = headline(table1_long)
    servers = pool_server_table(cells, files)
    for name, frame in (("table1", table1), ("table2", table2), ("headline", head), ("pool_server", servers)):
        frame.to_csv(tables / f"{name}.csv", index=False)
        (tables / f"{name}.md").write_text(frame.to_markdown(index=False, floatfmt=".4g") + "\n")
    study = [("fig1_ttft_p50", figures.ttft_p50(table1)), ("fig2_ttft_p99", figures.ttft_p99(table1)),
             ("fig3_wall_clock", figures.wall_clock(table1)), ("fig4_power", figures.power(table1))]
    extra = [("ttft_ecdf", figures.ttft_ecdf(results.requests)),
             ("timeline", figures.timeline(results.drive, results.power, results.cells))]
    if table1["energy_per_followup_j"].notna().any():
        extra.append(("energy_per_followup", figures.energy(table1)))
    else:
        extra.append(("energy_per_followup", figures.placeholder_note(
            "Energy per follow-up", "not measured on this machine: no GPU energy counter")))
    rates = table2[["drive_read_active_gb_per_s", "ceiling_read_gb_per_s"]].astype(float) if len(table2) \
        else pd.DataFrame()
    why_not = "no drive read and no ceiling measured" if len(table2) else "no shared arm: no reload to compare"
    extra.append(("reload_efficiency", figures.reload_efficiency(table2)) if rates.notna().any().any()
                 else ("reload_efficiency", figures.placeholder_note(
                     "Reload read rate against the measured ceiling", why_not)))
    if table1["chunk"].nunique() > 1:
        extra.append(("ttft_by_chunk", figures.by_chunk(table1)))
    levels = pd.read_csv(load) if load and Path(load).exists() else pd.DataFrame()
    under_load = []
    if len(levels) and (levels["level"] != "c1").any():
        under_load.append(("load_ttft", figures.load_ttft(levels)))
        under_load.append(("load_throughput", figures.load_throughput(levels)))
        if (levels["level_kind"] == "rate").any():
            under_load.append(("load_goodput", figures.load_goodput(levels)))
        rates = levels.reindex(columns=["drive_read_gb_per_s", "loaded_gb_per_s"]).notna().any(axis=1)
        if (rates & (levels["arm"] == Arm.SHARED)).any():
            ceilings = (table2[["backend", "chunk", "tier", "ceiling_read_gb_per_s"]].drop_duplicates() if len(table2)
                        else pd.DataFrame(columns=["backend", "chunk", "tier", "ceiling_read_gb_per_s"]))
            under_load.append(("load_reload_rate", figures.load_reload_rate(levels, ceilings)))
    drawn = {}
    for stem, plot in study + extra + under_load:
        # the page captions these with their titles: drawn without them, so the title is read once
        drawn[stem] = {**figures.save(figures.untitled(plot), figs, stem), "title": plot.labels.get("title", stem)}
    manifest = results.manifest
    studyb_part = _studyb_section(studyb) if studyb else None
    failed, counted, *_ = judge(results.cells[["cell", "valid", "reasons"]],
                                kv_bytes if kv_bytes and Path(kv_bytes).exists() else None, load,
                                studyb["validity"] if studyb else None, peer, routers, contexts, capacity,
                                trace_csv)
    render_page(Path(__file__).with_name("templates") / "report.html.j2", Path(out_html), {
        "lede": first_sentence(table1_long, scope_words(config, manifest), failed),
        "verdict": verdict(results.cells, failed, counted, studyb_part),
        "headline_figure": drawn["fig1_ttft_p50"],
        "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git": manifest.get("git", {}), "versions": {k: v for k, v in manifest.get("versions", {}).items() if v},
        "hardware": manifest.get("hardware", {}), "config": config, "tiers": results.tiers,
        "cells": results.cells.to_dict("records"),
        "headline_html": _folded_html(*fold_maxima(headline_for_reading(head), {"TTFT p99": head["ttft_p99_basis"]},
                                                   ["setting"])),
        "table1_html": _folded_html(*fold_maxima(cells_for_reading(table1), {
            f"TTFT p{q}": table1.get(f"ttft_p{q}_basis") for q in (95, 99)}, ["cell"])),
        "table2_html": _html(tiers_for_reading(table2)) if len(table2) else _html(table2),
        "study_figures": [drawn[s] for s, _ in study[1:]], "extra_figures": [drawn[s] for s, _ in extra],
        "caveats": caveats(results),
        "kv_bytes_html": _kv_bytes_html(Path(kv_bytes) if kv_bytes else None),
        "pool_server_html": _html(pool_servers_for_reading(servers)) if len(servers) else "",
        "load_html": _folded_html(*load_split(load_for_reading(levels)), "Every other column: the tail, "
                                  "the answers, the output, errors, the drive and the power") if len(levels) else "",
        "peer_html": _peer_html(peer) if peer else "",
        "routers": _routers_section(routers) if routers else None,
        "contexts": _contexts_section(contexts) if contexts else None,
        "capacity": _capacity_section(capacity) if capacity else None,
        "trace": trace.section(trace_csv) if trace_csv else None,
        "breakdown": _breakdown_section(breakdown) if breakdown else None,
        "load_figures": [drawn[s] for s, _ in under_load],
        "studyb": studyb_part,
    })


def _studyb_section(files: dict) -> dict:
    """Study B's part of the page (``files``: its validity.json, locality.csv, sessions summary,
    figures folder, windows table, crossover table and its figure's folder): the verdict, the tables
    and the figures."""
    gate = read_json(files["validity"])
    # the page's columns; the CSVs hold every one, observations included
    locality = pd.read_csv(files["locality"])[
        ["context", "step", "off_ttft_median_s", "on_ttft_median_s", "on_local_hit_tokens", "on_external_hit_tokens",
         "mean_paired_change_pct", "change_ci_low_pct", "change_ci_high_pct", "pairs_matched", "outputs_equal"]]
    sessions = pd.read_csv(files["sessions"])[
        ["placement", "off_wall_median_s", "on_wall_median_s", "mean_paired_change_pct", "change_ci_low_pct",
         "change_ci_high_pct", "turn_ttft_change_pct", "decode_change_pct", "turns_matched", "outputs_equal"]]
    windows = pd.read_csv(files["windows"])[
        ["window", "placement", "off_tokens_per_s_median", "on_tokens_per_s_median", "mean_paired_change_pct",
         "change_ci_low_pct", "change_ci_high_pct", "off_turn_ttft_median_s", "on_turn_ttft_median_s"]]
    crossover = pd.read_csv(files["crossover"])[
        ["context", "prefill_s", "reload_s", "speedup", "prefill_fit_s", "reload_fit_s", "break_even_read_gbps",
         "fit_read_gbps", "fit_overhead_s", "crossover_tokens"]]
    figures_dir = Path(files["figures"])
    crossover_shown, crossover_fit = crossover_for_reading(crossover)
    return {"valid": gate["valid"], "failures": gate_failures(gate), "blocks": list(gate["blocks"]),
            "pool": f"{gate['backend']} (chunk {gate['chunk']}, tier {gate['tier']})",
            "locality_html": _html(locality_for_reading(locality)),
            "sessions_html": _html(sessions_for_reading(sessions)),
            "windows_html": _html(windows_for_reading(windows)) if len(windows) else None,
            "crossover_html": _html(crossover_shown), "crossover_fit": crossover_fit,
            "figures": [{"png": figures_dir / f"{stem}.png", "title": title} for stem, title in
                        (("locality", "Locality chains: TTFT per step, OFF and ON"),
                         ("sessions", "Sessions: wall time per session, OFF and ON"))]
            + [{"png": Path(files["crossover_figures"]) / "crossover.png",
                "title": "Where the pool pays: prefill and reload against context, measured and fitted"}]}


def _kv_bytes_html(path: Path | None) -> str:
    if path is None or not path.exists():
        return "<p>Not computed for this run (no pool digests).</p>"
    table = pd.read_csv(path, keep_default_na=False)
    findings = "".join(f"<p><b>Finding, {backend} chunk {chunk} {tier}:</b> {html.escape(found)}</p>"
                       for (backend, chunk, tier), _, found in kvbytes.findings(table))
    return _html(kv_bytes_for_reading(table)) + findings + "<ul>" + "".join(
        f"<li><b>{name}</b>: {meaning}</li>" for name, meaning in kvbytes.COMPARISONS.items()) + "</ul>"


def _routers_section(routers_csv: str) -> dict:
    """The report's routers section: the table of results/routers.csv and its figures beside it."""
    folder = Path(routers_csv).with_suffix("")  # run_router_table's figures folder
    return {"html": _html(routers_for_reading(pd.read_csv(routers_csv))),
            "figures": [{"png": str(folder / f"{stem}.png"), "title": title}
                        for stem, (_, title) in ROUTER_FIGURES.items()]}


def _breakdown_section(breakdown_csv: str) -> dict:
    """The report's TTFT breakdown: each unit's medians (kvpool.report.breakdown) and its figure beside it."""
    rows = pd.read_csv(breakdown_csv)
    table = breakdown.summary(rows, ["cell", "source"]) if len(rows) else pd.DataFrame()
    return {"html": _html(breakdown.for_reading(table)) if len(table) else "<p>No request carried its replica's own "
            "times (a run from before kvpool read them).</p>",
            "figure": Path(breakdown_csv).parent / "figures" / "breakdown.png"}


def _capacity_section(capacity_csv: str) -> dict:
    """The report's pool-capacity section: results/capacity.csv and its figure beside it."""
    folder = Path(capacity_csv).with_suffix("")  # run_capacity_table's figures folder
    table = pd.read_csv(capacity_csv)
    return {"html": _html(capacity.for_reading(table)), "intro": capacity.INTRODUCTION,
            "numbers": [line.removeprefix("- ").replace("**", "") for line in capacity.operators_numbers(table)],
            "figure": str(folder / "capacity.png")}


def _contexts_section(contexts_csv: str) -> dict:
    """The report's document-length section: results/contexts.csv and its figure beside it."""
    folder = Path(contexts_csv).with_suffix("")  # run_contexts_table's figures folder
    return {"html": _html(contexts_for_reading(pd.read_csv(contexts_csv))),
            "figure": str(folder / "contexts.png")}


def _peer_html(peer_csv: str) -> str:
    table = pd.read_csv(peer_csv, dtype={"replica": str})
    return _html(peer_for_reading(table)) if len(table) else ""


def _folded_html(shown: pd.DataFrame, folded: pd.DataFrame, summary: str) -> str:
    """A table as read, and below it, collapsed, the columns folded out of it (none: the table alone)."""
    if folded.empty:
        return _html(shown)
    return f"{_html(shown)}<details><summary>{html.escape(summary)}</summary>{_html(folded)}</details>"


def _html(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "<p>Nothing to show: the matrix has no cell of this kind.</p>"
    return frame.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="n/a", border=0)

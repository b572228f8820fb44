"""Study B's page (``results/studyb.md``: the design as run, the gate, Table 3, Table 4 and the windows)
and the rule's step that writes its tables (computed in kvpool.studies.studyb_tables), gate and figures."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pandas as pd

from kvpool.measure.files import write_json
from kvpool.report import figures
from kvpool.report.format import change_cells, fmt_value, markdown_table, pct
from kvpool.settings import reads
from kvpool.studies.studyb import gate_failures
from kvpool.studies.studyb_tables import studyb_tables

log = logging.getLogger(__name__)


def _agreement_lines(gate: dict) -> list[str]:
    """What the page says of the ON/OFF twins' answers: an observation, the gate being each ON block's
    answers against a recompute in their own split."""
    found = gate.get("information", {}).get("outputs_equal_across_pairs")
    if not found:
        return []
    return [f"ON answers equal to their OFF twin's: {found['equal']} of {found['of']} (an observation: a twin "
            "computes its prompt in another split wherever the pool gave more than the replica's own cache; each ON "
            "block's gate compares its answers with a pool-less recompute in their own split).", ""]


def _waits_lines(study: dict, waited_s: float | None, windows: bool) -> list[str]:
    """What the page says where the records hold waits for a pool that stores after the answer (vllm-fs): its
    chain steps and session turns waited for the stores before them, its windows did not."""
    if waited_s is None:
        return []
    line = (f"{study['backend']} stores after the answer: each chain step and session turn first waited for the "
            f"stores of the requests before it ({waited_s:.1f} s in all, `stores_waited_s`, left out of the "
            "sessions' wall times).")
    if windows:
        line += " The windows' turns did not wait, as a user's would not: a turn may find less of its session stored."
    return [line, ""]


def markdown(study: dict, names: list[str], gate: dict, locality: pd.DataFrame, sessions: pd.DataFrame,
             figures: list[str], windows: pd.DataFrame | None = None, waited_s: float | None = None) -> str:
    """Study B's page: the design as run, the gate, Table 3 (locality) and Table 4 (sessions); ``waited_s``,
    the seconds a pool that stores after the answer was waited for (None: no request waited)."""
    verdict = "VALID" if gate["valid"] else "INVALID: " + "; ".join(gate_failures(gate))
    has_windows = windows is not None and not windows.empty
    lines = [f"# Study B's design: {study['backend']} (chunk {study['chunk']}, tier {study['tier']}), ON against OFF",
             "", f"Blocks in run order: {', '.join(names)}. Each block restarts the fleet (and empties the ON pool); "
             f"{study['warmups']} warm-ups per replica are recorded and left out. ON and OFF requests pair by "
             "payload SHA-256 and replica; the change is 100 x (ON / OFF - 1), its interval a bootstrap across "
             "block pairs (three pairs or more); a change is called higher or lower only where its interval "
             "excludes 0.",
             "", f"**Gate: {verdict}.**", "", *_agreement_lines(gate), *_waits_lines(study, waited_s, has_windows),
             "## Locality chains (Study B's Table 3)", ""]
    lines += markdown_table(
        ["context", "step", "OFF median", "ON median", "ON external hit tokens", "mean paired change", "95% CI",
         "pairs (outputs equal)"],
        ([row.context, row.step, fmt_value(row.off_ttft_median_s, "s"), fmt_value(row.on_ttft_median_s, "s"),
          fmt_value(row.on_external_hit_tokens, "count"), *change_cells(row),
          f"{row.pairs_matched} ({row.outputs_equal})"]
         for row in locality.itertuples()))
    lines += ["", "## Sessions (Study B's Table 4)", ""]
    lines += markdown_table(
        ["placement", "OFF median wall", "ON median wall", "mean paired change", "95% CI", "turn TTFT change",
         "decode rate change", "turns paired (outputs equal)"],
        ([row.placement, fmt_value(row.off_wall_median_s, "s"), fmt_value(row.on_wall_median_s, "s"),
          *change_cells(row), pct(row.turn_ttft_change_pct), pct(row.decode_change_pct),
          f"{row.turns_matched} ({row.outputs_equal})"]
         for row in sessions.itertuples()))
    if has_windows:
        lines += ["", "## Short concurrency windows", "",
                  f"Per window, W sessions of {study['window_turns']} turns sent at once; output tokens per second "
                  "over the window's wall time. Hits from each response's cached tokens; answers not paired.", ""]
        lines += markdown_table(
            ["sessions at once", "placement", "OFF median", "ON median", "mean paired change", "95% CI",
             "turn TTFT OFF / ON"],
            ([row.window, row.placement, f"{fmt_value(row.off_tokens_per_s_median, '')} tok/s",
              f"{fmt_value(row.on_tokens_per_s_median, '')} tok/s", *change_cells(row),
              f"{fmt_value(row.off_turn_ttft_median_s, 's')} / {fmt_value(row.on_turn_ttft_median_s, 's')}"]
             for row in windows.itertuples()))
    lines += [""] + [f"![{Path(link).stem}]({link})" for link in figures]
    return "\n".join(lines) + "\n"


@reads("backends", "tiers", "chunk_sizes", "engine", "workload", "replicas")
def run_studyb_tables(config: dict, study: dict, blocks: dict, *, locality_csv: str, sessions_csv: str,
                      summary_csv: str, validity_out: str, md_out: str, figures_dir: str,
                      windows_csv: str | None = None, missing: str = "") -> None:
    """Study B's tables from every block (``blocks``: name -> requests.csv and block.json): the
    locality chains (``locality_csv``), every session turn (``sessions_csv``) and the sessions per
    placement (``summary_csv``), the study's gate (each block's checks and the ON/OFF pairing) and a
    Markdown page with the tables and figures. With no block (``missing`` says why), the page and the
    gate's record say that nothing was measured, and why, and the tables are empty."""
    if not blocks:
        for table in (locality_csv, sessions_csv, summary_csv, windows_csv):
            if table:
                Path(table).write_text("")
        write_json(validity_out, {"valid": False, "blocks": {}, "checks": {}, "not_measured": missing})
        Path(figures_dir).mkdir(parents=True, exist_ok=True)
        Path(md_out).write_text(f"# Study B's design\n\nNo block of Study B was measured: {missing}.\n")
        log.warning("Study B: no block measured: %s", missing)
        return
    found = studyb_tables(config, study, blocks)
    found.locality.to_csv(locality_csv, index=False)
    found.turns.to_csv(sessions_csv, index=False)
    found.sessions.to_csv(summary_csv, index=False)
    if windows_csv:
        found.windows.to_csv(windows_csv, index=False)
    write_json(validity_out, found.gate)
    folder = Path(figures_dir)
    folder.mkdir(parents=True, exist_ok=True)
    drawn = [figures.save(figures.locality(found.rows), folder, "locality"),
             figures.save(figures.sessions(found.walls), folder, "sessions")]
    links = [os.path.relpath(d["png"], Path(md_out).parent) for d in drawn]
    waits = found.rows.get("stores_waited_s", pd.Series(dtype=float)).dropna()
    Path(md_out).write_text(markdown(study, found.names, found.gate, found.locality, found.sessions, links,
                                     found.windows, float(waits.sum()) if len(waits) else None))
    if not found.gate["valid"]:
        log.error("Study B is INVALID: %s", gate_failures(found.gate))

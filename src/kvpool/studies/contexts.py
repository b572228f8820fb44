"""Document length as a dimension of the matrix: per shared cell (its backend, chunk and tier) and per
length in ``contexts.doc_tokens``, one unit ``results/cells/<cell>/doc~<tokens>/``. A unit is one fleet on
a fresh pool of the cell's kind sending, per document, Study B's locality chain (kvpool.studies.studyb.CHAIN):
cold on replica A (the prefill), local on A twice (its own cache), then the pool dropped from the page
cache and checked, cross-replica on B (a reload from the tier's device) and local on B.

Per cell, the lengths' medians make ``results/contexts.csv``: cold, shared-pool and local-hit TTFT
against the document's length, with kvpool.studies.crossover's prefill and reload models fitted to them, so each
tier states the length from which its reload beats the prefill and, per length, the read rate below
which it would stop paying. Both models are fitted over the prompt's tokens (the document and its
question: what the cold step computes and, in whole chunks, what the cross step loads), and a length's
KV bytes are the tokens its cross steps measurably loaded. A new length builds only its units.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from kvpool.cells import Arm, Cell, run_pools
from kvpool.engine.backends import pool_backend
from kvpool.engine.model import vocabulary
from kvpool.engine.plan_types import Plan
from kvpool.matrix import cells as matrix_cells
from kvpool.measure import provenance, reference
from kvpool.measure.checks import NOT_APPLICABLE, check, status, verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.measure.timed import (
    chain_fleet,
    drop_pool,
    recompute_in_splits,
    recording_sends,
    write_unit,
)
from kvpool.measure.unit import UnitPaths, run_unit
from kvpool.measure.unit_plan import checked_ports, new_plan, unit_pool
from kvpool.measure.validity import cold_reads, with_served
from kvpool.settings import PHASE_SETTINGS, reads
from kvpool.studies import crossover, studyb
from kvpool.studies.chain_stores import stores_landed
from kvpool.studies.studyb import run_block

BLOCK = "contexts-on"  # the rows' block name: kvpool.studies.studyb's ON arm, the only one a unit runs
LOCAL_STEPS = ("local-1", "local-2")
COLUMNS = ["cell", "backend", "chunk", "tier", "context", "prompt_tokens", "valid", "chains", "prefill_s", "local_s",
           "reload_s", "speedup", "loaded_tokens", "kv_bytes", "prefill_fit_s", "reload_fit_s",
           "break_even_read_gbps", "fit_read_gbps", "fit_overhead_s", "crossover_tokens", "drive_read_gb_per_s"]


def lengths(config: dict) -> list[int]:
    return list(config["contexts"]["doc_tokens"])


def cells(config: dict) -> list[Cell]:
    """The matrix's shared-pool cells a length sweep runs on: one per backend that shares, chunk and tier."""
    return [cell for cell in matrix_cells(config) if cell.arm == Arm.SHARED and pool_backend(cell.backend).shares]


def units(config: dict) -> list[tuple[Cell, int]]:
    return [(cell, tokens) for cell in cells(config) for tokens in lengths(config)]


def problems(config: dict) -> list[str]:
    """What keeps the configured lengths from running, each naming the setting."""
    tokens = lengths(config)
    if not tokens:
        return []
    found = []
    if not cells(config):
        found.append("contexts.doc_tokens needs a shared-pool cell: add shared to arms and a backend that shares "
                     "(lmcache-fs, lmcache-mp, lmcache-redis)")
    partial = sorted({t for t in tokens for chunk in config["chunk_sizes"] if t % chunk})
    if partial:
        found.append(f"contexts.doc_tokens {partial} are not whole chunks of chunk_sizes {config['chunk_sizes']}: "
                     "a cross-replica hit could not cover the document")
    longest = max(tokens) + config["workload"]["followup_tokens"] + config["workload"]["output_tokens"]
    if longest > config["engine"]["max_model_len"]:
        found.append(f"contexts.doc_tokens {max(tokens)} with its {config['workload']['followup_tokens']} follow-up "
                     f"and {config['workload']['output_tokens']} answer tokens needs {longest}, more than "
                     f"engine.max_model_len {config['engine']['max_model_len']}")
    if config["replicas"] < 2:
        found.append("contexts.doc_tokens needs two replicas or more (a cross-replica step)")
    return found


def chain_study(config: dict, cell: Cell, tokens: int) -> dict:
    """The study kvpool.studies.studyb's workload, block and checks read for one unit: ``contexts.chains``
    documents of ``tokens``, each followed by a question of ``workload.followup_tokens``, chains only."""
    return {"contexts": [tokens], "chains": config["contexts"]["chains"], "seed": config["contexts"]["seed"] + tokens,
            "question_tokens": config["workload"]["followup_tokens"], "chunk": cell.chunk, "placements": [],
            "sessions": 0, "turns": 0, "turn_tokens": 0, "session_tokens": 0, "windows": [], "window_turns": 0,
            "warmups": 0}


def unit_checks(rows: pd.DataFrame, drops: list[dict], study: dict, min_hit_fraction: float,
                max_resident_fraction: float, reference: pd.DataFrame | None = None) -> dict:
    """Study B's chain checks (no errors, cold finds nothing, cross nothing locally and the whole
    document in the pool, every answer equal to a pool-less recompute in its split: ``reference``) and
    a cold device read before every cross-replica step."""
    checks = studyb.block_checks(rows, studyb.ON, study, min_hit_fraction, reference)
    checks.pop("every_turn_answered")  # a unit sends no sessions
    reads = [cold_reads(drop, max_resident_fraction) for drop in drops]
    chains = int((rows["step"] == "cross").sum())
    if reads and all(status(r) == NOT_APPLICABLE for r in reads):
        checks["cold_reads"] = reads[0]
    else:
        checks["cold_reads"] = check(len(reads) == chains and all(r["ok"] for r in reads),
                                     [r["value"] for r in reads], max_resident_fraction)
    return checks


def answer_agreement(rows: pd.DataFrame) -> dict:
    """Observations beside the gate: chains whose cold answer equals their reuse steps', and whose pool
    answer (cross) equals their own cache's (local): each pair computes the prompt in different splits."""
    chains = rows[rows["kind"] == "chain"]
    reuse = studyb.chains_agree(chains[chains["step"] != "cold"])
    every = studyb.chains_agree(chains)
    return {"chains": len(every), "cold_agrees": int(every.sum()), "pool_agrees_with_own_cache": int(reuse.sum())}


def unit_row(cell: Cell, tokens: int, rows: pd.DataFrame, valid: bool, drive_read_gb_per_s: float | None) -> dict:
    """One unit's medians: the prefill (cold), its own cache (local on A) and the pool (cross)."""
    chains = rows[rows["kind"] == "chain"]

    def median(steps) -> float:
        return float(chains[chains["step"].isin(steps)]["ttft_s"].median())

    cross = chains[chains["step"] == "cross"]
    return {**cell.keys(arm=False), "context": tokens,
            "prompt_tokens": int(chains["prompt_tokens"].median()), "valid": valid,
            "chains": int((chains["step"] == "cold").sum()), "prefill_s": median(["cold"]),
            "local_s": median(LOCAL_STEPS), "reload_s": median(["cross"]),
            "loaded_tokens": float(cross["external_hit_tokens"].median()), "drive_read_gb_per_s": drive_read_gb_per_s}


def unit_rows(units: list[tuple[Cell, int]], csvs: list[str], metas: list[str]) -> list[dict]:
    """Each unit's medians (``unit_row``) from its records (``csvs``) and its unit.json (``metas``): its gate
    and the drive's read rate while reading."""
    rows = []
    for (cell, tokens), csv, meta_path in zip(units, csvs, metas, strict=True):
        meta = read_json(meta_path)
        rows.append(unit_row(cell, tokens, read_records(csv), meta["valid"],
                             meta["summary"]["drive"].get("read_active_gb_per_s")))
    return rows


def table(rows: list[dict], bytes_per_token: int) -> tuple[pd.DataFrame, dict[str, crossover.Fit | str]]:
    """Per cell, its lengths' medians with the prefill and reload models fitted (kvpool.studies.crossover) over
    its valid units: the length from which a reload pays and the break-even read rate per length. An
    invalid unit keeps its row, outside the fit. The fit's axis is the prompt's tokens (its crossover
    and break-even rates are in prompt tokens). Returns the table and each cell's fit or why none."""
    frame = pd.DataFrame(rows)
    parts, fits = [], {}
    for name, measured in frame.groupby("cell", sort=False):
        valid = measured[measured["valid"]].set_index("prompt_tokens")
        fitted, fits[name] = crossover.fitted(valid, bytes_per_token, measured["tier"].iloc[0])
        fitted = fitted.rename(columns={"context": "prompt_tokens"}).drop(
            columns=["tier", "prefill_s", "reload_s", "speedup", "kv_bytes"])
        parts.append(measured.merge(fitted, on="prompt_tokens", how="left"))
    table = pd.concat(parts, ignore_index=True)
    table["speedup"] = table["prefill_s"] / table["reload_s"]
    table["kv_bytes"] = table["loaded_tokens"] * bytes_per_token
    return table.reindex(columns=COLUMNS), fits


log = logging.getLogger(__name__)


def _unit_sections(config: dict, wildcards=None) -> dict:
    """A unit reads its own length from its path, not contexts.doc_tokens: a new length leaves the measured
    units as they are."""
    return {"contexts": {key: config["contexts"][key] for key in ("chains", "seed")}}


@reads(*PHASE_SETTINGS, "min_hit_fraction", "max_resident_fraction", "hash_keys", "lmcache", "random_model",
       picked=_unit_sections)
def run_context_unit(config: dict, cell: Cell, tokens: int, *, model: str, plan_out: str, manifest_out: str,
                     csv_out: str, json_out: str, reference_out: str, drive_csv: str, power_csv: str, log_dir: str,
                     provenance_config: dict) -> None:
    """One context unit (kvpool.studies.contexts): its own plan on a fresh pool of the cell's kind, one fleet,
    each document's locality chain with the pool dropped before the cross step; the rows, the answers'
    split-matched reference (``reference_out``), the unit's gate and its telemetry summary."""
    study = chain_study(config, cell, tokens)
    root = run_pools(config, cell.tier) / "contexts" / cell.name / f"doc~{tokens}"
    plan = checked_ports(new_plan(config, cell, model, Path(csv_out).parent, pool_root=root))
    workload = studyb.make_workload(vocabulary(model), study, config["replicas"])
    unit = run_unit(
        plan, lambda disks: context_unit(plan, workload, study, config, Path(log_dir), disks),
        UnitPaths(csv_out, json_out, drive_csv, power_csv, log_dir, plan_out, manifest_out), f"doc-{tokens}",
        pool=unit_pool(config, root, plan),
        manifest=provenance.manifest(provenance_config, cell=cell.name, doc_tokens=tokens))
    frame, meta = unit.frame, unit.meta
    # the chains' answers against pool-less recomputes in their splits, computed now that the fleet stopped
    compared = recompute_in_splits(config, model, studyb.under_test(frame), meta.pop("prompts"),
                                reference.normalized(None), Path(log_dir) / "reference")
    compared.to_csv(reference_out, index=False)
    checks = unit_checks(frame, meta["drops_before_cross"], study, config["min_hit_fraction"],
                                  config["max_resident_fraction"], compared)
    agreement = answer_agreement(frame)
    if agreement["cold_agrees"] < agreement["chains"]:
        log.info("%s doc~%d: the cold answer differs from the reuse steps' in %d of %d chains (another prefill "
                 "split; the gate compares each step with a recompute in its own split)", cell.name, tokens,
                 agreement["chains"] - agreement["cold_agrees"], agreement["chains"])
    gate = with_served({"checks": checks, "valid": verdict(checks)}, meta, config["engine"]["max_model_len"],
                       cell.chunk)
    meta.update(doc_tokens=tokens, information={"answers_agree": agreement}, **gate)
    write_unit(meta, len(frame), drive_csv, power_csv, plan, json_out, f"{cell.name} doc~{tokens}")


def context_unit(plan: Plan, workload: dict, study: dict, cfg: dict, log_dir: Path, disks: list[str]):
    """A context unit (kvpool.studies.contexts): each document's locality chain one request at a time on a fresh
    fleet and pool (chain_fleet), the pool dropped from the page cache and checked right before every
    cross-replica step, so each reload is a device read."""
    drops, prompts = [], {}

    async def body(send, _send_together, plan, replicas):
        send = recording_sends(send, prompts)

        def before(step: str) -> None:
            if step == "cross":
                drops.append(drop_pool(plan, cfg["drop_caches"]))

        return await run_block(send, BLOCK, workload, study, len(replicas), before,
                               wait_for_stores=stores_landed(plan, cfg, prompts, study["chunk"]))

    unit = chain_fleet(plan, cfg, log_dir, body, sampled=("contexts", disks))
    unit.meta = {"drops_before_cross": drops, "prompts": prompts, **unit.meta}
    return unit

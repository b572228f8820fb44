"""Document length as a dimension (kvpool.studies.contexts): the units a config asks for, the chain workload,
the unit's gate, the table's fit on made-up chains, and the workflow's jobs for a sweep."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from snakemake.utils import validate
from support import REPO, passing_gate_inputs

from kvpool.cells import Cell
from kvpool.measure import records
from kvpool.measure.checks import verdict
from kvpool.measure.files import write_json
from kvpool.measure.records import ChainRecord
from kvpool.report import contexts as contexts_report
from kvpool.report import gate, page
from kvpool.studies import contexts, studyb

BYTES_PER_TOKEN = 4096
DISK, RAM = Cell("lmcache-fs", "shared", 256, "disk"), Cell("lmcache-fs", "shared", 256, "ram")


def config(**contexts_settings):
    base = yaml.safe_load((REPO / "tests" / "configs" / "e2e.yaml").read_text())
    base.update(tiers={"disk": "pools/disk", "ram": "/dev/shm/kvpool"}, study_b={"enabled": False})
    base["contexts"] = {"doc_tokens": [512, 1024, 2048], "chains": 2, "seed": 0, **contexts_settings}
    return base


QUESTION = 256  # e2e.yaml's workload.followup_tokens: one whole chunk, loaded with the document


def chain_rows(tokens: int, prefill_s: float, reload_s: float, local_s: float, chains: int = 2,
               cross_external=None) -> pd.DataFrame:
    """A unit's requests as kvpool.studies.studyb.run_block records them: per chain, its five steps, each prompt
    the document and its question, the cross step loading both."""
    ttft = {"cold": prefill_s, "local-1": local_s, "local-2": local_s, "cross": reload_s, "local-B": local_s}
    rows = []
    for chain in range(chains):
        for step, role in studyb.CHAIN:
            prompt = tokens + QUESTION
            local = 0 if step in ("cold", "cross") else prompt
            external = (prompt if cross_external is None else cross_external) if step == "cross" else 0
            rows.append({"block": contexts.BLOCK, "arm": "on", "kind": "chain", "context": tokens, "chain": chain,
                         "step": step, "prompt_tokens": prompt, "replica": 0 if role == "A" else 1,
                         "payload_sha256": f"prompt-{tokens}-{chain}", "cached_tokens": local + external,
                         "local_hit_tokens": local, "external_hit_tokens": external, "computed_tokens": 64,
                         "ttft_s": ttft[step], "output_text": f"answer {chain}", "error": None})
    return records.frame(ChainRecord, rows)


def split_reference(rows: pd.DataFrame, answer=lambda key, split: None) -> pd.DataFrame:
    """A pool-less recompute of every (prompt, split) the rows measured, answering each chain's answer
    (or ``answer(key, split)`` where it gives one)."""
    found = rows.drop_duplicates(["payload_sha256", "cached_tokens"])
    return pd.DataFrame({"key": found["payload_sha256"], "path": "split", "requested_split": found["cached_tokens"],
                         "achieved_split": found["cached_tokens"], "error": "",
                         "output_text": [answer(k, s) or f"answer {c}" for k, s, c in
                                         zip(found["payload_sha256"], found["cached_tokens"], found["chain"],
                                             strict=True)]})


def cold_drop(resident=0.0):
    return {"memory_backed": False, "resident_fraction": resident}


def test_every_shared_cell_runs_every_length_and_a_bad_length_is_named():
    cfg = config()
    cfg["arms"] = ["shared", "isolated"]
    assert contexts.cells(cfg) == [DISK, RAM]
    assert contexts.units(cfg) == [(cell, n) for cell in (DISK, RAM) for n in (512, 1024, 2048)]
    assert contexts.problems(cfg) == []
    assert contexts.units(config(doc_tokens=[])) == [] and contexts.problems(config(doc_tokens=[])) == []
    found = contexts.problems(config(doc_tokens=[512, 1000, 4096]))
    assert any("[1000] are not whole chunks" in p for p in found)
    assert any("engine.max_model_len 4096" in p for p in found)  # 4,096 + 256 follow-up + 8 answer tokens
    isolated_only = config()
    isolated_only["arms"] = ["isolated"]
    assert any("needs a shared-pool cell" in p for p in contexts.problems(isolated_only))


def test_a_unit_sends_one_chain_per_document_each_of_its_length_with_a_seeded_question(tmp_path):
    study = contexts.chain_study(config(), DISK, 1024)
    vocabulary = list(range(1000))
    workload = studyb.make_workload(vocabulary, study, replicas=2)
    assert [len(item["prompt"]) for item in workload["chains"]] == [1024 + 256] * 2  # document + follow-up question
    assert [item["replicas"] for item in workload["chains"]] == [{"A": 0, "B": 1}, {"A": 1, "B": 0}]
    assert workload["sessions"] == workload["windows"] == workload["warmups"] == []
    assert workload == studyb.make_workload(vocabulary, study, replicas=2)
    other = studyb.make_workload(vocabulary, contexts.chain_study(config(), DISK, 2048), replicas=2)
    assert other["chains"][0]["prompt"][:10] != workload["chains"][0]["prompt"][:10]


def test_the_gate_asks_for_the_whole_document_from_the_pool_after_a_cold_drop():
    study = contexts.chain_study(config(), DISK, 1024)
    good = chain_rows(1024, 1.0, 0.2, 0.1)
    reference = split_reference(good)
    checks = contexts.unit_checks(good, [cold_drop(), cold_drop()], study, 0.9, 0.05, reference)
    assert verdict(checks) and "every_turn_answered" not in checks
    assert checks["output_matches_recompute"]["value"]["exact"] == 10
    missed = chain_rows(1024, 1.0, 0.2, 0.1, cross_external=512)
    assert contexts.unit_checks(missed, [cold_drop()] * 2, study, 0.9, 0.05, reference)[
        "cross_loads_the_document"]["ok"] is False
    warm = contexts.unit_checks(good, [cold_drop(), cold_drop(0.8)], study, 0.9, 0.05, reference)
    assert warm["cold_reads"]["ok"] is False and warm["cold_reads"]["value"] == [0.0, 0.8]
    undropped = contexts.unit_checks(good, [cold_drop()], study, 0.9, 0.05, reference)
    assert undropped["cold_reads"]["ok"] is False
    ram = contexts.unit_checks(good, [{"memory_backed": True}] * 2, study, 0.9, 0.05, reference)
    assert ram["cold_reads"]["status"] == "not_applicable" and verdict(ram)


def test_each_step_is_held_to_a_recompute_in_its_own_split_and_the_agreement_between_steps_is_counted():
    """A damaged pool changes the cross step's answer against a recompute in the cross step's split:
    invalid. A cold answer that differs from the reuse steps' (a kernel's split, as on the H200) but equals
    a recompute in its own split is counted, not held against the pool."""
    study = contexts.chain_study(config(), DISK, 1024)
    good = chain_rows(1024, 1.0, 0.2, 0.1)
    assert contexts.answer_agreement(good) == {"chains": 2, "cold_agrees": 2, "pool_agrees_with_own_cache": 2}
    damaged = good.copy()
    damaged.loc[(damaged["chain"] == 1) & (damaged["step"] == "cross"), "output_text"] = "w1 w2"
    checks = contexts.unit_checks(damaged, [cold_drop()] * 2, study, 0.9, 0.05, split_reference(good))
    assert checks["output_matches_recompute"]["ok"] is False
    assert checks["output_matches_recompute"]["value"]["equal"] == 9
    split = good.copy()
    split.loc[(split["chain"] == 0) & (split["step"] == "cold"), "output_text"] = "w1 w2"
    cold_answer = split_reference(split, lambda key, at: "w1 w2" if key.endswith("-0") and at == 0 else None)
    assert verdict(contexts.unit_checks(split, [cold_drop()] * 2, study, 0.9, 0.05, cold_answer))
    assert contexts.answer_agreement(split)["cold_agrees"] == 1
    # without a reference row for their prompts the answers are not verified, never passed
    unseen = contexts.unit_checks(good, [cold_drop()] * 2, study, 0.9, 0.05, None)
    assert unseen["output_matches_recompute"]["status"] == "not_verified"


def test_the_table_fits_each_tier_states_where_it_pays_and_keeps_an_invalid_unit_out_of_the_fit():
    lengths = [512, 1024, 2048, 4096]
    # both models over the prompt's tokens: the document and its question
    prefill = {n: 0.01 + 2e-5 * (n + QUESTION) + 5e-9 * (n + QUESTION) ** 2 for n in lengths}
    rates = {DISK: 0.5e9, RAM: 5e9}  # bytes per second the reloads move

    def reload(cell, n):
        return 0.05 + (n + QUESTION) * BYTES_PER_TOKEN / rates[cell]

    rows = [contexts.unit_row(cell, n, chain_rows(n, prefill[n], reload(cell, n), 0.005), True, 0.4)
            for cell in (DISK, RAM) for n in lengths]
    rows.append(contexts.unit_row(DISK, 8192, chain_rows(8192, 9.0, 0.01, 0.005), False, None))
    table, fits = contexts.table(rows, BYTES_PER_TOKEN)
    assert list(table.columns) == contexts.COLUMNS and len(table) == 9
    for cell in (DISK, RAM):
        assert fits[cell.name].read_rate == pytest.approx(rates[cell], rel=1e-6)
        assert fits[cell.name].overhead_s == pytest.approx(0.05, abs=1e-9)
    mine = table.set_index(["tier", "context"])
    # the made-up invalid unit (a reload of 0.01 s) would have moved the fit: it is outside it
    assert not mine.loc[("disk", 8192), "valid"] and np.isnan(mine.loc[("disk", 8192), "reload_fit_s"])
    assert mine.loc[("disk", 1024), "speedup"] == pytest.approx(prefill[1024] / reload(DISK, 1024))
    # the faster tier pays from a shorter document; a drive slower than the break-even rate would not
    disk_from, ram_from = (fits[c.name].crossover_tokens() for c in (DISK, RAM))
    assert 0 < ram_from < disk_from < 4096
    at = mine.loc[("disk", 4096)]
    assert at["prompt_tokens"] == at["loaded_tokens"] == 4096 + QUESTION
    assert at["kv_bytes"] == (4096 + QUESTION) * BYTES_PER_TOKEN
    assert at["break_even_read_gbps"] * 1e9 == pytest.approx(at["kv_bytes"] / (prefill[4096] - 0.05))
    page = contexts_report.markdown(table, fits)
    assert "## lmcache-fs / chunk 256 / disk" in page and "| 8,192 | 8,448 | INVALID |" in page
    assert "bytes / 0.50 GB/s" in page and "bytes / 5.00 GB/s" in page


def test_two_lengths_are_too_few_to_fit_and_the_page_says_so():
    rows = [contexts.unit_row(DISK, n, chain_rows(n, 1.0, 0.2, 0.1), True, None) for n in (512, 1024)]
    table, fits = contexts.table(rows, BYTES_PER_TOKEN)
    assert isinstance(fits[DISK.name], str) and table["crossover_tokens"].isna().all()
    assert "No fit: a crossover needs at least 3 contexts" in contexts_report.markdown(table, fits)


def test_the_workflow_runs_one_unit_per_cell_and_length_and_gates_on_them(tmp_path):
    overlay = tmp_path / "contexts.yaml"
    overlay.write_text(yaml.safe_dump({"contexts": {"doc_tokens": [512, 1024, 2048]}}))
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "results/gate.ok", "--directory", str(tmp_path),
                          "-s", str(REPO / "Snakefile"), "--configfile", str(REPO / "tests" / "configs" / "e2e.yaml"),
                          str(overlay)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2
                and line.split()[-1].isdigit())
    assert jobs["context_unit"] == "3" and jobs["contexts_table"] == "1"  # e2e.yaml's one shared cell
    assert "results/cells/backend~lmcache-fs/arm~shared/chunk~256/tier~disk/doc~1024/unit.json" in out.stdout
    # the refusals come before anything runs, naming the setting
    overlay.write_text(yaml.safe_dump({"contexts": {"doc_tokens": [1000]}}))
    refused = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--directory", str(tmp_path), "-s",
                              str(REPO / "Snakefile"), "--configfile", str(REPO / "tests" / "configs" / "e2e.yaml"),
                              str(overlay)], capture_output=True, text=True, timeout=300)
    said = refused.stderr + refused.stdout
    assert refused.returncode != 0 and "contexts.doc_tokens [1000] are not whole chunks" in said


def test_the_default_config_runs_no_length_units():
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(default, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))  # fills the defaults
    assert default["contexts"] == {"doc_tokens": [], "chains": 2, "seed": 0}
    assert contexts.units(default) == [] and contexts.problems(default) == []


def test_the_table_step_its_figure_the_report_section_and_the_gate_flag_an_invalid_unit(tmp_path):
    cfg = config()
    validate(cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))  # the random model's KV size
    units, csvs, metas = [], [], []
    for n, valid in ((512, True), (1024, True), (2048, True), (4096, False)):
        csvs.append(str(tmp_path / f"doc-{n}.csv"))
        chain_rows(n, 0.01 + 1e-4 * n, 0.02 + 1e-5 * n, 0.005).to_csv(csvs[-1], index=False)
        metas.append(str(tmp_path / f"doc-{n}.json"))
        write_json(metas[-1], {"valid": valid, "summary": {"drive": {"read_active_gb_per_s": 0.5}}})
        units.append((DISK, n))
    out = tmp_path / "results"
    out.mkdir()
    contexts_report.run_contexts_table(cfg, units, csvs=csvs, metas=metas, csv_out=str(out / "contexts.csv"),
                                       md_out=str(out / "contexts.md"), figures_dir=str(out / "contexts"))
    table = pd.read_csv(out / "contexts.csv")
    assert table["context"].tolist() == [512, 1024, 2048, 4096] and table["valid"].tolist() == [True] * 3 + [False]
    assert table["fit_read_gbps"].iloc[:3].notna().all() and np.isnan(table["reload_fit_s"].iloc[3])
    assert {"contexts.png", "contexts.svg"} <= {p.name for p in (out / "contexts").iterdir()}
    section = page._contexts_section(str(out / "contexts.csv"))
    assert section["html"].count("INVALID") == 1 and Path(section["figure"]).exists()
    assert "![contexts](contexts/contexts.png)" in (out / "contexts.md").read_text()
    validity, kv_bytes = passing_gate_inputs(tmp_path, DISK.name)
    with pytest.raises(SystemExit, match="doc~4096: its unit.json names the failed checks"):
        gate.gate(validity, kv_bytes, str(tmp_path / "gate.ok"), contexts_csv=str(out / "contexts.csv"))
    gate.gate(validity, kv_bytes, str(tmp_path / "gate.ok"))  # without the lengths it passes

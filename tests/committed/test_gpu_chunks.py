"""The committed H200 runs of issue 32 (docs/results/h200-mp-chunks and h200-mp-fault: two replicas packed on
one H200, the 7.1B random Llama, LMCache's MP server, 20 documents of 18,000 tokens, a multiple of no chunk
size), re-read by the pipeline's own code: each gate again from its records, the reference's splits, why
the document-first recompute could not judge these cells, and the fault-injected cell's failure."""

from pathlib import Path

import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.measure import reference, validity
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.report import tables
from kvpool.studies import study_a

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
CHUNKS, FAULT = RESULTS / "h200-mp-chunks", RESULTS / "h200-mp-fault"
FIRST, SECOND = "de83e7c72f49f18bd5f35aec1dacd1ff29efeed2", "defb63ef1953a114619594322b8eef37ba063e49"
# each cell's split (tokens from a cache) and the session whose commit measured it
CELLS = {Cell("lmcache-mp", arm, chunk, "ram"): (split, commit) for arm, chunk, split, commit in [
    ("isolated", 256, 0, SECOND), ("shared", 256, 17920, SECOND), ("isolated", 1024, 0, FIRST),
    ("shared", 1024, 17408, FIRST), ("isolated", 2048, 0, SECOND), ("shared", 2048, 16384, FIRST)]}
FAULTY = Cell("lmcache-mp", "shared", 256, "disk")


def folder(run: Path, cell: Cell) -> Path:
    return run / "results" / "cells" / cell.name


def gate_again(run: Path, cell: Cell, tmp_path: Path) -> dict:
    cell_dir = folder(run, cell)
    config = read_json(cell_dir / "manifest.json")["config"]
    study_a.run_validity(config, cell, populate_csv=cell_dir / "populate.csv", populate_json=cell_dir / "populate.json",
                         reuse_csv=cell_dir / "reuse.csv", reuse_json=cell_dir / "reuse.json",
                         reference_csv=run / "results" / "reference" / "outputs.csv",
                         populate_digests=cell_dir / "populate-digests.csv",
                         reuse_digests=cell_dir / "pool-digests.csv",
                         out=tmp_path / "validity.json")
    again, committed = read_json(tmp_path / "validity.json"), read_json(cell_dir / "validity.json")
    # every committed check comes again as it was; a check added since (pool_servers) passes on these records
    assert {name: again["checks"][name] for name in committed["checks"]} == committed["checks"]
    assert all(again["checks"][name]["ok"] for name in set(again["checks"]) - set(committed["checks"]))
    assert again["valid"] == committed["valid"] and again["cell"] == committed["cell"]
    return again


@pytest.mark.parametrize("run, cell", [(CHUNKS, cell) for cell in CELLS] + [(FAULT, FAULTY)],
                         ids=lambda item: item.name if isinstance(item, Cell) else item.name)
def test_every_cell_ran_the_commit_on_the_gpu(run, cell):
    manifest = read_json(folder(run, cell) / "manifest.json")
    assert manifest["git"]["commit"] == CELLS.get(cell, (0, FIRST))[1] and not manifest["git"]["dirty"]
    assert manifest["versions"]["vllm"] == "0.26.0"
    assert manifest["hardware"]["gpu"]["devices"] == ["NVIDIA H200"]
    config = manifest["config"]
    assert config["workload"]["doc_tokens"] == 18000 and config["workload"]["documents"] == 20
    assert all(18000 % chunk for chunk in config["chunk_sizes"])  # a multiple of no chunk size


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.name)
def test_every_cell_is_valid_against_the_recompute_in_its_own_split(cell, tmp_path):
    gate = gate_again(CHUNKS, cell, tmp_path)
    assert gate["valid"]
    outputs = gate["checks"]["output_matches_recompute"]
    assert outputs["value"]["exact"] == outputs["value"]["equal"] == 20
    # the document-first recompute (vLLM's own cache to 18,000 tokens) would have failed every cell, and the
    # cold one the shared cell at 256, whose split's answers differ from the cold path's in 17 of 20
    cold = 3 if cell.arm == "shared" and cell.chunk == 256 else 20
    after_document = 9 if cell.arm == "shared" and cell.chunk == 256 else 7
    assert outputs["information"] == {"cold": {"equal": cold, "of": 20},
                                      "after_document": {"equal": after_document, "of": 20}}
    rows = read_records(str(folder(CHUNKS, cell) / "reuse.csv"))
    split = CELLS[cell][0]
    assert (rows["cached_tokens"] == split).all() and (rows["external_hit_tokens"] == split).all()
    assert (rows["local_cache_hit_tokens"] == 0).all()
    assert {name for name, check in gate["checks"].items() if check["status"] == "not_applicable"} == {
        "cold_reads", "pool_unchanged"}  # a pool in the server's RAM: no device read, no file


def test_the_answer_is_a_property_of_the_split():
    """Without any pool, per follow-up: splits 0, 16,384 and 17,408 give one answer; 17,920 (a 256-token
    chunk's hit), 18,000 (the document) and 18,240 (the prompt again) give another in most follow-ups."""
    rows = read_records(str(CHUNKS / "results" / "reference" / "outputs.csv"))
    assert (rows["error"].fillna("") == "").all()
    answers = rows.pivot_table(index="key", columns="achieved_split", values="output_text", aggfunc="first")
    assert list(answers.columns) == [0, 16384, 17408, 17920, 18000, 18240] and len(answers) == 20
    differ = {split: int((answers[split] != answers[0]).sum()) for split in answers.columns}
    assert differ == {0: 0, 16384: 0, 17408: 0, 17920: 17, 18000: 13, 18240: 16}
    # each path's split, as the reference replica's own cached tokens proved it
    splits = rows.groupby("path")["achieved_split"].agg(set).to_dict()
    assert splits == {"cold": {0}, "pool_chunks": {16384, 17408, 17920}, "after_document": {18000}, "repeat": {18240}}


def test_the_table_rebuilds_from_the_records(tmp_path):
    cells = list(CELLS)
    config = read_json(folder(CHUNKS, cells[0]) / "manifest.json")["config"]
    files = {name: [folder(CHUNKS, cell) / name for cell in cells] for name in ("reuse.csv", "reuse.json",
                                                                                 "validity.json")}
    tables.run_table1(config, cells, files["reuse.csv"], files["reuse.json"], files["validity.json"],
                       [folder(CHUNKS, cell) / "telemetry" / "summary.json" for cell in cells],
                       [folder(CHUNKS, cell) / "manifest.json" for cell in cells],
                       cells_csv=tmp_path / "cell_table.csv", csv_out=tmp_path / "table1.csv",
                       md_out=tmp_path / "table1.md")
    # the run's tables as written then; Study A's published figures were set beside them later
    ours, beside = (tmp_path / "table1.md").read_text().split("\n## Beside Study A as published\n")
    assert ours == (CHUNKS / "results" / "table1.md").read_text()
    assert "| GPUs | 4 x NVIDIA RTX PRO 6000 Blackwell Server Edition (96 GB each) | NVIDIA H200 |" in beside
    table = pd.read_csv(tmp_path / "table1.csv").set_index(["chunk", "metric"])
    p50 = table.loc[(1024, "ttft_p50_s")]
    assert 3.8 < p50["ratio_ci_low"] <= p50["ratio"] <= p50["ratio_ci_high"] < 4.3
    assert table.loc[(1024, "ttft_p99_s"), "shared_basis"] == "max of 20"
    # the pool pays at every chunk size, and most at 256, whose hit leaves the fewest of the 18,256 prompt tokens
    # to compute (336, against 848 at 1,024 and 1,872 at 2,048): the intervals do not meet
    ratios = table.xs("ttft_p50_s", level="metric")
    assert (ratios["ratio_ci_low"] > 3.5).all() and list(ratios.index) == [256, 1024, 2048]
    assert ratios.loc[256, "shared_ci_high"] < min(ratios.loc[1024, "shared_ci_low"], ratios.loc[2048, "shared_ci_low"])


def test_the_corrupted_chunk_fails_the_fault_cell_where_only_the_split_matched_reference_can_tell(tmp_path):
    gate = gate_again(FAULT, FAULTY, tmp_path)
    assert not gate["valid"]
    assert {name for name, check in gate["checks"].items() if check["status"] == "failed"} == {
        "output_matches_recompute", "pool_unchanged"}
    outputs = gate["checks"]["output_matches_recompute"]
    assert outputs["value"] == {"compared": 20, "equal": 19, "exact": 20, "nearest": 0, "unmatched": 0,
                                "reference_inconsistent": 0}
    assert outputs["examples"][0].startswith("doc10/followup0: measured split 17920, reference split 17920")
    # against the cold path 17 answers differ, against the document-first one 11: neither tells the damage
    assert outputs["information"] == {"cold": {"equal": 3, "of": 20}, "after_document": {"equal": 9, "of": 20}}
    corrupted = Path(read_json(folder(FAULT, FAULTY) / "drop.json")["fault_injection"]["file"]).name
    unchanged = gate["checks"]["pool_unchanged"]
    assert unchanged["value"]["changed"] == 1 and unchanged["examples"][0].endswith(corrupted)
    drop = read_json(folder(FAULT, FAULTY) / "reuse.json")["drop_before_reuse"]
    assert drop["resident_fraction"] == 0.0 and not drop["memory_backed"]  # every reload a device read
    keyed = validity.followup_keys(read_records(str(folder(FAULT, FAULTY) / "reuse.csv")))
    table = reference.comparisons(keyed, read_records(str(FAULT / "results" / "reference" / "outputs.csv")))
    assert table.loc[~table["equal"], "key"].tolist() == ["doc10/followup0"]
    # the fault cell's reference is the chunk sweep's, byte for byte
    assert (FAULT / "results" / "reference" / "outputs.csv").read_bytes() == \
        (CHUNKS / "results" / "reference" / "outputs.csv").read_bytes()

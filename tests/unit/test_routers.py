"""The routers (kvpool.studies.routers): where each policy sends a document's requests, what losing a replica
moves, the hot draws, and the router unit's gate on made-up rows."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support import passing_gate_inputs

from kvpool.cells import Cell
from kvpool.engine import prompts
from kvpool.measure import unit as unit_entry
from kvpool.measure.files import write_json
from kvpool.report import gate as run_gate
from kvpool.report import page
from kvpool.report import routers as routers_report
from kvpool.studies import routers

DOCS = {doc: list(range(doc * 100, doc * 100 + 64)) for doc in range(40)}


def placements(name: str, replicas=(0, 1, 2, 3), seed=0):
    router = routers.Router(name, list(replicas), seed)
    first = {doc: router.first(doc, tokens) for doc, tokens in DOCS.items()}
    return router, first


def test_cross_sends_every_follow_up_to_the_replica_after_its_prefill_even_after_a_loss():
    router, first = placements("cross")
    assert list(first.values())[:5] == [0, 1, 2, 3, 0]  # Study A's populate: round robin in order
    assert all(router.followup(doc, DOCS[doc]) == (first[doc] + 1) % 4 for doc in DOCS)
    router.lose(3)
    after = {doc: router.followup(doc, DOCS[doc]) for doc in DOCS}
    assert all(after[doc] != first[doc] and after[doc] != 3 for doc in DOCS)
    assert {after[doc] for doc in DOCS if first[doc] == 2} == {0}  # wraps past the lost replica


def test_prefix_affinity_keeps_a_document_on_one_replica_and_a_loss_moves_only_that_replicas_documents():
    router, first = placements("prefix-affinity")
    assert all(router.followup(doc, DOCS[doc]) == first[doc] for doc in DOCS)
    assert len(set(first.values())) == 4  # the hash spreads documents over every replica
    router.lose(1)
    after = {doc: router.followup(doc, DOCS[doc]) for doc in DOCS}
    moved = {doc for doc in DOCS if after[doc] != first[doc]}
    assert moved == {doc for doc in DOCS if first[doc] == 1} and 1 not in after.values()


def test_round_robin_and_random_ignore_the_document_and_random_is_seeded():
    router, _ = placements("round-robin")
    assert [router.followup(doc, DOCS[doc]) for doc in range(6)] == [0, 1, 2, 3, 0, 1]  # the turn goes on
    def draws(seed):
        router = placements("random", seed=seed)[0]
        return [router.followup(doc, DOCS[doc]) for doc in DOCS]

    one, two, other = draws(7), draws(7), draws(8)
    assert one == two and one != other and set(one) == {0, 1, 2, 3}


def test_unknown_router_and_losing_the_last_replica_are_refused():
    with pytest.raises(ValueError, match="not one of cross, round-robin, random, prefix-affinity"):
        routers.Router("least-loaded", [0, 1], 0)
    router = routers.Router("cross", [0, 1], 0)
    router.lose(1)
    with pytest.raises(ValueError, match="a replica left"):
        router.lose(0)


def test_hot_draws_are_seeded_and_concentrated_on_a_few_documents():
    doc_ids = list(range(20))
    draws = routers.hot_draws(doc_ids, 400, 1.2, seed=3)
    assert draws == routers.hot_draws(doc_ids, 400, 1.2, seed=3) and routers.hot_draws(doc_ids, 0, 1.2, 3) == []
    counts = pd.Series(draws).value_counts()
    assert counts.iloc[0] > 400 / 20 * 3 and counts.iloc[:3].sum() > 0.4 * 400


def rows(arm_external: int, seen=(True, False), phases=("first", "follow-up"), errors=("", "")) -> pd.DataFrame:
    frame = pd.DataFrame({
        "router": "cross", "phase": list(phases), "seq": range(len(phases)), "doc_id": 0, "first_replica": 0,
        "serve_replica": [0, 1], "seen_before": [False, seen[1]], "ttft_s": [0.5, 0.1], "e2e_s": [0.6, 0.2],
        "prompt_tokens": 1024, "cached_tokens": [0, arm_external], "local_cache_hit_tokens": [0, 0],
        "external_hit_tokens": [0, arm_external], "local_compute_tokens": [1024, 1024 - arm_external],
        "output_text": "x", "error": list(errors)})
    return frame


COLD = {"memory_backed": False, "resident_fraction": 0.0}


def gate(arm, frame, windows=None, loss=None):
    return routers.checks(arm, frame, windows or {}, COLD, loss, 1024, 0.9, 0.05)


def test_the_gate_asks_a_shared_pool_to_deliver_where_a_request_moved_and_an_isolated_one_not_to():
    assert gate("shared", rows(1024))["valid"]
    missed = gate("shared", rows(0))
    assert not missed["valid"] and missed["checks"]["pool_hits"]["value"] == 0.0
    assert gate("isolated", rows(0))["valid"]
    leaked = gate("isolated", rows(1024))
    assert not leaked["valid"] and leaked["checks"]["isolation"]["value"] == 1024
    # a request back on a replica that served the document before is not the pool's to deliver
    assert gate("shared", rows(0, seen=(True, True)))["valid"]


def test_the_gate_fails_on_errors_unattributed_tokens_a_window_that_disagrees_and_a_lost_replica_serving():
    assert not gate("shared", rows(1024, errors=("", "replica 1 died")))["checks"]["zero_errors"]["ok"]
    unattributed = rows(1024)
    unattributed.loc[1, "external_hit_tokens"] = np.nan
    assert not gate("shared", unattributed)["checks"]["hit_attribution"]["ok"]
    hot = rows(1024, phases=("first", "hot"))
    agree = {"hot": {"local_cache_hit": 0, "external_kv_transfer": 1024, "local_compute": 0}}
    disagree = {"hot": {"local_cache_hit": 0, "external_kv_transfer": 512, "local_compute": 512}}
    assert gate("shared", hot, agree)["checks"]["hit_attribution"]["ok"]
    assert not gate("shared", hot, disagree)["checks"]["hit_attribution"]["ok"]
    after = rows(1024, phases=("first", "after-loss"))
    assert gate("shared", after, loss={"replica": 2, "stopped": True})["checks"]["replica_lost"]["ok"]
    served = gate("shared", after, loss={"replica": 1, "stopped": True})["checks"]["replica_lost"]
    assert not served["ok"] and served["value"]["served_after"] == 1


def test_a_unit_holds_its_followups_answers_to_the_split_matched_recompute():
    """Follow-ups one at a time are compared with the reference in their split; a document's first request
    reads no cache and is not; the hot phase's answers, sent two at a time, are not verified unless the
    kernels are batch-invariant."""
    reference = pd.DataFrame({"key": "doc0/followup0", "requested_split": [0, 1024], "achieved_split": [0, 1024],
                              "path": ["cold", "pool_chunks"], "output_text": ["cold answer", "x"], "error": ""})
    hot = rows(1024, phases=("hot", "hot")).assign(cached_tokens=1024)
    frame = pd.concat([rows(1024), hot], ignore_index=True)
    windows = {"hot": {"local_cache_hit": 0, "external_kv_transfer": 2048, "local_compute": 0}}
    found = routers.checks("shared", frame, windows, COLD, None, 1024, 0.9, 0.05, reference, False, 2)
    assert found["valid"] and found["checks"]["output_matches_recompute"]["value"]["compared"] == 1
    assert found["checks"]["hot_outputs_match_recompute"]["status"] == "not_verified"
    invariant = routers.checks("shared", frame, windows, COLD, None, 1024, 0.9, 0.05, reference, True, 2)
    assert "hot_outputs_match_recompute" not in invariant["checks"]
    assert invariant["checks"]["output_matches_recompute"]["value"]["compared"] == 3  # a follow-up, two hot
    damaged = rows(1024).assign(output_text="damaged")
    assert not routers.checks("shared", damaged, {}, COLD, None, 1024, 0.9, 0.05, reference)["valid"]


def test_a_phase_of_two_populations_is_also_given_as_each(tmp_path):
    """Follow-ups that landed on a replica new to their document and those back on one that served it are
    two populations; the table gives each beside the phase's whole."""
    frame = pd.concat([rows(1024, seen=(True, False)), rows(0, seen=(True, True))], ignore_index=True)
    follow = frame[frame["phase"] == "follow-up"]
    assert [name for name, _ in routers.groups(follow, "follow-up")] == ["all", "moved", "stayed"]
    assert [name for name, _ in routers.groups(follow, "hot")] == ["all"]  # the hot phase's sources are a window's
    assert [name for name, _ in routers.groups(follow.iloc[:1], "follow-up")] == ["all"]


def test_a_phase_row_splits_the_tokens_by_source_and_names_the_busiest_replica():
    frame = rows(1024, phases=("follow-up", "follow-up"))
    sources = routers.phase_sources(frame, None)
    assert sources == {"local_cache_hit": 0, "external_kv_transfer": 1024, "local_compute": 1024}
    row = routers.phase_row(Cell("lmcache-fs", "shared", 256, "disk"), "cross", "follow-up", frame, sources, True)
    assert row["pool_fraction"] == 0.5 and row["computed_fraction"] == 0.5 and row["max_replica_share"] == 0.5
    assert row["moved_fraction"] == 1.0 and row["requests"] == 2 and row["ttft_p50_s"] == pytest.approx(0.3)
    assert row["group"] == "all" and row["ttft_p99_basis"] == "max of 2"
    assert ("| lmcache-fs / shared / chunk 256 / disk | cross | follow-up | all | valid | 2 | 0.3 s [0.1, 0.5] | "
            "max of 2: 0.5 s |") in routers_report.markdown(pd.DataFrame([row]))


def test_the_table_its_figures_the_report_section_and_the_gate_flag_an_invalid_unit(tmp_path):
    cell = Cell("lmcache-fs", "shared", 256, "disk")
    units, csvs, metas = [], [], []
    for router, valid in (("cross", True), ("prefix-affinity", False)):
        frame = pd.concat([rows(1024), rows(1024, phases=("hot", "hot"))], ignore_index=True).assign(router=router)
        csvs.append(str(tmp_path / f"{router}.csv"))
        frame.to_csv(csvs[-1], index=False)
        metas.append(str(tmp_path / f"{router}.json"))
        write_json(metas[-1], {"valid": valid, "windows": {"hot": {"local_cache_hit": 0, "external_kv_transfer": 2048,
                                                                    "local_compute": 0}}})
        units.append((cell, router))
    out = tmp_path / "results"
    out.mkdir()
    routers_report.run_router_table(units, csvs=csvs, metas=metas, csv_out=str(out / "routers.csv"),
                                    md_out=str(out / "routers.md"), figures_dir=str(out / "routers"))
    table = pd.read_csv(out / "routers.csv")
    assert list(table["phase"]) == ["first", "follow-up", "hot"] * 2
    assert table.loc[table["phase"] == "hot", "pool_fraction"].tolist() == [1.0, 1.0]  # the window's split
    assert {"ttft.png", "ttft.svg", "sources.png", "sources.svg"} <= {p.name for p in (out / "routers").iterdir()}
    section = page._routers_section(str(out / "routers.csv"))
    assert section["html"].count("INVALID") == 3 and all(Path(f["png"]).exists() for f in section["figures"])
    assert "| prefix-affinity | hot | all | **INVALID** |" in (out / "routers.md").read_text()
    validity, kv_bytes = passing_gate_inputs(tmp_path, cell.name)
    with pytest.raises(SystemExit, match="router~prefix-affinity: its run.json names the failed checks"):
        run_gate.gate(validity, kv_bytes, str(tmp_path / "gate.ok"), routers_csv=str(out / "routers.csv"))


def test_a_router_unit_that_fails_leaves_no_pool_on_the_tier(config, tmp_path, monkeypatch):
    """The unit's pool is its own, made fresh for it: a fleet that dies mid-unit must not leave it on the
    tier (keep_pools false), where the space check of later units does not expect it."""
    config.update(tiers={"disk": str(tmp_path / "pools")}, keep_pools=False)
    cell = Cell("lmcache-fs", "shared", 256, "disk")
    root = routers.router_pool_root(config, cell, "cross")
    seen = {}

    def dies(plan, measure, *args):
        seen["pool"] = root.exists()
        raise RuntimeError("replica 1 exited with code -9")

    monkeypatch.setattr(prompts, "read_workload", lambda path: {})
    monkeypatch.setattr(unit_entry, "_sampled", dies)
    unit = tmp_path / "router~cross"
    unit.mkdir()
    with pytest.raises(RuntimeError, match="exited with code -9"):
        routers.run_router_unit(config, cell, "cross", model=str(tmp_path / "model"), prompts_path="prompts.json",
                                plan_out=str(unit / "plan.yaml"), manifest_out=str(unit / "manifest.json"),
                                csv_out=str(unit / "requests.csv"), json_out=str(unit / "run.json"),
                                drive_csv=str(unit / "drive.csv"), power_csv=str(unit / "power.csv"),
                                log_dir=str(tmp_path / "logs"), provenance_config=config)
    assert seen["pool"] and not root.exists()

"""Study B on the real stack (e2e.yaml): the OFF-ON-ON-OFF blocks on a shared fs pool, their locality chains,
sessions and windows, read from the session's one study run (tests/e2e/conftest.py)."""

import json

import pandas as pd
import yaml

STUDYB = "results/studyb/backend~lmcache-fs/chunk~256/tier~disk"


def test_study_b_blocks_run_off_on_on_off_and_the_pool_serves_only_cross_replica_steps(study_run):
    blocks = ["1-off", "2-on", "3-on", "4-off"]
    metas = [json.loads((study_run / STUDYB / f"block~{b}" / "block.json").read_text()) for b in blocks]
    assert all(m["valid"] for m in metas), [m["checks"] for m in metas]
    assert [m["started_at"] for m in metas] == sorted(m["started_at"] for m in metas)  # each a fresh fleet, in order
    for block in blocks:  # OFF has no connector and no pool; ON the study's shared fs pool
        plan = yaml.safe_load((study_run / STUDYB / f"block~{block}" / "plan.yaml").read_text())
        transfer = {json.dumps(r["kv_transfer"]) for r in plan["replicas"]}
        assert (transfer == {"null"}) == block.endswith("-off"), (block, transfer)
    gate = json.loads((study_run / "results" / "studyb" / "validity.json").read_text())
    agreement = gate["information"]["outputs_equal_across_pairs"]
    assert gate["valid"] and agreement["equal"] == agreement["of"] > 0  # an observation: the splits agree on CPU
    # each ON block's answers against pool-less recomputes in their splits; an OFF block has no pool to check
    for meta, block in zip(metas, blocks, strict=True):
        outputs = meta["checks"]["output_matches_recompute"]
        if block.endswith("-off"):
            assert outputs["status"] == "not_applicable"
            continue
        assert outputs["status"] == "passed" and outputs["value"]["equal"] == outputs["value"]["compared"] > 0
        # the windows' two sessions at once share batches: recorded as not verified
        assert meta["checks"]["window_outputs_match_recompute"]["status"] == "not_verified"
    # block 1 (OFF) computed the pool's splits the ON blocks would run in (the alternating turns on the other
    # replica) on its own pool-less replicas; blocks 2 and 3 took those and the OFF block's answers, and
    # started no reference replica: every split was predicted
    predicted = pd.read_csv(study_run / STUDYB / "block~1-off" / "reference.csv")
    assert len(predicted) and set(predicted["path"]) == {"predicted_on"}
    assert (predicted["achieved_split"] == predicted["requested_split"]).all()
    for block in ("2-on", "3-on"):
        computed = pd.read_csv(study_run / STUDYB / f"block~{block}" / "reference.csv")
        assert set(computed["path"]) == {"off_block", "predicted_on"}
        log = study_run / STUDYB.replace("results/", "logs/", 1) / f"block~{block}.log"  # under its results path
        assert "on a replica with no pool" not in log.read_text()
    locality = pd.read_csv(study_run / "results" / "locality.csv").set_index(["context", "step"])
    assert set(locality.index) == {(c, s) for c in (256, 1024) for s in ("cold", "local-1", "local-2", "cross",
                                                                         "local-B")}
    for context in (256, 1024):
        cross = locality.loc[(context, "cross")]
        assert cross["on_external_hit_tokens"] == context and cross["off_external_hit_tokens"] == 0
        assert cross["off_local_hit_tokens"] == 0 and cross["pairs_matched"] == cross["outputs_equal"] == 2
        assert locality.loc[(context, "local-1"), "on_local_hit_tokens"] == context  # vLLM's own cache, ON and OFF
    assert locality.loc[(1024, "cross"), "mean_paired_change_pct"] < 0  # a reload beats recomputing 1024 tokens
    sessions = pd.read_csv(study_run / "results" / "sessions.csv")
    assert len(sessions) == 4 * 2 * 2 * 6 and sessions["error"].isna().all()  # blocks x placements x sessions x turns
    alternating_on = sessions[(sessions["placement"] == "alternating") & (sessions["arm"] == "on")]
    assert (alternating_on.loc[alternating_on["turn"] == 1, "external_hit_tokens"] >= 512).all()
    assert (sessions.loc[sessions["arm"] == "off", "external_hit_tokens"] == 0).all()
    windows = pd.read_csv(study_run / "results" / "studyb" / "windows.csv")  # two sessions at once, per placement
    assert set(zip(windows["window"], windows["placement"], strict=True)) == {(2, "fixed"), (2, "alternating")}
    assert (windows["off_tokens_per_s_median"] > 0).all() and (windows["on_tokens_per_s_median"] > 0).all()
    assert (windows["block_pairs"] == 2).all()
    page = (study_run / "results" / "studyb.md").read_text()
    assert "**Gate: VALID.**" in page and "(Study B's Table 3)" in page and "## Short concurrency windows" in page
    # two chain contexts are too few to fit the crossover's quadratic prefill: the page says so
    assert "No fit: a crossover needs at least 3 contexts" in (study_run / "results" / "crossover.md").read_text()
    assert (study_run / "results" / "studyb" / "figures" / "locality.png").stat().st_size > 10_000
    report = (study_run / "results" / "report.html").read_text()
    assert 'id="studyb"' in report and "Locality chains (Study B's Table 3)" in report
    assert "Short concurrency windows" in report and "Where the pool pays" in report

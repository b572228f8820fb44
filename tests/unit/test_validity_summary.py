import re

import numpy as np
import pandas as pd
import pytest
from support.records import DOC, POOL_SPLIT, STORED_CHUNKS, frames

from kvpool.engine.metrics import delta, token_counters
from kvpool.measure.checks import tally
from kvpool.measure.validity import evaluate, failures
from kvpool.report.tables import table1_markdown
from kvpool.studies.tables import arm_metrics, table1

OWN_POOL = {"files": STORED_CHUNKS, "bytes": 10**9, "chunks": STORED_CHUNKS}
L1 = "lmcache_mp_l1_memory_usage_bytes of the pool's servers after populate"


def gate(config, arm="shared", drop=None, pool_bytes=10**9, preflight=None, write_errors=(), unchanged=None,
         reference=None, server_errors=None, served=None, own_pool=OWN_POOL, **kw):
    populate, reuse, rows = frames(arm, **kw)
    config["workload"].update(documents=4, doc_tokens=DOC)
    drop = drop or {"memory_backed": False, "resident_fraction": 0.0}
    preflight = preflight or {"ok": True, "hit_tokens": 512, "expect_shared": arm == "shared"}
    unchanged = unchanged or {"files": 16, "changed": 0, "missing": 0, "example": ""}
    return evaluate(arm, config, populate, reuse, rows if reference is None else reference, drop, pool_bytes,
                    preflight, write_errors=write_errors, pool_unchanged=unchanged, server_errors=server_errors,
                    served=served, own_pool=own_pool)


def test_a_clean_shared_cell_is_valid(config):
    result = gate(config)
    assert result["valid"], failures(result)
    assert result["checks"]["pool_hits"]["value"] == POOL_SPLIT / DOC
    assert tally(result["checks"]) == {"passed": len(result["checks"]), "failed": 0, "not_applicable": 0,
                                       "not_verified": 0}


@pytest.mark.parametrize("kwargs, check", [
    ({"hits": 0}, "pool_hits"),                                   # a silent miss is caught, not averaged in
    ({"hits": 512}, "pool_hits"),
    ({"hits": DOC + 256}, "hits_within_document"),                # a chunk an earlier reuse left: a warm pool
    ({"errors": ("", "HTTP 500", "", "")}, "zero_errors"),
    ({"outputs": ("a", "b", "X", "d")}, "output_matches_recompute"),
    ({"local": 16}, "own_cache_unused"),                          # the serving replica's own cache served some
    ({"pool_bytes": 10}, "pool_bytes"),
    ({"drop": {"memory_backed": False, "resident_fraction": 0.4}}, "cold_reads"),
    ({"preflight": {"ok": False, "hit_tokens": 0, "expect_shared": True}}, "preflight"),
    ({"unchanged": {"files": 16, "changed": 1, "missing": 0, "example": "shared/k"}}, "pool_unchanged"),
    ({"unchanged": {"files": 16, "changed": 0, "missing": 2, "example": "shared/k"}}, "pool_unchanged"),
    ({"unchanged": {"files": 0, "changed": 0, "missing": 0, "example": ""}}, "pool_unchanged"),  # nothing hashed
    ({"server_errors": ["redis server 0: exited with -9"]}, "pool_servers"),   # a pool server died mid-phase
    # a replica that runs another chunk size or model length than its plan (an override kvpool missed)
    ({"served": [{"0": {"max_model_len": 16384, "chunk_sizes": [512]}}]}, "served_as_planned"),
    ({"served": [{"0": {"max_model_len": 999, "chunk_sizes": []}}]}, "served_as_planned"),
    # issue 51: a document populate loaded from a pool that held it before the cell began (foreign or warm)
    ({"populate_hits": (0, 1023, 0, 0)}, "populate_loaded_nothing"),
    # issue 51: the cell's own pool folder does not hold what populate stored (LMCache kept it elsewhere)
    ({"own_pool": {"files": 0, "bytes": 0, "chunks": 0}}, "populate_stored_in_own_pool"),
    ({"own_pool": {"files": STORED_CHUNKS // 2, "bytes": 10**9, "chunks": STORED_CHUNKS // 2}},
     "populate_stored_in_own_pool"),                               # a ',' split the pool over two folders
    ({"own_pool": {"files": 0, "bytes": 0, "chunks": 0, "source": L1}}, "populate_stored_in_own_pool"),
])
def test_each_failure_invalidates_the_cell(config, kwargs, check):
    result = gate(config, **kwargs)
    assert not result["valid"]
    assert result["checks"][check]["ok"] is False and result["checks"][check]["status"] == "failed"
    assert any(reason.startswith(check) for reason in failures(result))


def test_a_faithful_pool_in_another_split_than_the_document_path_is_valid(config):
    """The H200 case of issue 32: the pool's hit ends at the document's last whole chunk, vLLM's own cache at
    its last whole block; the shared arm's answers equal the recompute in the pool's split and not the
    after-document one, which is kept as information."""
    result = gate(config)
    outputs = result["checks"]["output_matches_recompute"]
    assert result["valid"] and outputs["value"]["exact"] == 4 and outputs["value"]["equal"] == 4
    assert outputs["information"] == {"cold": {"equal": 0, "of": 4}, "after_document": {"equal": 0, "of": 4}}
    isolated = gate(config, arm="isolated", hits=0)  # no hit: the cold path is its split-matched reference
    assert isolated["valid"], failures(isolated)
    assert isolated["checks"]["output_matches_recompute"]["information"]["cold"] == {"equal": 4, "of": 4}
    wrong = gate(config, arm="isolated", hits=0, outputs=("a", "b", "c", "d"))  # the pool split's, not cold
    assert wrong["checks"]["output_matches_recompute"]["value"]["equal"] == 0 and not wrong["valid"]


def test_a_split_no_reference_reaches_is_not_verified_never_passed(config):
    """A hit the reference did not compute (a third of the document) is counted apart; with nothing compared
    the check is not verified, and the cell's verdict rests on its other checks."""
    result = gate(config, hits=512, outputs=tuple("abcd"))
    outputs = result["checks"]["output_matches_recompute"]
    assert outputs["status"] == "not_verified" and outputs["ok"] is None
    assert outputs["value"]["unmatched"] == 4 and outputs["splits_without_reference"] == [512]
    assert "output_matches_recompute" not in " ".join(failures(result))


def test_a_split_vllm_cannot_cache_is_compared_at_the_nearest_block(config):
    """The reference asked for the whole document and vLLM cached its whole blocks: a measured hit of the
    whole document is compared there, as ``nearest``."""
    result = gate(config, hits=DOC, outputs=tuple("pqrs"))
    outputs = result["checks"]["output_matches_recompute"]
    assert outputs["status"] == "passed" and outputs["value"]["nearest"] == 4 and outputs["value"]["exact"] == 0


def test_an_older_reference_file_reads_as_split_rows(config):
    """results/reference/outputs.csv before splits were recorded: a cold and an after_document row per
    document, with the reference's own cached tokens."""
    older = pd.DataFrame({"doc_id": [*range(4), *range(4)], "output_text": [*"abcd", *"wxyz"],
                          "path": ["after_document"] * 4 + ["cold"] * 4,
                          "cached_tokens": [POOL_SPLIT] * 4 + [0] * 4, "error": [""] * 8})
    assert gate(config, reference=older)["checks"]["output_matches_recompute"]["value"]["exact"] == 4


def test_isolated_arm_must_load_nothing(config):
    assert gate(config, arm="isolated", hits=0)["valid"]
    leaked = gate(config, arm="isolated", hits=10)
    assert leaked["checks"]["isolation"]["ok"] is False


def test_memory_tiers_make_the_cold_read_and_file_checks_not_applicable(config):
    """On a pool held in an MP server's RAM there is no device read to force and no file to hash: both
    checks say so, neither passes, and the verdict rests on the others."""
    drop = {"memory_backed": True, "resident_fraction": None, "pool_in": "the LMCache server's L1 (host RAM)"}
    result = gate(config, drop=drop, unchanged={"files": 0, "changed": 0, "missing": 0, "example": ""},
                  own_pool={"files": 0, "bytes": 10**9, "resident_bytes": None, "source": L1, "chunks": 0})
    # the server's own count of what its L1 holds stands in for the files it has none of
    assert result["checks"]["populate_stored_in_own_pool"]["status"] == "passed"
    for name in ("cold_reads", "pool_unchanged"):
        assert result["checks"][name]["status"] == "not_applicable" and result["checks"][name]["ok"] is None
        assert "L1" in result["checks"][name]["reason"]
    assert result["valid"] and tally(result["checks"])["not_applicable"] == 2


def test_a_verdict_needs_a_passed_check_and_no_failed_one():
    from kvpool.measure.checks import check, not_applicable, not_verified, verdict

    assert not verdict({"a": not_applicable("why"), "b": not_verified("why")})
    assert verdict({"a": check(True, 1, 1), "b": not_verified("why")})
    assert not verdict({"a": check(True, 1, 1), "b": check(False, 0, 1)})
    assert verdict({"old": {"ok": True, "value": 1, "threshold": 1}})  # a record from before statuses


def test_arm_metrics_percentiles_and_rates():
    reuse = pd.DataFrame({"ttft_s": np.arange(1, 101, dtype=float), "error": [""] * 99 + ["boom"],
                          "external_hit_tokens": [500] * 100})
    m = arm_metrics(reuse, wall_s=12.0, warm_s=3.0, slo_s=50.0, doc_tokens=1000)
    assert m["ttft_p50_s"] == pytest.approx(np.percentile(np.arange(1, 100), 50))
    assert m["reload_rate"] == pytest.approx(3 / 100)      # the failed request counts as not warm
    assert m["slo_attainment"] == pytest.approx(50 / 100)
    assert m["errors"] == 1 and m["followups"] == 100
    assert m["mean_pool_hit_fraction"] == pytest.approx(0.5)
    assert np.isnan(m["mean_power_w"])


def test_table1_is_drawn_from_the_cell_table_with_its_intervals():
    """One cell row per arm (kvpool.studies.tables.cell_row, real records); Table 1 sets them side by side, the ratio
    isolated over shared, each TTFT percentile with its bootstrap interval."""
    from kvpool.cells import Cell
    from kvpool.studies.tables import cell_row

    config = {"warm_s": 3.0, "slo_s": 5.0, "workload": {"doc_tokens": 1000}}
    power = {"mean_power_w": None, "gpu_energy_j": None, "replicas": {"0": {"cpu_s": 4.0}}}
    rng = np.random.default_rng(0)

    def row(arm, ttft, valid):
        records = pd.DataFrame({"ttft_s": ttft, "error": [""] * len(ttft), "external_hit_tokens": [1000] * len(ttft)})
        return cell_row(Cell("lmcache-fs", arm, 256, "disk"), records, 40.0, power,
                        {"valid": valid, "checks": {}}, config)

    cells = pd.DataFrame([row("shared", 2.2 + rng.normal(0, 0.05, 40), True),
                          row("isolated", 18.38 + rng.normal(0, 0.5, 40), False)])
    assert (cells["ttft_p50_ci_low_s"] <= cells["ttft_p50_s"]).all()
    assert (cells["ttft_p50_s"] <= cells["ttft_p50_ci_high_s"]).all()
    assert cells.set_index("arm").loc["shared", "replica_cpu_s_per_followup"] == pytest.approx(0.1)
    table = table1(cells)
    p50 = table.set_index("metric").loc["ttft_p50_s"]
    assert p50["ratio"] == pytest.approx(p50["isolated"] / p50["shared"]) and 7 < p50["ratio"] < 10
    assert p50["shared_ci_low"] == cells.set_index("arm").loc["shared", "ttft_p50_ci_low_s"]
    assert np.isnan(table.set_index("metric").loc["reload_rate", "ratio"])
    text = table1_markdown(table)
    assert "Isolated (INVALID)" in text and "Shared (valid)" in text
    assert re.search(r"\| ttft_p50_s \| 18\.\d+ s \[18\.\d+, 18\.\d+\] \(n=40\) "
                     r"\| 2\.\d+ s \[2\.\d+, 2\.\d+\] \(n=40\) \|", text)
    # 40 follow-ups make a p95 but not a p99: that row names the largest of them
    assert re.search(r"\| ttft_p99_s \| max of 40: 1\d\.\d+ s \| max of 40: 2\.\d+ s \| \d\.\dx \(of maxima\) \|", text)


METRICS = """# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 5888.0
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 5888.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 312.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 0.0
"""


def test_counters_from_a_real_metrics_page():
    counters = token_counters(METRICS)
    assert counters == {"external_hits": 5888.0, "external_kv_transfer": 5888.0, "local_compute": 312.0,
                        "local_cache_hit": 0.0}
    assert delta(counters, token_counters(""))["external_kv_transfer"] == 5888


def test_a_failed_pool_write_is_named_by_the_gate(config):
    result = gate(config, write_errors=["replica-0.log: OSError: [Errno 28] No space left on device"])
    assert not result["valid"] and not result["checks"]["pool_writes"]["ok"]
    assert any("No space left on device" in reason for reason in failures(result))


def test_write_errors_are_read_from_this_phase_s_log_lines_only(tmp_path):
    from kvpool.measure.logs import log_sizes, new_lines_matching

    old = tmp_path / "replica-0.log"
    old.write_text("[Errno 28] No space left on device (an earlier run)\n")
    since = log_sizes(tmp_path)
    with open(old, "a") as handle:
        handle.write("INFO stored 512 tokens\nERROR LMCache: failed to store: [Errno 28] No space left on device\n")
    (tmp_path / "servers").mkdir()
    (tmp_path / "servers" / "lmcache-server-0.log").write_text("OSError: [Errno 122] Disk quota exceeded\n")
    found = new_lines_matching(tmp_path, since)
    assert found == ["replica-0.log: ERROR LMCache: failed to store: [Errno 28] No space left on device",
                     "lmcache-server-0.log: OSError: [Errno 122] Disk quota exceeded"]


def test_the_run_gate_fails_on_kv_bytes_that_differ_where_they_must_agree(tmp_path):
    from kvpool.report.gate import gate as run_gate

    (tmp_path / "validity.csv").write_text(
        "cell,valid,reasons\nbackend~lmcache-fs/arm~shared/chunk~256/tier~disk,True,\n")
    header = "backend,chunk,tier,comparison,keys,equal,differ,bit_exact_expected,example_key,meaning\n"
    clean = header + ("lmcache-fs,256,disk,store_across_arms,32,32,0,True,,m\n"
                      "lmcache-fs,256,disk,recompute_against_store,32,29,3,False,k3,m\n")  # reported, not gated
    (tmp_path / "kv.csv").write_text(clean)
    run_gate(str(tmp_path / "validity.csv"), str(tmp_path / "kv.csv"), str(tmp_path / "ok"))
    assert (tmp_path / "ok").read_text().startswith("1 cells valid")
    (tmp_path / "kv.csv").write_text(clean + "lmcache-fs,256,disk,after_load_against_cold,4,3,1,True,k9,m\n")
    with pytest.raises(SystemExit, match="after_load_against_cold: 1 of 4 chunks differ .*k9"):
        run_gate(str(tmp_path / "validity.csv"), str(tmp_path / "kv.csv"), str(tmp_path / "ok2"))
    assert not (tmp_path / "ok2").exists()


def test_the_run_gate_fails_on_an_invalid_study_b_block_or_pairing(tmp_path):
    import json

    from kvpool.report.gate import gate as run_gate

    (tmp_path / "validity.csv").write_text(
        "cell,valid,reasons\nbackend~lmcache-fs/arm~shared/chunk~256/tier~disk,True,\n")
    (tmp_path / "kv.csv").write_text("backend,chunk,tier,comparison,keys,equal,differ,bit_exact_expected,example_key,"
                                     "meaning\n")
    study = {"valid": True, "blocks": {"1-off": {"arm": "off", "valid": True, "failed": []},
                                       "2-on": {"arm": "on", "valid": True, "failed": []}},
             "checks": {"outputs_equal_across_pairs": {"ok": True, "value": 12, "threshold": 12}}}
    (tmp_path / "studyb.json").write_text(json.dumps(study))
    run_gate(str(tmp_path / "validity.csv"), str(tmp_path / "kv.csv"), str(tmp_path / "ok"),
             studyb_json=str(tmp_path / "studyb.json"))
    assert "Study B's blocks valid" in (tmp_path / "ok").read_text()
    study["valid"] = False
    study["blocks"]["2-on"].update(valid=False, failed=["chain_answers_agree"])
    study["checks"]["outputs_equal_across_pairs"].update(ok=False, value=9)
    (tmp_path / "studyb.json").write_text(json.dumps(study))
    with pytest.raises(SystemExit, match=r"(?s)block 2-on \(on\): chain_answers_agree.*outputs_equal_across_pairs: 9 "
                                         r"of 12"):
        run_gate(str(tmp_path / "validity.csv"), str(tmp_path / "kv.csv"), str(tmp_path / "ok2"),
                 studyb_json=str(tmp_path / "studyb.json"))
    assert not (tmp_path / "ok2").exists()


def test_a_long_write_error_is_quoted_with_its_cause(tmp_path):
    """LMCache names the whole chunk path before the errno: the quote keeps the cause, not the path's start."""
    from kvpool.measure.logs import new_lines_matching

    path = "/pools/" + "x" * 400 + "@float.data"
    (tmp_path / "replica-0.log").write_text(f"\x1b[31;20m[t] LMCache ERROR:\x1b[0m Failed to write file {path}: "
                                            "[Errno 28] No space left on device (fs_connector.py:12)\n")
    (found,) = new_lines_matching(tmp_path, {})
    assert found.endswith("@float.data: [Errno 28] No space left on device (fs_connector.py:12)")
    assert "\x1b" not in found and len(found) < 330


def test_a_pool_server_that_died_is_named_in_the_cell_and_its_phase_keeps_its_records(tmp_path):
    """A Redis server killed during reuse: reading its pool back raises, and the phase records why
    instead of crashing (which would lose populate's records with the job); the gate names it."""
    from kvpool.measure.kvbytes import DIGEST_COLUMNS
    from kvpool.studies import study_a

    class DeadServer:
        def digest_rows(self):
            raise OSError("redis server 0 (redis://127.0.0.1:18102): Connection refused")

    meta = {"pool_server": {"0": {"error": "redis server 0: exited with -9", "metrics": {}}}}
    digests = study_a.readable_digests([tmp_path], [DeadServer()], None, meta)
    assert list(digests.columns) == DIGEST_COLUMNS and digests.empty
    assert "Connection refused" in meta["pool_digest_error"]
    errors = study_a.server_errors({"pool_server": {"0": {"metrics": {}}}}, meta)
    assert errors == ["redis server 0: exited with -9",
                      "the pool could not be read back: redis server 0 (redis://127.0.0.1:18102): Connection refused"]
    assert study_a.server_errors({}, {}) is None  # a pool of files: no servers, no check


def test_a_replica_that_runs_what_its_plan_says_passes_and_one_that_does_not_is_named(config):
    from kvpool.measure.validity import served_check

    length = config["engine"]["max_model_len"]
    planned = [{"0": {"max_model_len": length, "chunk_sizes": [256]}, "1": {"max_model_len": length,
                                                                         "chunk_sizes": []}}]
    assert served_check(planned, length, 256)["ok"]  # replica 1 logged no chunk size: nothing to hold
    wrong = served_check([{**planned[0], "1": {"max_model_len": length, "chunk_sizes": [256, 512]}}], length, 256)
    assert not wrong["ok"] and wrong["examples"] == ["replica 1's LMCache runs chunk_size [256, 512], the cell 256"]
    unread = served_check([{"0": {"error": "replica 0: /v1/models could not be read: timed out"}}], length, 256)
    assert not unread["ok"] and "timed out" in unread["examples"][0]


def test_every_unit_kind_s_gate_holds_its_fleet_to_the_plan_and_old_records_keep_their_verdict():
    """Load levels, the replay, router and length units and Study B's blocks add served_as_planned to
    their gate (validity.with_served); a unit recorded before replicas were read keeps its gate."""
    from kvpool.measure.checks import check
    from kvpool.measure.validity import with_served

    gate = {"valid": True, "checks": {"zero_errors": check(True, 0, 0)}}
    assert with_served(gate, {}, 4096, 256) == gate
    wrong = with_served(gate, {"served": {"0": {"max_model_len": 2048, "chunk_sizes": [256]}}}, 4096, 256)
    assert not wrong["valid"] and wrong["checks"]["zero_errors"]["ok"]
    assert wrong["checks"]["served_as_planned"]["examples"] == ["replica 0 serves max_model_len 2048, the plan 4096"]
    right = with_served(gate, {"served": {"0": {"max_model_len": 4096, "chunk_sizes": []}}}, 4096, 256)
    assert right["valid"] and right["checks"]["served_as_planned"]["ok"]

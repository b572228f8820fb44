"""The study's published matrix plans on any machine (no GPU, no drives, no model needed)."""

import re
import subprocess
import sys

import pytest
from snakemake.utils import validate
from support import REPO


def test_paper_config_dry_run_plans_the_whole_matrix(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(REPO / "config" / "paper.yaml")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    # 2 backends x 2 arms x 3 chunk sizes x 2 tiers = 24 cells, each one job on one fleet (populate, drop,
    # reuse); no model is built for a named model
    assert re.search(r"^cell\s+24$", out, re.M), out[-2000:]
    assert not re.search(r"^model\s+\d+$", out, re.M)
    assert "backend~lmcache-fs/arm~shared/chunk~2048/tier~qlc/plan.yaml" in out


def test_tier_compare_target_builds_only_what_it_needs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "results/tier_compare.csv", "-s", str(REPO / "Snakefile"),
         "--directory", str(tmp_path), "--configfile", str(REPO / "tests" / "configs" / "e2e.yaml")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for rule in ("cell", "telemetry", "ceiling", "tier_compare"):  # cell: populate, drop and reuse on one fleet
        assert re.search(rf"^{rule}\s+\d+$", out, re.M), rule
    assert re.search(r"^cell\s+1$", out, re.M)  # the shared arm only
    for rule in ("reference", "validity", "table1", "report"):
        assert not re.search(rf"^{rule}\s+\d+$", out, re.M), rule


@pytest.mark.parametrize("name, replicas, gpus, packed", [("h200.yaml", 2, {0}, True),
                                                         ("h200x2.yaml", 2, {0, 1}, False),
                                                          ("h200x4.yaml", 4, {0, 1, 2, 3}, False)])
def test_gpu_validation_configs_plan_on_any_machine(tmp_path, name, replicas, gpus, packed):
    """The H200 configs dry-run here; their launch plans put replicas where the config says."""
    from snakemake.utils import validate

    from kvpool.cells import Cell
    from kvpool.config import load
    from kvpool.engine.plan import fleet_plan

    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(REPO / "config" / name)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^cell\s+4$", out, re.M)  # 2 arms x 2 tiers (ram, disk), each cell's phases on one fleet
    assert re.search(r"^model\s+1$", out, re.M)     # the random model is built (on the GPU)
    # keep_pools: false: a tier holds one cell's pool, so its isolated cell populates after the
    # shared cell's reuse has removed that pool
    for tier in ("ram", "disk"):
        populate = re.search(rf"input: (.*)\n\s+output: results/cells/backend~lmcache-fs/arm~isolated/chunk~256/"
                             rf"tier~{tier}/populate.csv", out)
        assert f"arm~shared/chunk~256/tier~{tier}/reuse.json" in populate.group(1), out[-3000:]
    config = load(REPO / "config" / name, REPO)
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    cell = Cell("lmcache-fs", "shared", 256, "ram")
    plan = fleet_plan(config, cell, "resources/model", tmp_path, list(range(18100, 18100 + replicas)), "auto")
    assert {r.env["CUDA_VISIBLE_DEVICES"] for r in plan.replicas} == {str(g) for g in gpus}
    assert all(r.argv[:2] == ["vllm", "serve"] and "--enforce-eager" in r.argv for r in plan.replicas)
    shares = {r.argv[r.argv.index("--gpu-memory-utilization") + 1] for r in plan.replicas}
    assert shares == ({"0.4200"} if packed else {"0.9000"})
    assert all(r.sequential_start == packed for r in plan.replicas)


@pytest.mark.parametrize("name, doc_tokens, gpus, packed", [("h200-128k.yaml", 131072, {0}, True),
                                                            ("h200x2-256k.yaml", 262144, {0, 1}, False),
                                                            ("h200x2-mp-128k.yaml", 131072, {0, 1}, False),
                                                            ("h200x2-mp-256k.yaml", 262144, {0, 1}, False)])
def test_study_b_long_context_configs_plan_on_any_machine(tmp_path, name, doc_tokens, gpus, packed):
    """Study B's 128k and 256k contexts: a host-memory pool, both arms, prompts that fit the engine."""
    from snakemake.utils import validate

    from kvpool.cells import Cell
    from kvpool.config import load, pool_bytes_per_cell, problems
    from kvpool.engine.plan import fleet_plan

    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(REPO / "config" / name)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    config = load(REPO / "config" / name, REPO)
    # 2 arms x the ram tier: each cell's phases in one job on one fleet (an MP server's L1 around it)
    assert re.search(r"^cell\s+2$", result.stdout, re.M)
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    assert config["workload"]["doc_tokens"] == doc_tokens and list(config["tiers"]) == ["ram"]
    assert problems(config, tmp_path, check_paths=False) == []
    # the gate's pool floor is 90% of the documents' KV (64 KiB per token)
    kv = config["workload"]["documents"] * doc_tokens * 65536
    assert 0.89 * kv < config["min_pool_bytes"] < 0.91 * kv
    assert pool_bytes_per_cell(config, "isolated") > pool_bytes_per_cell(config, "shared")
    backend = config["backends"][0]
    plan = fleet_plan(config, Cell(backend, "shared", 256, "ram"), "resources/model", tmp_path, [18100, 18101],
                      "auto", server_ports=[18102, 18103] if backend == "lmcache-mp" else None)
    assert {r.env["CUDA_VISIBLE_DEVICES"] for r in plan.replicas} == {str(g) for g in gpus}
    assert all(r.sequential_start == packed for r in plan.replicas)


@pytest.mark.parametrize("name, gpus", [("h200x2-mp-studyb.yaml", ["0", "1"]), ("h200-mp-studyb.yaml", ["0", "0"])])
def test_study_b_gpu_config_plans_its_four_blocks_on_the_mp_pool(tmp_path, name, gpus):
    """Study B's design on the H200s (one replica per GPU, or both packed on one): the four blocks and
    the tables, nothing of Study A's cells; the ON blocks plan an MP server, the OFF blocks no
    connector; its contexts and sessions fit the engine."""
    from kvpool.config import load, problems
    from kvpool.studies import studyb

    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "results/studyb.md", "-n", "-s", str(REPO / "Snakefile"), "--directory",
         str(tmp_path), "--configfile", str(REPO / "config" / name)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^studyb_block\s+4$", result.stdout, re.M) and not re.search(r"^(populate|cell)\s",
                                                                                   result.stdout, re.M)
    config = load(REPO / "config" / name, REPO)
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    assert problems(config, tmp_path, check_paths=False) == []
    study = studyb.resolved(config)
    assert (study["backend"], study["tier"], max(study["contexts"])) == ("lmcache-mp", "ram", 131072)
    from kvpool.engine.plan import fleet_plan

    on = fleet_plan(config, studyb.block_cell(study, studyb.ON), "m", tmp_path, [18100, 18101], "auto",
                    server_ports=[18102, 18103], pool_root=tmp_path / "pool")
    off = fleet_plan(config, studyb.block_cell(study, studyb.OFF), "m", tmp_path, [18100, 18101], "auto")
    (server,) = on.servers  # one MP server (host RAM) for both replicas
    assert {r.kv_transfer["kv_connector"] for r in on.replicas} == {"LMCacheMPConnector"}
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in on.replicas] == gpus and server.l2_dir is None
    assert not off.servers and all(r.kv_transfer is None for r in off.replicas)
    # a Study A GPU config leaves Study B out of `all`
    assert not load(REPO / "config" / "h200.yaml", REPO)["study_b"]["enabled"]


def test_the_selftest_config_is_the_default_with_a_fault_injected(tmp_path):
    from kvpool.config import load, problems

    selftest, default = (load(REPO / "config" / name, REPO) for name in ("selftest.yaml", "config.yaml"))
    for config in (selftest, default):
        validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    assert selftest["fault_injection"] == {"corrupt_stored_chunk": True}
    assert {k: v for k, v in selftest.items() if k not in ("extends", "fault_injection")} == \
        {k: v for k, v in default.items() if k != "fault_injection"}
    assert problems(selftest, tmp_path, check_paths=False) == []


def test_gpu_overlays_resolve_over_their_base_as_written(tmp_path):
    """The GPU configs are small overlays of config/h200.yaml: what one sets wins, what it leaves comes
    from the base, and a tier set to null is gone."""
    from kvpool.config import load

    base = load(REPO / "config" / "h200.yaml", REPO)
    mp_256k = load(REPO / "config" / "h200x2-mp-256k.yaml", REPO)  # over h200x2-256k over h200x2 over h200
    assert mp_256k["extends"] == "config/h200x2-256k.yaml"
    assert mp_256k["backends"] == ["lmcache-mp"] and mp_256k["workload"]["doc_tokens"] == 262144
    assert mp_256k["engine"]["gpus"] == "auto" and mp_256k["engine"]["replicas_per_gpu"] == 1  # from h200x2
    assert mp_256k["engine"]["extra_args"] == base["engine"]["extra_args"] == ["--enforce-eager"]  # from h200
    assert mp_256k["random_model"] == {**base["random_model"], "max_positions": 524288}
    assert list(mp_256k["tiers"]) == ["ram"] and list(base["tiers"]) == ["ram", "disk"]
    # every overlay names an engine kind that runs on GPUs: none silently falls back to vllm-cpu
    for path in sorted((REPO / "config").glob("h200*.yaml")):
        assert load(path, REPO)["engine"]["kind"] == "vllm", path.name

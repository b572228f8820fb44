"""The committed H200 load runs (two replicas packed on one H200, LMCache's MP server with a host-RAM
L1, 64 documents of 8,192 tokens), re-read by the pipeline's own code: each level's gate again from its
records, the pool repopulated to the cell's bytes before every level, the server's counters against the
responses' hits, and the load table rebuilt byte for byte. Then each run's measured finding.

- docs/results/h200-mp-load: the shared arm at 1, 4 and 16 in flight (config/h200-mp-load.yaml);
- docs/results/h200-mp-load-arms: a second session, both arms, the packed replicas started at once on a
  fixed KV cache size: isolated at 1, 4 and 16, shared at 1 and 4;
- docs/results/h200-mp-load-c32: a third session, both arms at 1, 32 and 16
  (config/h200-mp-load-c32.yaml), on the reference outputs of h200-mp-load-arms;
- docs/results/h200-mp-workers: a fourth, the shared arm at 1 and 32 with two GPU worker threads in the
  MP server (config/h200-mp-workers.yaml, lmcache_mp.gpu_workers);
- docs/results/h200-mp-knee: a fifth, the shared arm at 1, 16, 32 and 24 in one session, each level's time
  split by the replicas' histograms (config/h200-mp-knee.yaml)."""

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml
from snakemake.utils import validate
from support.committed import assert_same_gate

from kvpool.cells import Cell
from kvpool.measure import reference as reference_module
from kvpool.measure import reuse_checks, validity
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.report import load as load_report
from kvpool.studies import load

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
ISOLATED, SHARED = Cell("lmcache-mp", "isolated", 256, "ram"), Cell("lmcache-mp", "shared", 256, "ram")
TWO_WORKERS = Cell("lmcache-mp", "shared", 256, "ram", gpu_workers=2)
KV_BYTES_PER_TOKEN = 64 * 1024  # the random Llama's 32 layers x 4 KV heads x 128 x (K, V) x 2 bytes


@dataclass(frozen=True)
class Run:
    folder: str
    commits: dict  # cell -> the commit its manifest names
    levels: dict  # cell -> its load levels beyond the reuse phase, in run order
    started_at_once: bool  # engine.kv_cache_memory_gib: both packed replicas start together

    @property
    def root(self) -> Path:
        return RESULTS / self.folder

    def cell_dir(self, cell: Cell) -> Path:
        return self.root / "results" / "cells" / cell.name

    def level_dir(self, cell: Cell, level: str) -> Path:
        return self.cell_dir(cell) / f"load~{level}"

    def units(self) -> list[tuple[Cell, str]]:
        return [(cell, level) for cell, levels in self.levels.items() for level in levels]


FIRST = Run("h200-mp-load", {SHARED: "c02e6dc67c44e9ab0e032066f77c4b6db7937009"}, {SHARED: ["c4", "c16"]}, False)
ARMS = Run("h200-mp-load-arms",
           {cell: "ef291c29bbc2796b4dc180fb3b3921a009ba3992" for cell in (ISOLATED, SHARED)},
           {ISOLATED: ["c4", "c16"], SHARED: ["c4"]}, True)
# the first call measured the isolated cell; the level order then became [1, 32, 16] (58f3198)
C32 = Run("h200-mp-load-c32",
          {ISOLATED: "01b223ab01134b73ab10cf43616815e6fe5b4314", SHARED: "58f3198cfedabda182ec53dd65e1fa3dd7a8f05d"},
          {ISOLATED: ["c32", "c16"], SHARED: ["c32", "c16"]}, True)
WORKERS = Run("h200-mp-workers", {TWO_WORKERS: "abb3eaa29528ae177aae16cdb6e7f4715f617dee"},
              {TWO_WORKERS: ["c32"]}, True)
# the levels in the order they ran: the knee's two known ends first (config/h200-mp-knee.yaml)
KNEE = Run("h200-mp-knee", {SHARED: "ac987231a10c94084c1a9de0513607c40d206ca3"}, {SHARED: ["c16", "c32", "c24"]},
           True)
RUNS = [FIRST, ARMS, C32, WORKERS, KNEE]
UNITS = [(run, cell, level) for run in RUNS for cell, level in run.units()]
UNIT_IDS = [f"{run.folder}-{cell.arm}-{level}" for run, cell, level in UNITS]
LINK_GB_PER_S = read_json(RESULTS / "h200-link" / "results" / "tiers" / "ram" / "ceiling.json")["link"]["gb_per_s"]


def config_of(run: Run, cell: Cell) -> dict:
    config = read_json(run.cell_dir(cell) / "manifest.json")["config"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


@pytest.mark.parametrize("run", RUNS, ids=[run.folder for run in RUNS])
def test_each_cell_was_measured_on_an_h200_by_its_commit_with_two_replicas_packed(run):
    for cell, commit in run.commits.items():
        manifest = read_json(run.cell_dir(cell) / "manifest.json")
        assert manifest["git"]["commit"] == commit and "H200" in json.dumps(manifest["hardware"])
        config = config_of(run, cell)
        assert config["engine"]["replicas_per_gpu"] == 2
        replicas = yaml.safe_load((run.cell_dir(cell) / "plan.yaml").read_text())["replicas"]
        assert [r["gpu"] for r in replicas] == [0, 0]
        assert [r["sequential_start"] for r in replicas] == [not run.started_at_once] * 2
        if run.started_at_once:
            assert config["engine"]["kv_cache_memory_gib"] == 44.34
            assert all(r["argv"][r["argv"].index("--kv-cache-memory") + 1] == str(int(44.34 * 2**30))
                       for r in replicas)
        for level in run.levels[cell]:  # every level ran after the cell's reuse, on the same machine
            meta = read_json(run.level_dir(cell, level) / "level.json")
            reuse = read_json(run.cell_dir(cell) / "reuse.json")
            assert meta["level"] == level and meta["started_at"] > reuse["started_at"]


@pytest.mark.parametrize(("run", "cell", "level"), UNITS, ids=UNIT_IDS)
def test_each_level_is_valid_again_from_its_records(run, cell, level):
    config = config_of(run, cell)
    meta = read_json(run.level_dir(cell, level) / "level.json")
    rows = read_records(str(run.level_dir(cell, level) / "requests.csv"))
    hits = load.attribution(rows, meta["window_external_tokens"])
    reference = read_records(str(run.root / "results" / "reference" / "outputs.csv"))
    in_flight = load.in_flight_limit(load.Level.from_name(level), 1)
    outputs = reuse_checks.outputs_check(rows, reference, in_flight, batch_invariant=False)
    checks = load.level_checks(cell.arm, rows, hits, meta["drop_before_level"], meta["checks"]["pool_restored"],
                               config["workload"]["doc_tokens"], config["min_hit_fraction"],
                               config["max_resident_fraction"], outputs)
    checks = validity.with_served(checks, meta, config["engine"]["max_model_len"], cell.chunk)
    assert checks["valid"] and meta["valid"]
    # runs recorded before a level's gate compared answers with the recompute lack that check
    assert_same_gate(meta["checks"], checks["checks"],
                     new={"output_matches_recompute"} - set(meta["checks"]))
    # N in flight without batch-invariant kernels: the answers are not verified, and rightly so. Compared
    # anyway, a third to a half of them differ from the recompute one at a time, in the isolated arm (no
    # pool) as in the shared one: the batch a request shares changes its numerics, not the pool
    assert outputs["status"] == "not_verified" and outputs["value"] == {"answers": 64, "in_flight": in_flight}
    compared = reference_module.comparisons(validity.followup_keys(rows), reference)
    assert (compared["match"] == "exact").all() and 10 < compared["equal"].sum() < 40
    # N in flight: every document's follow-up once, to the replica that did not prefill it
    assert len(rows) == config["workload"]["documents"] and set(rows["doc_id"]) == set(range(len(rows)))
    assert (rows["prefill_replica"] != rows["serve_replica"]).all()
    # the isolated arm's serving replica never held the document: nothing came from a pool
    tokens = config["workload"]["doc_tokens"]
    expected = 0 if cell.arm == "isolated" else tokens
    assert (rows["cached_tokens"] == expected).all() and (rows["external_hit_tokens"] == expected).all()
    counters = meta["pool_server"]["0"]["metrics"]
    if cell.arm == "shared":  # the one server loaded every chunk the responses counted
        assert counters["lmcache_mp_lookup_hit_tokens_total"] == rows["external_hit_tokens"].sum()
        assert counters["lmcache_mp_num_chunks_loaded_total"] == len(rows) * tokens // cell.chunk


@pytest.mark.parametrize(("run", "cell", "level"), UNITS, ids=UNIT_IDS)
def test_every_level_started_on_a_pool_populated_again_to_the_cells_bytes(run, cell, level):
    """A memory pool cannot be restored in place: each level's fresh servers were populated again, by
    the same placement, to exactly the L1 bytes of the cell's own populate."""
    config = config_of(run, cell)
    unit = run.level_dir(cell, level)
    restored = read_json(unit / "level.json")["pool_restore"]
    documents, tokens = config["workload"]["documents"], config["workload"]["doc_tokens"]
    # the documents' KV and the preflight probe's whole chunks (it stores 513 tokens: two chunks) in
    # each pool: the shared arm's one server, or each isolated replica's own
    probe = read_json(unit / "populate.json")["preflight"]["probe_tokens"] // cell.chunk * cell.chunk
    pools = 1 if cell.arm == "shared" else config["replicas"]
    assert restored["bytes"] == restored["cell_bytes"] == (documents * tokens + pools * probe) * KV_BYTES_PER_TOKEN
    assert restored["bytes"] > 0.9 * config["min_pool_bytes"]
    again, first = pd.read_csv(unit / "populate.csv"), pd.read_csv(run.cell_dir(cell) / "populate.csv")
    assert again["prefill_replica"].tolist() == first["prefill_replica"].tolist()


def rebuilt_table(run: Run, tmp_path: Path) -> pd.DataFrame:
    """The run's load table made again from its records; it must equal the committed one byte for byte."""
    def files(cell):
        return {"csv": str(run.cell_dir(cell) / "reuse.csv"), "meta": str(run.cell_dir(cell) / "reuse.json"),
                "validity": str(run.cell_dir(cell) / "validity.json"),
                "telemetry": str(run.cell_dir(cell) / "telemetry" / "summary.json")}

    cells = [cell for cell in (SHARED, ISOLATED, TWO_WORKERS) if cell in run.levels]
    levels = {(cell, level): {"csv": str(run.level_dir(cell, level) / "requests.csv"),
                              "meta": str(run.level_dir(cell, level) / "level.json")} for cell, level in run.units()}
    load_report.run_load_table(config_of(run, cells[0]), cells, reuse={cell: files(cell) for cell in cells},
                               levels=levels, csv_out=str(tmp_path / "load.csv"), md_out=str(tmp_path / "load.md"))
    for name in ("load.csv", "load.md"):
        assert (tmp_path / name).read_text() == (run.root / "results" / name).read_text()
    table = pd.read_csv(run.root / "results" / "load.csv").set_index(["arm", "level"])
    assert table["valid"].all() and (table["errors"] == 0).all()
    return table


def test_first_run_the_pools_reload_rate_climbs_with_concurrency(tmp_path):
    shared = rebuilt_table(FIRST, tmp_path).loc["shared"]
    # from 1 to 16 in flight the KV delivered per second keeps climbing (no plateau of the software
    # path yet) while TTFT p50 grows, every follow-up a whole-document hit
    assert shared.loc[["c1", "c4", "c16"], "loaded_gb_per_s"].is_monotonic_increasing
    assert shared.loc[["c1", "c4", "c16"], "ttft_p50_s"].is_monotonic_increasing
    assert (shared["hit_fraction"] == 1.0).all()


def test_arms_run_the_isolated_arm_stops_at_the_gpus_compute(tmp_path):
    table = rebuilt_table(ARMS, tmp_path)
    isolated, shared = table.loc["isolated"], table.loc["shared"]
    # recomputing 8,192 tokens per follow-up on the shared GPU: throughput flat from c4, TTFT growing with the queue
    assert isolated.loc["c16", "achieved_rps"] < 1.2 * isolated.loc["c4", "achieved_rps"]
    assert isolated.loc[["c1", "c4", "c16"], "ttft_p50_s"].is_monotonic_increasing
    for level in ("c1", "c4"):  # the shared pool: faster and more follow-ups per second at each level
        assert shared.loc[level, "ttft_p50_s"] < isolated.loc[level, "ttft_p50_s"]
        assert shared.loc[level, "achieved_rps"] > isolated.loc[level, "achieved_rps"]


def test_c32_run_both_arms_at_32_in_flight_in_one_session(tmp_path):
    table = rebuilt_table(C32, tmp_path)
    isolated, shared = table.loc["isolated"], table.loc["shared"]
    order = ["c1", "c16", "c32"]
    # the isolated arm: no more follow-ups per second past 16 in flight, the queue in its TTFT, and
    # at 32 its p99 past the 5 s SLO, so goodput falls below what it delivers
    assert isolated.loc["c32", "achieved_rps"] < 1.1 * isolated.loc["c16", "achieved_rps"]
    assert isolated.loc["c32", "goodput_rps"] < isolated.loc["c32", "achieved_rps"]
    assert isolated.loc[order, "ttft_p50_s"].is_monotonic_increasing
    # the shared arm: still more follow-ups and KV per second at 32, all within the SLO, and at every
    # level faster, with more follow-ups per second and less energy each
    assert shared.loc[order, "achieved_rps"].is_monotonic_increasing
    assert shared.loc[order, "loaded_gb_per_s"].is_monotonic_increasing
    assert (shared["goodput_rps"] == shared["achieved_rps"]).all() and (shared["hit_fraction"] == 1.0).all()
    for level in order:
        assert shared.loc[level, "ttft_p50_s"] < isolated.loc[level, "ttft_p50_s"]
        assert shared.loc[level, "achieved_rps"] > isolated.loc[level, "achieved_rps"]
        assert shared.loc[level, "energy_per_request_j"] < isolated.loc[level, "energy_per_request_j"]


def test_c32_run_answers_as_the_earlier_sessions_reference():
    """This session had no device time for its own recompute reference: it took h200-mp-load-arms'
    outputs, and every follow-up of both arms here (recomputed or reloaded) gave the same tokens."""
    reference = pd.read_csv(C32.root / "results" / "reference" / "outputs.csv")
    assert reference.equals(pd.read_csv(ARMS.root / "results" / "reference" / "outputs.csv"))
    cold = reference[reference["path"] == "cold"].set_index("doc_id")["output_text"]
    for cell in (ISOLATED, SHARED):
        reuse = pd.read_csv(C32.cell_dir(cell) / "reuse.csv").set_index("doc_id")["output_text"]
        assert len(reuse) == 64 and (reuse == cold.loc[reuse.index]).all()
        assert read_json(C32.cell_dir(cell) / "validity.json")["valid"]


def test_workers_run_a_second_gpu_worker_thread_does_not_lift_32_in_flight(tmp_path):
    """One thread per replica in the MP server (LMCache binds each engine to one) against LMCache's one
    thread for both, measured a session earlier: no gain at either level. The link is not the limit
    either: in the c32 window its copies run at the link's rate, and most of the time it idles."""
    plan = yaml.safe_load((WORKERS.cell_dir(TWO_WORKERS) / "plan.yaml").read_text())
    (server,) = plan["servers"]
    assert server["argv"][server["argv"].index("--max-gpu-workers") + 1] == "2"
    two = rebuilt_table(WORKERS, tmp_path).loc["shared"]
    one = pd.read_csv(C32.root / "results" / "load.csv").set_index(["arm", "level"]).loc["shared"]
    for level in ("c1", "c32"):  # the TTFT p50 intervals overlap
        assert two.loc[level, "ttft_p50_ci_low_s"] < one.loc[level, "ttft_p50_ci_high_s"]
        assert one.loc[level, "ttft_p50_ci_low_s"] < two.loc[level, "ttft_p50_ci_high_s"]
    assert two.loc["c32", "achieved_rps"] < one.loc["c32", "achieved_rps"]
    samples = pd.read_csv(WORKERS.level_dir(TWO_WORKERS, "c32") / "power-samples.csv")
    rx = samples["pcie_rx_gb_per_s"].dropna()
    assert rx.max() > 0.95 * LINK_GB_PER_S > 3 * two.loc["c32", "loaded_gb_per_s"]
    assert (rx < 1).sum() > len(rx) / 2


def test_knee_run_the_shared_pool_stops_gaining_by_16_in_flight_and_every_part_of_the_time_grows(tmp_path):
    """One session, one machine: 16, 24 and 32 in flight deliver the same follow-ups per second (within
    5%), while TTFT p50 doubles with intervals apart. The replicas' own histograms say where the added
    time goes: queue (which holds the MP connector's asynchronous load), prefill and decode all grow, decode
    the most; the KV arrives at under 40% of the link. The knee is at or below 16."""
    shared = rebuilt_table(KNEE, tmp_path).loc["shared"]
    loaded = shared.loc[["c16", "c24", "c32"]]
    assert loaded["achieved_rps"].max() < 1.05 * loaded["achieved_rps"].min()
    assert loaded["achieved_rps"].min() > 5 * shared.loc["c1", "achieved_rps"]
    assert shared.loc["c32", "ttft_p50_ci_low_s"] > shared.loc["c16", "ttft_p50_ci_high_s"]
    assert shared.loc[["c1", "c16", "c24", "c32"], "ttft_p50_s"].is_monotonic_increasing
    growth = {part: shared.loc["c32", f"{part}_mean_s"] - shared.loc["c16", f"{part}_mean_s"]
              for part in ("queue", "prefill", "decode")}
    assert all(grew > 0.03 for grew in growth.values()) and max(growth, key=growth.get) == "decode"
    # the reuse phase (one at a time) reads its split from its requests: a short queue, the same prefill
    assert shared.loc["c1", "queue_mean_s"] < shared.loc["c16", "queue_mean_s"] / 4
    assert (loaded["loaded_gb_per_s"] < 0.4 * LINK_GB_PER_S).all()
    for level in ("c16", "c24", "c32"):  # the window's split counted every request of the level
        times = read_json(KNEE.level_dir(SHARED, level) / "level.json")["window_times"]
        assert {part: entry["requests"] for part, entry in times.items()} == dict.fromkeys(
            ("queue_s", "prefill_s", "decode_s", "server_ttft_s"), 64)

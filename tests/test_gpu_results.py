"""The committed H200 run of the lmcache-mp backend, re-read by the pipeline's own code."""

import json
from pathlib import Path

import yaml
from snakemake.utils import validate

from kvpool import report, validity
from kvpool.cells import Cell
from kvpool.files import read_json, read_records

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs" / "results" / "h200-mp"
SHARED_RAM = Cell("lmcache-mp", "shared", 256, "ram")


def run_config():
    config = read_json(RUN / "results" / "cells" / SHARED_RAM.name / "manifest.json")["config"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def test_the_shared_ram_cell_is_valid_again_from_its_records():
    folder = RUN / "results" / "cells" / SHARED_RAM.name
    populate_meta, reuse_meta = read_json(folder / "populate.json"), read_json(folder / "reuse.json")
    reference = read_records(RUN / "results" / "reference" / "outputs.csv")
    result = validity.evaluate("shared", run_config(), read_records(folder / "populate.csv"),
                               read_records(folder / "reuse.csv"), reference, reuse_meta["drop_before_reuse"],
                               populate_meta["pool"]["bytes"], populate_meta["preflight"], chunk=SHARED_RAM.chunk)
    recorded = read_json(folder / "validity.json")
    # every check the run recorded gives the same again (checks added since pass too)
    assert {name: (c["ok"], c["value"]) for name, c in result["checks"].items() if name in recorded["checks"]} == \
           {name: (c["ok"], c["value"]) for name, c in recorded["checks"].items()}
    assert result["valid"] and result["checks"]["output_matches_recompute"]["value"] == 5


def test_the_server_counted_every_reloaded_chunk():
    table = report.pool_server_table(RUN, [SHARED_RAM])
    reuse = table[table["phase"] == "reuse"].iloc[0]
    followups = read_records(RUN / "results" / "cells" / SHARED_RAM.name / "reuse.csv")
    # 5 follow-ups x 65,536 document tokens: the server's lookups and the replicas' /metrics agree
    assert reuse["lookup_hit_tokens_total"] == followups["external_hit_tokens"].sum() == 5 * 65536
    assert reuse["num_chunks_loaded_total"] == 5 * 65536 / 256


def test_the_plan_ran_one_server_on_loopback_with_an_l1_for_the_whole_pool():
    plan = yaml.safe_load((RUN / "results" / "cells" / SHARED_RAM.name / "plan.yaml").read_text())
    (server,) = plan["servers"]
    assert server["host"] == "127.0.0.1" and server["l2_dir"] is None and server["l1_size_gib"] == 28.7
    assert {json.loads(r["argv"][r["argv"].index("--kv-transfer-config") + 1])["kv_connector"]
            for r in plan["replicas"]} == {"LMCacheMPConnector"}

"""The plan record: what plan.yaml holds, read back through the reader of the schema it was written with."""

from pathlib import Path

import pytest
import yaml

from kvpool.cells import Cell
from kvpool.engine.plan import fleet_plan
from kvpool.engine.plan_types import PLAN_SCHEMA, Plan, plan_from_dict, read_plan, write_plan

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_a_plan_written_is_the_plan_read_back_with_its_schema(config, tmp_path):
    plan = fleet_plan(config, Cell("lmcache-fs", "isolated", 256, "disk"), "/models/m", tmp_path, [18100, 18101],
                      "config")
    write_plan(plan, tmp_path / "plan.yaml")
    assert yaml.safe_load((tmp_path / "plan.yaml").read_text())["schema"] == PLAN_SCHEMA
    assert read_plan(tmp_path / "plan.yaml") == plan


def test_every_committed_plan_reads_through_the_reader_of_its_version():
    plans = sorted(COMMITTED.rglob("plan.yaml"))
    assert len(plans) > 50
    read = [read_plan(path) for path in plans]
    assert all(isinstance(plan, Plan) and plan.schema == PLAN_SCHEMA for plan in read)
    # servers written before Redis existed had no kind: they are LMCache MP servers
    kinds = {server.kind for plan in read for server in plan.servers}
    assert kinds == {"lmcache", "redis"}
    assert all(not plan.servers or plan.memory_pool in (True, False) for plan in read)


def test_a_version_one_plan_gets_its_defaults_and_an_mp_server_its_kind():
    old = {"cell": "c", "engine_kind": "vllm", "model": "m", "port_source": "auto",
           "replicas": [{"index": 0, "host": "127.0.0.1", "port": 1, "core": None, "gpu": 0, "sequential_start": False,
                         "pool_dir": None, "lmcache_config_file": None, "lmcache_config": None, "env": {},
                         "argv": ["vllm", "serve", "m"]}],
           "servers": [{"index": 0, "host": "127.0.0.1", "port": 2, "http_port": 3, "env": {}, "argv": ["lmcache"],
                        "l1_size_gib": 1.0, "l2_dir": None}], "memory_pool": True}
    plan = plan_from_dict(old)
    assert plan.servers[0].kind == "lmcache" and plan.replicas[0].kv_transfer is None
    assert plan.memory_pool and not plan.external and plan.wait_s is None


def test_a_plan_this_kvpool_cannot_read_is_refused_by_name():
    with pytest.raises(ValueError, match="schema 3"):
        plan_from_dict({"schema": 3, "cell": "c"})
    with pytest.raises(ValueError, match=r"fields this kvpool does not know: \['tensor_parallel'\]"):
        plan_from_dict({"schema": PLAN_SCHEMA, "cell": "c", "engine_kind": "vllm", "model": "m", "port_source": "auto",
                        "replicas": [], "tensor_parallel": 2})

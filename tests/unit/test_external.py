"""fleet.mode external without a fleet: its config checks, its plan, what an endpoint says of itself,
what the gate lists as not verified, and the refusal of a pool that is already in use."""

import asyncio
import dataclasses

import pytest
from aiohttp import web
from support.records import DOC, frames

from kvpool.cells import Cell
from kvpool.config import problems
from kvpool.engine import external
from kvpool.engine.plan import plan_pool_dirs
from kvpool.measure.unit_plan import new_plan as _new_plan
from kvpool.measure.validity import evaluate
from kvpool.studies.study_a import _refuse_a_used_external_pool

CELL = Cell("lmcache-fs", "shared", 256, "disk")
URLS = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]


def external_config(config, **fleet):
    config.update(arms=["shared"], load={**config["load"], "concurrency": [1], "rates": []},
                  tiers={"disk": config["tiers"]["disk"]})
    config["peer"]["enabled"] = False
    config["study_b"]["enabled"] = False
    config["fleet"] = {"mode": "external", "endpoints": {"shared": URLS}, "pool_dirs": {}, "reference": True,
                       "wait_s": 60, **fleet}
    return config


def test_an_external_config_with_its_endpoints_has_no_problems(config, tmp_path):
    assert problems(external_config(config), tmp_path) == []


@pytest.mark.parametrize(("change", "named"), [
    (lambda c: c["fleet"]["endpoints"].update(shared=URLS[:1]), "fleet.endpoints.shared lists 1 URLs for 2 replicas"),
    (lambda c: c["fleet"]["endpoints"].update(shared=[URLS[0]] * 2), "lists one server twice"),
    (lambda c: c.update(arms=["shared", "isolated"]), "fleet.endpoints.isolated: an external fleet needs"),
    (lambda c: c["fleet"]["endpoints"].update(isolated=URLS), "fleet.endpoints.isolated: isolated is not in arms"),
    (lambda c: c["fleet"]["pool_dirs"].update(shared=["/p"]), "fleet.pool_dirs.shared lists 1 directories"),
    (lambda c: c.update(chunk_sizes=[256, 1024]), "one backend at one chunk size"),
    (lambda c: c["tiers"].update(ram="/dev/shm/p"), "an external fleet's pool is on one tier; tiers lists 2"),
    (lambda c: c.update(backends=["lmcache-redis"]), "backends: lmcache-redis is a pool of servers"),
    (lambda c: c["load"].update(concurrency=[1, 2]), "load.concurrency: needs kvpool to restore the pool"),
    (lambda c: c["peer"].update(enabled=True), "peer.enabled: needs kvpool"),
    (lambda c: c["study_b"].update(enabled=True), "study_b.enabled: needs kvpool"),
    (lambda c: c["routers"].update(names=["cross"]), "routers.names: needs kvpool"),
])
def test_what_an_external_fleet_cannot_do_is_refused_by_name(config, tmp_path, change, named):
    config = external_config(config)
    change(config)
    assert any(named in problem for problem in problems(config, tmp_path)), problems(config, tmp_path)


def test_endpoints_given_to_a_launched_fleet_are_refused(config, tmp_path):
    config["fleet"]["endpoints"] = {"shared": URLS}
    assert any("fleet.endpoints is set but fleet.mode is launch" in p for p in problems(config, tmp_path))


def test_an_external_plan_names_the_endpoints_and_launches_nothing(config, tmp_path):
    config = external_config(config, pool_dirs={"shared": [str(tmp_path / "pool")] * 2})
    plan = _new_plan(config, CELL, "resources/model", tmp_path)
    assert plan.external and not plan.servers
    assert [(r.url, r.host, r.port) for r in plan.replicas] == [
        (URLS[0], "10.0.0.5", 8000), (URLS[1], "10.0.0.6", 8000)]
    assert all(r.argv is None and r.env == {} for r in plan.replicas)
    assert plan_pool_dirs(plan) == [tmp_path / "pool"] * 2
    assert plan_pool_dirs(_new_plan(external_config(config, pool_dirs={}), CELL, "m", tmp_path)) == []


def test_a_fleet_that_is_down_is_named_after_fleet_wait_s_not_a_replicas_startup(config, tmp_path):
    import time

    from kvpool.engine.errors import FleetError
    from kvpool.engine.fleet import running_fleet
    from kvpool.engine.ports import free_ports

    port = free_ports("127.0.0.1", 1)[0]  # nothing listens there
    config = external_config(config, endpoints={"shared": [f"http://127.0.0.1:{port}", URLS[1]]}, wait_s=2)
    plan = _new_plan(config, CELL, "resources/model", tmp_path)
    assert plan.wait_s == 2
    started = time.monotonic()
    with pytest.raises(FleetError, match=rf"after 2 s \(fleet.wait_s\): external replica 0 \(http://127.0.0.1:{port}\)"):
        with running_fleet(plan, tmp_path, timeout_s=600):
            pass
    assert time.monotonic() - started < 30


def test_the_gate_lists_what_it_could_not_verify_apart(config):
    config["workload"].update(documents=4, doc_tokens=DOC)
    populate, reuse, _ = frames()
    unseen = external.not_verified(external_config(config, reference=False), "shared")
    assert set(unseen) == {"pool_writes", "pool_bytes", "cold_reads", "pool_unchanged", "populate_stored_in_own_pool",
                           "output_matches_recompute"}
    # no pool seen, no reference: what is left must still pass on its own, and nothing unverified is "ok"
    result = evaluate("shared", config, populate, reuse, None, {"memory_backed": False, "resident_fraction": 1.0}, 0,
                      {"ok": True, "hit_tokens": 512, "expect_shared": True}, not_verified=unseen)
    assert result["valid"]
    # each is a not-verified check with its reason: never passed, never failed
    for name, reason in unseen.items():
        assert result["checks"][name] == {"ok": None, "status": "not_verified", "value": None, "threshold": None,
                                          "reason": reason}
    # a miss still fails: not verifying the pool's files does not excuse its hits
    populate, reuse, _ = frames(hits=0)
    assert not evaluate("shared", config, populate, reuse, None, {"memory_backed": False, "resident_fraction": 1.0}, 0,
                        {"ok": True, "hit_tokens": 0, "expect_shared": True}, not_verified=unseen)["valid"]
    launched = {**config, "fleet": {**config["fleet"], "mode": "launch"}}
    assert external.not_verified(launched, "shared") == {}  # a launched fleet verifies everything


def test_a_pool_already_in_use_is_refused_and_left_as_it_was(config, tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    plan = _new_plan(external_config(config, pool_dirs={"shared": [str(pool)] * 2}), CELL, "m", tmp_path)
    _refuse_a_used_external_pool(plan)  # empty: fine
    (pool / "chunk.data").write_bytes(b"kv")
    with pytest.raises(RuntimeError, match="already holds 1 files; kvpool never removes a pool it did not create"):
        _refuse_a_used_external_pool(plan)
    assert (pool / "chunk.data").read_bytes() == b"kv"
    plan = plan.with_replicas([dataclasses.replace(plan.replicas[0], pool_dir=str(tmp_path / "missing")),
                               *plan.replicas[1:]])
    with pytest.raises(RuntimeError, match="is not a directory this machine can see"):
        _refuse_a_used_external_pool(plan)


def test_an_endpoint_describes_its_version_models_and_cache():
    page = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1.0\n')

    async def version(_):
        return web.json_response({"version": "0.32.0"})

    async def models(_):
        return web.json_response(
            {"data": [{"id": "kvpool-model", "root": "/models/m", "max_model_len": 4096, "object": "model"}]})

    async def metrics(_):
        return web.Response(text=page)

    async def serve_and_describe():
        app = web.Application()
        app.add_routes([web.get("/version", version), web.get("/v1/models", models), web.get("/metrics", metrics)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:  # describe blocks (urllib): off the loop that serves it
            return await asyncio.to_thread(external.describe, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        finally:
            await runner.cleanup()

    described = asyncio.run(serve_and_describe())
    assert described["vllm_version"] == "0.32.0"
    assert described["models"] == [{"id": "kvpool-model", "root": "/models/m", "max_model_len": 4096}]
    assert described["cache_config"] == {"block_size": "16", "enable_prefix_caching": "True"}
    assert "not exposed" in described["kv_connector"]
    gone = external.describe("http://127.0.0.1:9")  # nothing listens: recorded as unknown, not raised
    assert gone["vllm_version"] is None and gone["models"] is None


def test_the_kv_bytes_table_says_an_unseen_pool_was_not_hashed(config, tmp_path):
    import pandas as pd

    from kvpool.measure import kvbytes
    from kvpool.studies.study_a import run_kv_bytes

    config = external_config(config, pool_dirs={})
    digests = tmp_path / "pool-digests.csv"
    kvbytes.pool_digests([], None).to_csv(digests, index=False)  # what reuse writes with no pool to see
    run_kv_bytes(config, [CELL], [str(digests)], str(tmp_path / "kv.csv"), str(tmp_path / "kv.md"))
    (row,) = pd.read_csv(tmp_path / "kv.csv").itertuples()
    assert row.keys == 0 and "fleet.pool_dirs.shared is not set" in row.meaning

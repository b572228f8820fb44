"""Issue 49: the pool backends as a registry (kvpool.engine.backends), and vLLM's own tiered offloading (vllm-fs)
as one of them. Each backend is one module; nothing else in the package asks which backend a cell has."""

import asyncio
import contextlib
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from support import REPO, stand_in_server

from kvpool.cells import Backend, Cell
from kvpool.config import problems
from kvpool.engine.backends import REGISTRY, pool_backend
from kvpool.engine.backends.base import BYTE_DIGESTS
from kvpool.engine.plan import fleet_plan
from kvpool.matrix import cells, is_memory_pool
from kvpool.measure.timed import landed_stores, reset_prefix_cache, settled_stores
from kvpool.settings import PHASE_SETTINGS, step_settings
from kvpool.studies import capacity, chain_stores, study_a, studyb
from kvpool.studies.study_a_phases import StoreWatch

SRC = REPO / "src" / "kvpool"


def gpu(config):
    """``config`` on one GPU with vLLM (vllm-fs runs there only)."""
    config["engine"].update(kind="vllm", gpus=[0], replicas_per_gpu=2)
    config["tiers"] = {"ram": "/dev/shm/kvpool", "disk": "pools/disk"}
    return config


def vllm_fs_plan(config, arm, tmp_path):
    return fleet_plan(config, Cell("vllm-fs", arm, 256, "ram"), "/models/m", tmp_path, [18100, 18101], "config")


def test_every_backend_the_schema_names_is_one_module_of_the_registry():
    assert set(REGISTRY) == {member.value for member in Backend}
    assert all(pool_backend(name).name == name for name in REGISTRY)
    assert pool_backend("lmcache-mp+gpu_workers=2") is REGISTRY["lmcache-mp"]  # a folder label finds its backend
    schema = (REPO / "workflow" / "schemas" / "config.schema.yaml").read_text()
    assert f"enum: [{', '.join(sorted(REGISTRY))}]" in schema


def test_no_module_outside_the_registry_branches_on_the_backend():
    """The issue's own measure: `grep -rnE "backend (==|!=|in )" src` finds at most the registry's lookup."""
    branching = re.compile(r"backend (==|!=|in )")
    found = [f"{path.relative_to(SRC)}:{number}" for path in SRC.rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if branching.search(line)]
    assert found == []


def test_each_backend_declares_what_its_arms_mean_how_it_is_emptied_and_how_a_hit_is_proven():
    for backend in REGISTRY.values():
        assert set(backend.arms) == {"shared", "isolated"} and backend.emptied and backend.hit_proof
        assert backend.capacity is not None or backend.capacity_refusal, backend.name


def test_vllm_fs_shared_arm_gives_every_replica_one_fs_root_and_isolated_one_each(config, tmp_path):
    gpu(config)
    roots = {}
    for arm in ("shared", "isolated"):
        plan = vllm_fs_plan(config, arm, tmp_path)
        extras = [r.kv_transfer["kv_connector_extra_config"] for r in plan.replicas]
        assert {r.kv_transfer["kv_connector"] for r in plan.replicas} == {"OffloadingConnector"}
        assert {e["spec_name"] for e in extras} == {"TieringOffloadingSpec"}
        assert {e["block_size"] for e in extras} == {256}  # the cell's chunk
        assert {e["cpu_bytes_to_use"] for e in extras} == {int(config["vllm_fs"]["cpu_gib"] * 2**30)}
        roots[arm] = [e["secondary_tiers"][0]["root_dir"] for e in extras]
        assert [e["secondary_tiers"][0]["root_dir"] for e in extras] == [r.pool_dir for r in plan.replicas]
        for replica in plan.replicas:  # no LMCache, and vLLM's block hashes seeded alike on every replica
            assert replica.lmcache_config is None and "LMCACHE_CONFIG_FILE" not in replica.env
            assert replica.env["PYTHONHASHSEED"] == "0"
            assert "--kv-transfer-config" in replica.argv and not plan.servers
    assert len(set(roots["shared"])) == 1 and len(set(roots["isolated"])) == 2


def test_vllm_fs_seeds_the_hash_whatever_hash_keys_says(config, tmp_path):
    gpu(config)["hash_keys"] = "sha256_cbor"  # LMCache's content hash: no seed for LMCache backends
    assert {r.env["PYTHONHASHSEED"] for r in vllm_fs_plan(config, "shared", tmp_path).replicas} == {"0"}
    lmcache = fleet_plan(config, Cell("lmcache-fs", "shared", 256, "ram"), "/m", tmp_path, [1, 2], "config")
    assert all("PYTHONHASHSEED" not in r.env for r in lmcache.replicas)


def test_vllm_fs_on_cpu_is_refused_before_anything_starts_naming_why(config, tmp_path):
    config["backends"] = ["vllm-fs"]
    found = problems(config, tmp_path, check_paths=False)
    assert any(p.startswith("backends: vllm-fs needs engine.kind vllm") and "CUDA-alike" in p for p in found)
    assert not [p for p in problems(gpu(config), tmp_path, check_paths=False) if "vllm-fs" in p]


def test_vllm_fs_refuses_a_chunk_that_is_not_whole_gpu_blocks_and_takes_repeated_followups(config, tmp_path):
    """Several follow-ups a document: the reset before each later one empties the serving replica's CPU tier
    (reset_external), the one backend whose connector keeps a tier of its own."""
    gpu(config).update(backends=["vllm-fs"], chunk_sizes=[200])
    assert any("chunk_sizes [200]" in p and "multiple of vLLM's KV block size" in p
               for p in problems(config, tmp_path, check_paths=False))
    config.update(chunk_sizes=[256])
    config["workload"]["followups_per_document"] = 2
    assert problems(config, tmp_path, check_paths=False) == []
    assert {name for name, backend in REGISTRY.items() if backend.connector_tier} == {"vllm-fs"}


@pytest.fixture
def reset_endpoint():
    """A stand-in /reset_prefix_cache that answers {"success": false} ``held`` times (blocks still held), then true,
    recording each request's query."""
    asked = []

    def serve(held):
        async def reset(request):
            asked.append(dict(request.query))
            return web.json_response({"success": len(asked) > held})

        @contextlib.asynccontextmanager
        async def running():
            async with stand_in_server({"/reset_prefix_cache": reset}) as url:
                yield SimpleNamespace(index=1, url=url)
        return running()
    return serve, asked


def test_the_reset_empties_the_connectors_tier_when_asked_and_waits_out_held_blocks(reset_endpoint):
    serve, asked = reset_endpoint

    async def reset(**kwargs):
        async with serve(held=2) as replica, aiohttp.ClientSession() as session:
            return await reset_prefix_cache(session, replica, wait_s=0.01, **kwargs)

    assert asyncio.run(reset(connector=True)) == ""
    assert asked == [{"reset_external": "true"}] * 3
    asked.clear()
    failed = asyncio.run(reset(attempts=2))
    assert asked == [{}, {}]
    assert failed == "replica 1: /reset_prefix_cache reported no success 2 times (blocks still held)"


def test_vllm_fs_is_a_pool_of_files_that_shares_and_cannot_be_limited(config, tmp_path):
    gpu(config).update(backends=["vllm-fs"], tiers={"ram": "/dev/shm/kvpool"})
    cell = Cell("vllm-fs", "shared", 256, "ram")
    assert not is_memory_pool(config, cell) and pool_backend("vllm-fs").shares
    assert capacity.cells(config) == []
    config["capacity"]["fractions"] = [0.5]
    refused = capacity.problems(config, check_host=False)
    assert refused and "vllm-fs: vLLM's fs tier evicts nothing" in refused[0]
    assert studyb.resolved({**config, "study_b": {**config["study_b"], "enabled": True}})["backend"] == "vllm-fs"


def test_checks_a_backend_cannot_make_are_named_with_why(config):
    gpu(config)
    fs, memory = Cell("vllm-fs", "shared", 256, "ram"), Cell("lmcache-mp", "shared", 256, "ram")
    assert pool_backend("vllm-fs").not_applicable(config, fs) == {}  # its files are hashed and read back
    config["lmcache_mp"]["memory_tiers"] = ["ram"]
    assert "writes no files" in pool_backend("lmcache-mp").not_applicable(config, memory)[BYTE_DIGESTS]
    assert pool_backend("lmcache-mp").not_applicable(config, Cell("lmcache-mp", "shared", 256, "disk")) == {}
    assert pool_backend("lmcache-fs").not_applicable(config, Cell("lmcache-fs", "shared", 256, "ram")) == {}


def test_the_matrix_forms_cells_where_each_backend_says(config):
    gpu(config).update(backends=["lmcache-redis", "vllm-fs", "lmcache-mp"], tiers={"ram": "/r", "disk": "/d"},
                       arms=["shared"])
    config["lmcache_mp"].update(memory_tiers=["ram"], gpu_workers=[None, 2], servers=["one", "per-replica"])
    names = [cell.name for cell in cells(config)]
    assert [n for n in names if "redis" in n] == ["backend~lmcache-redis/arm~shared/chunk~256/tier~ram"]
    assert [n for n in names if "vllm-fs" in n] == ["backend~vllm-fs/arm~shared/chunk~256/tier~ram",
                                                     "backend~vllm-fs/arm~shared/chunk~256/tier~disk"]
    mp_disk = [n.split("/")[0] for n in names if "lmcache-mp" in n and n.endswith("disk")]
    assert mp_disk == ["backend~lmcache-mp", "backend~lmcache-mp+servers=per-replica",
                       "backend~lmcache-mp+gpu_workers=2", "backend~lmcache-mp+gpu_workers=2+servers=per-replica"]


def _land(folder: Path, names: list[str], delay_s: float):
    """Write each file as a backend that stores after its answer does: a temp file first, renamed once whole."""
    for name in names:
        time.sleep(delay_s)
        (folder / f"{name}_x.tmp").write_bytes(b"k" * 64)
        (folder / f"{name}_x.tmp").rename(folder / f"{name}.bin")


def test_the_preflight_waits_for_the_probes_chunks_and_records_how_many_were_there_at_the_answer(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # what the pool held before the probe is not counted
    watch = StoreWatch([tmp_path, tmp_path], chunks=3, timeout_s=10)
    writer = threading.Thread(target=_land, args=(tmp_path, ["a", "b", "c"], 0.2))
    writer.start()
    record = watch()
    writer.join()
    assert record["chunks"] == 3 and record["landed"] == 3 and record["at_answer"] < 3
    assert 0.3 < record["waited_s"] < 10
    (tmp_path / "x_y.tmp").write_bytes(b"")  # a store still being written is not a chunk
    assert StoreWatch([tmp_path], chunks=0, timeout_s=0.2, suffix=".bin").settled_chunks() == 3


def test_the_preflight_records_a_store_that_never_lands_instead_of_waiting_forever(tmp_path):
    record = StoreWatch([tmp_path], chunks=2, timeout_s=0.3)()
    assert record == {**record, "at_answer": 0, "landed": 0} and record["waited_s"] >= 0.3


def test_populate_waits_until_every_documents_chunks_are_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the fs tier's own file beside its blocks: not a chunk
    writer = threading.Thread(target=_land, args=(tmp_path, [f"c{i}" for i in range(4)], 0.7))
    writer.start()
    settled = settled_stores([tmp_path], None, poll_s=0.1, timeout_s=20, min_files=4, chunk_suffix=".bin")
    writer.join()
    assert settled["settled"] and settled["files"] == 5 and settled["waited_s"] > 2
    assert not settled_stores([tmp_path], None, poll_s=0.05, timeout_s=0.3, min_files=5, chunk_suffix=".bin")["settled"]


def test_a_chain_or_router_waits_for_vllm_fs_stores_and_for_no_other_backend(config, tmp_path):
    gpu(config)["workload"].update(documents=2, doc_tokens=512)  # two documents of two whole chunks each
    config["vllm_fs"]["store_timeout_s"] = 20
    config["tiers"]["ram"] = str(tmp_path / "ram")
    plan = fleet_plan(config, Cell("vllm-fs", "shared", 256, "ram"), "/m", tmp_path, [1, 2], "config")
    folder = Path(plan.replicas[0].pool_dir)
    folder.mkdir(parents=True)
    writer = threading.Thread(target=_land, args=(folder, ["a", "b", "c", "d"], 0.4))
    writer.start()
    landed = landed_stores(plan, config, whole_workload=True)
    writer.join()
    assert landed["settled"] and landed["files"] == 4 and landed["min_files"] == 4
    assert landed_stores(plan, config)["min_files"] == 0  # one request's stores: stable, no temp file
    lmcache = fleet_plan(config, Cell("lmcache-fs", "shared", 256, "ram"), "/m", tmp_path, [1, 2], "config")
    assert landed_stores(lmcache, config) is None


def test_study_bs_requests_wait_for_a_file_of_every_whole_chunk_sent_then_for_stillness_once_one_wait_timed_out(
        config, tmp_path):
    """Study B and the length units on vllm-fs: before a request, a file for every whole chunk of the prompts
    sent so far (here two prompts sharing their first chunk: three chunks), so a cross-replica step finds the
    cold step's stores; a wait that times out leaves the later ones to stillness, so it costs its timeout once."""
    gpu(config)
    config["vllm_fs"]["store_timeout_s"] = 20
    config["tiers"]["ram"] = str(tmp_path / "ram")
    plan = fleet_plan(config, Cell("vllm-fs", "shared", 256, "ram"), "/m", tmp_path, [1, 2], "config")
    folder = Path(plan.replicas[0].pool_dir)
    folder.mkdir(parents=True)
    prompts = {"one": list(range(600)), "two": list(range(256)) + list(range(1000, 1300))}
    wait = chain_stores.stores_landed(plan, config, prompts, 256)
    writer = threading.Thread(target=_land, args=(folder, ["a", "b", "c"], 0.4))
    writer.start()
    waited = asyncio.run(wait())
    writer.join()
    assert waited > 1.0 and len(list(folder.glob("*.bin"))) == 3
    config["vllm_fs"]["store_timeout_s"] = 0.3
    prompts["three"] = list(range(2000, 2256))  # a fourth chunk that never lands
    assert asyncio.run(wait()) >= 0.3
    assert asyncio.run(wait()) < 0.3 + 1.0  # stillness alone: two reads apart that agree
    lmcache = fleet_plan(config, Cell("lmcache-fs", "shared", 256, "ram"), "/m", tmp_path, [1, 2], "config")
    assert chain_stores.stores_landed(lmcache, config, prompts, 256) is None  # no wait at all


def test_a_cancelled_wait_for_stores_ends_its_thread_at_once_rather_than_at_its_timeout(config, tmp_path):
    """Ctrl-C during a wait for stores that never land: the run cancels the wait, and its thread stops at the next
    read instead of holding the process for vllm_fs.store_timeout_s (asyncio.run waits for the thread)."""
    gpu(config)
    config["vllm_fs"]["store_timeout_s"] = 30
    config["tiers"]["ram"] = str(tmp_path / "ram")
    plan = fleet_plan(config, Cell("vllm-fs", "shared", 256, "ram"), "/m", tmp_path, [1, 2], "config")
    Path(plan.replicas[0].pool_dir).mkdir(parents=True)
    wait = chain_stores.stores_landed(plan, config, {"one": list(range(512))}, 256)  # two chunks, never stored

    async def cancelled():
        task = asyncio.create_task(wait())
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(cancelled())  # returns once the executor's thread has ended
    assert time.monotonic() - started < 3


def test_a_cells_steps_read_its_own_backends_section_and_cells_measured_before_keep_their_settings(config):
    """Adding vllm-fs's section to every timed phase would change the settings of every cell measured before it,
    and Snakemake would re-run them all: the section goes to vllm-fs's own cells alone."""
    gpu(config)
    cell = {"arm": "shared", "chunk": "256", "tier": "ram"}
    fs = step_settings(study_a.run_cell, config, SimpleNamespace(backend="vllm-fs", **cell))
    lmcache = step_settings(study_a.run_cell, config, SimpleNamespace(backend="lmcache-fs", **cell))
    assert fs["vllm_fs"] == config["vllm_fs"] and "vllm_fs" not in lmcache
    assert "vllm_fs" not in PHASE_SETTINGS and {"lmcache_mp", "lmcache_redis"} <= set(PHASE_SETTINGS)
    assert {key: value for key, value in fs.items() if key != "vllm_fs"} == lmcache

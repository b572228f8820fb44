"""The launch plan as types: a ``Plan`` of ``ReplicaPlan`` and ``ServerPlan`` entries, the record every
unit kind writes to its ``plan.yaml`` before anything starts and reads back in the jobs after it.

A plan on disk carries its ``schema`` version. Each version has one reader here (``READERS``): the
studies and the engine only ever see the current types. Version 1 is every ``plan.yaml`` written before
the key existed (committed runs among them): the same fields, with the optional ones absent where they
did not apply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PLAN_SCHEMA = 2


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica: where it listens, the core or GPU it runs on, its pool directory (None: no pool, or
    none this machine sees), its LMCache settings (and the file they are written to before it starts) or
    the pool server it registers with, its KV connector, its environment and its command line. An
    external replica has a ``url`` and nothing to launch (``argv`` None)."""

    index: int
    host: str
    port: int
    core: int | None
    gpu: int | None
    sequential_start: bool
    pool_dir: str | None
    lmcache_config_file: str | None
    lmcache_config: dict | None
    env: dict[str, str]
    argv: list[str] | None
    kv_transfer: dict | None = None
    server: int | None = None
    url: str | None = None


@dataclass(frozen=True)
class ServerPlan:
    """One pool server: LMCache's MP server (``kind`` "lmcache": a ZMQ ``port``, an ``http_port``, its L1
    size and its L2 folder on a drive tier) or a Redis server (``kind`` "redis": one port, a working
    directory)."""

    index: int
    kind: str
    host: str
    port: int
    http_port: int | None
    env: dict[str, str]
    argv: list[str]
    workdir: str | None = None
    l1_size_gib: float | None = None
    l2_dir: str | None = None


@dataclass(frozen=True)
class Plan:
    """A unit's fleet: its cell, engine kind, model, where its ports came from (``auto``, configured,
    ``external``), its replicas and pool servers; ``memory_pool`` when the servers hold the pool in
    memory, ``external`` (with ``wait_s``) when someone else runs the fleet."""

    cell: str
    engine_kind: str
    model: str
    port_source: str
    replicas: tuple[ReplicaPlan, ...]
    servers: tuple[ServerPlan, ...] = ()
    memory_pool: bool = False
    external: bool = False
    wait_s: float | None = None
    schema: int = field(default=PLAN_SCHEMA)

    def to_dict(self) -> dict:
        """The plan as ``plan.yaml`` holds it: plain lists and mappings."""
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        plain["replicas"] = [dataclasses.asdict(replica) for replica in self.replicas]
        plain["servers"] = [dataclasses.asdict(server) for server in self.servers]
        return plain

    def with_replicas(self, replicas) -> Plan:
        return dataclasses.replace(self, replicas=tuple(replicas))


def _entries(kind: type, rows: list[dict]) -> tuple:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted({key for row in rows for key in row} - names)
    if unknown:
        raise ValueError(f"a plan's {kind.__name__} entry has fields this kvpool does not know: {unknown}")
    return tuple(kind(**row) for row in rows)


def _read_v2(data: dict) -> Plan:
    fields = {f.name for f in dataclasses.fields(Plan)}
    if unknown := sorted(set(data) - fields):
        raise ValueError(f"a plan has fields this kvpool does not know: {unknown}")
    return Plan(**{**data, "replicas": _entries(ReplicaPlan, data["replicas"]),
                   "servers": _entries(ServerPlan, data.get("servers") or [])})


def _read_v1(data: dict) -> Plan:
    """A plan written before ``schema``: the same fields, the optional ones absent where they did not
    apply (a reference replica had no ``kv_transfer``), and pool servers without a ``kind`` written
    before Redis servers existed: LMCache MP servers."""
    servers = [{"kind": "lmcache", **server} for server in data.get("servers") or []]
    return _read_v2({**data, "schema": PLAN_SCHEMA, "servers": servers,
                     "memory_pool": bool(data.get("memory_pool")), "external": bool(data.get("external"))})


READERS = {1: _read_v1, 2: _read_v2}


def plan_from_dict(data: dict) -> Plan:
    """A plan read back from its mapping, through the reader of the schema version it was written with."""
    version = data.get("schema", 1)
    if version not in READERS:
        raise ValueError(f"a plan of schema {version!r}: this kvpool reads schema {sorted(READERS)}; "
                         "a newer kvpool wrote it")
    return READERS[version](data)


def read_plan(path: str | Path) -> Plan:
    return plan_from_dict(yaml.safe_load(Path(path).read_text()))


def write_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(plan.to_dict(), sort_keys=False, width=200))

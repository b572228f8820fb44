"""Study A's router, ``cross`` in the routers study (kvpool.studies.routers): plain round robin for a
document's prefill and the next replica for its follow-ups, deliberately not prefix aware, so every
follow-up lands on a replica that did not prefill its document."""

from __future__ import annotations

from collections.abc import Sequence


def round_robin(turn: int, live: Sequence[int]) -> int:
    """The replica whose turn ``turn`` is, cycling over ``live`` in order."""
    return live[turn % len(live)]


def next_replica(replica: int, live: Sequence[int]) -> int:
    """The first live replica after ``replica`` in index order, wrapping around: never ``replica`` itself
    while another one is live."""
    later = [r for r in live if r > replica] + [r for r in live if r < replica]
    return later[0] if later else replica


def populate_route(doc_ids: list[int], replicas: int) -> dict[int, int]:
    """Document -> replica that prefills it: round robin in document order."""
    return {doc_id: round_robin(i, range(replicas)) for i, doc_id in enumerate(doc_ids)}


def followup_route(prefill: dict[int, int], replicas: int) -> dict[int, int]:
    """Follow-up -> serving replica: the replica after the one that prefilled the document."""
    if replicas < 2:
        raise ValueError("cross-replica follow-ups need at least 2 replicas")
    return {doc_id: next_replica(replica, range(replicas)) for doc_id, replica in prefill.items()}

"""The router: plain round robin, deliberately not prefix aware."""

from __future__ import annotations


def populate_route(doc_ids: list[int], replicas: int) -> dict[int, int]:
    """Document -> replica that prefills it: round robin in document order."""
    return {doc_id: i % replicas for i, doc_id in enumerate(doc_ids)}


def followup_route(prefill: dict[int, int], replicas: int) -> dict[int, int]:
    """Follow-up -> serving replica: the same rotation shifted by one, so never the prefilling replica."""
    if replicas < 2:
        raise ValueError("cross-replica follow-ups need at least 2 replicas")
    return {doc_id: (replica + 1) % replicas for doc_id, replica in prefill.items()}

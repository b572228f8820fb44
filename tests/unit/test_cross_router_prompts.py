import pytest

from kvpool.engine.cross_router import followup_route, populate_route
from kvpool.engine.prompts import make_workload, probe_prompts


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_every_followup_lands_on_another_replica(replicas):
    prefill = populate_route(list(range(60)), replicas)
    serve = followup_route(prefill, replicas)
    assert all(serve[d] != prefill[d] for d in prefill)
    # plain round robin: every replica gets the same share in both phases
    assert sorted(list(prefill.values()).count(r) for r in range(replicas)) == [60 // replicas] * replicas
    assert sorted(list(serve.values()).count(r) for r in range(replicas)) == [60 // replicas] * replicas


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_routers_studys_cross_router_routes_as_study_a(replicas):
    """The routers study's ``cross`` is Study A's router: the same prefill and follow-up replicas."""
    from kvpool.studies.routers import Router

    doc_ids = list(range(12))
    prefill = populate_route(doc_ids, replicas)
    router = Router("cross", list(range(replicas)), seed=0)
    assert {d: router.first(d, [d]) for d in doc_ids} == prefill
    assert {d: router.followup(d, [d]) for d in doc_ids} == followup_route(prefill, replicas)


def test_one_replica_cannot_route_cross_replica():
    with pytest.raises(ValueError, match="at least 2 replicas"):
        followup_route({0: 0}, 1)


def test_documents_have_exact_lengths_and_followups_extend_them():
    vocab = list(range(3, 4003))
    work = make_workload(vocab, documents=5, doc_tokens=777, followup_tokens=33, seed=7)
    assert [w["doc_id"] for w in work] == list(range(5))
    for item in work:
        assert len(item["document"]) == 777
        assert len(item["followup"]) == 810
        assert item["followup"][:777] == item["document"]
        assert set(item["followup"]) <= set(vocab)
    assert len({w["document"][0] for w in work}) == 5  # no two documents share a prefix


def test_workload_is_seeded():
    vocab = list(range(100, 200))
    first = make_workload(vocab, 3, 50, 5, seed=1)
    assert first == make_workload(vocab, 3, 50, 5, seed=1)
    assert first != make_workload(vocab, 3, 50, 5, seed=2)


def test_too_many_documents_for_the_vocabulary():
    with pytest.raises(ValueError, match="distinct first tokens"):
        make_workload([1, 2], documents=3, doc_tokens=10, followup_tokens=1, seed=0)


def test_probe_spans_two_chunks_and_is_extended():
    probe, followup = probe_prompts(list(range(10, 500)), chunk=256, seed=0)
    assert len(probe) == 513 and followup[:513] == probe and len(followup) > len(probe)


def test_random_model_is_built_deterministically(tmp_path):
    import hashlib

    from kvpool.engine.model import build_random_model

    spec = dict(vocab_words=50, hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1, head_dim=16,
                max_positions=256, seed=3, init_std=0.05)
    digests = []
    for run in ("a", "b"):
        summary = build_random_model(tmp_path / run, spec)
        digests.append(hashlib.sha256((tmp_path / run / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert summary["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 2
    build_random_model(tmp_path / "c", {**spec, "seed": 4})
    assert hashlib.sha256((tmp_path / "c" / "model.safetensors").read_bytes()).hexdigest() != digests[0]

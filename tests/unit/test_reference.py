"""The split-matched reference without a server: which splits Study A predicts, how a measured request is
matched, what a unit computes after its fleet stops, and the requests as a stand-in server sees them."""

import asyncio
import json
import re
import warnings

import pandas as pd
import pytest
from aiohttp import web
from support import completions_server

from kvpool.measure import reference
from kvpool.measure.reference import COLD, REPEAT, Request


def workload(doc_tokens=1000, followups=1):
    items = []
    for doc in range(2):
        document = list(range(doc * 10_000, doc * 10_000 + doc_tokens))
        extra = [document + [7] * 16 + [number] * 4 for number in range(1, followups)]
        item = {"doc_id": doc, "document": document, "followup": document + [5] * 20}
        if followups > 1:
            item["followups"] = [item["followup"], *extra]
        items.append(item)
    return items


def test_study_a_predicts_cold_repeat_document_and_each_chunk_sizes_whole_chunks():
    requests = reference.predicted_requests(workload(), [256, 1024, 2048])
    first = [(r.path, r.split) for r in requests if r.key == "doc0/followup0"]
    # 1000 tokens: 768 in whole chunks of 256; none whole of 1024 or 2048 (no hit: the cold split covers it)
    assert first == [(COLD, 0), (REPEAT, 1019), ("after_document", 1000), ("pool_chunks", 768)]
    aligned = reference.predicted_requests(workload(doc_tokens=1024), [256, 1024])
    # whole chunks of both sizes are the document itself: computed once, as the after-document split
    assert [r.path for r in aligned if r.key == "doc0/followup0"] == [COLD, REPEAT, "after_document"]


def test_every_followup_of_a_document_gets_its_own_key():
    keys = {r.key for r in reference.predicted_requests(workload(followups=3), [256])}
    assert keys == {f"doc{d}/followup{f}" for d in range(2) for f in range(3)}


def test_salts_are_what_vllm_accepts_and_a_repeat_shares_the_cold_salt():
    prompt = tuple(range(10))
    cold, repeat, split = (Request("doc0/followup0", prompt, s, p) for s, p in ((0, COLD), (9, REPEAT), (5, "split")))
    for salt in (cold.salt, split.salt):
        assert len(salt) <= 128 and not re.search(r"[/@]", salt)
    assert repeat.salt == cold.salt != split.salt


def measured(splits, outputs, key="doc0/followup0"):
    return pd.DataFrame({"key": [key] * len(splits), "cached_tokens": splits, "output_text": outputs,
                         "error": [""] * len(splits)})


ROWS = pd.DataFrame([
    {"key": "doc0/followup0", "path": COLD, "requested_split": 0, "achieved_split": 0, "output_text": "cold",
     "error": ""},
    {"key": "doc0/followup0", "path": "pool_chunks", "requested_split": 768, "achieved_split": 768,
     "output_text": "pool", "error": ""},
    {"key": "doc0/followup0", "path": REPEAT, "requested_split": 1019, "achieved_split": 1008, "output_text": "whole",
     "error": ""},
])


def test_a_request_is_matched_exactly_at_the_nearest_block_or_not_at_all():
    table = reference.comparisons(measured([0, 768, 1008, 1019, 500], ["cold", "pool", "whole", "whole", "x"]), ROWS)
    assert table["match"].tolist() == ["exact", "exact", "exact", "nearest", "unmatched"]
    assert table["equal"].tolist() == [True, True, True, True, False]
    check = reference.output_check(measured([0, 768, 1019, 500], ["cold", "pool", "whole", "x"]), ROWS)
    assert check["status"] == "passed" and check["value"]["compared"] == 3 and check["value"]["unmatched"] == 1
    assert check["splits_without_reference"] == [500]
    assert reference.missing(measured([768, 500, 500, 640], ["pool", "x", "x", "y"]), ROWS) == [
        ("doc0/followup0", 500), ("doc0/followup0", 640)]


def test_damaged_kv_in_a_matched_split_fails_and_names_the_answers():
    check = reference.output_check(measured([768], ["damaged"]), ROWS)
    assert check["status"] == "failed" and check["ok"] is False
    assert "measured split 768, reference split 768 (exact): 'damaged' against 'pool'" in check["examples"][0]


def test_a_reference_that_disagrees_with_itself_is_not_a_verdict():
    twice = pd.concat([ROWS, ROWS.iloc[[1]].assign(output_text="other")], ignore_index=True)
    check = reference.output_check(measured([768], ["pool"]), twice)
    assert check["status"] == "not_verified" and check["value"]["reference_inconsistent"] == 1


def test_failed_requests_are_left_to_the_error_count():
    rows = measured([768, 768], ["pool", ""]).assign(error=["", "HTTP 500"])
    assert reference.output_check(rows, ROWS)["value"]["compared"] == 1


def test_requests_for_a_unit_reuse_the_cold_blocks_for_the_whole_prompt():
    prompts = {"k": list(range(100)), "other": list(range(50))}
    requests = reference.requests_for([("k", 99), ("k", 0), ("k", 64), ("other", 32), ("gone", 3)], prompts)
    assert [(r.key, r.split, r.path) for r in requests] == [("k", 0, COLD), ("k", 64, "split"), ("k", 99, REPEAT),
                                                            ("other", 32, "split")]


def test_an_off_blocks_answers_are_reference_rows_in_their_own_splits():
    off = pd.DataFrame({"key": ["a", "b"], "cached_tokens": [0, 256], "prompt_tokens": [272, 272],
                        "output_text": ["x", "y"], "error": [None, None]})
    rows = reference.twin_rows(off, "off_block")
    assert rows["achieved_split"].tolist() == [0, 256] and rows["path"].eq("off_block").all()
    assert reference.output_check(measured([256], ["y"], key="b"), rows)["status"] == "passed"


def test_compute_sends_the_prefix_then_the_prompt_under_one_salt():
    """Against a stand-in completions server: the prefix of each split first (one token), then the whole
    prompt under the same salt; the achieved split is the server's cached-token count."""
    seen = []

    async def handler(request):
        body = await request.json()
        # a prefix cache keyed by salt: what an earlier request of the same salt left
        cached = max([length for length, salt, _ in seen if salt == body.get("cache_salt")], default=0)
        seen.append((len(body["prompt"]), body.get("cache_salt"), body["max_tokens"]))
        chunk = {"choices": [{"text": " w1", "index": 0}]}
        usage = {"usage": {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": cached}}}
        response = web.StreamResponse()
        await response.prepare(request)
        for event in (chunk, usage):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def run():
        async with completions_server(handler) as url:
            from kvpool.engine.client import new_session

            async with new_session() as session:
                requests = [Request("k", tuple(range(10)), 0, COLD), Request("k", tuple(range(10)), 8, "split")]
                return await reference.compute(session, url, requests, 2, 10)

    rows = asyncio.run(run())
    assert [(length, max_tokens) for length, _, max_tokens in seen] == [(10, 2), (8, 1), (10, 2)]
    assert seen[1][1] == seen[2][1] != seen[0][1]     # the split's prefix and prompt share a salt of their own
    assert [(r["requested_split"], r["achieved_split"]) for r in rows] == [(0, 0), (8, 8)]


@pytest.mark.parametrize("path", ["cold", "after_document"])
def test_agreement_with_the_information_paths_is_counted(path):
    rows = ROWS.assign(path=[COLD, "after_document", REPEAT])
    found = reference.agreement(measured([768], ["cold" if path == "cold" else "pool"]), rows)
    assert found[path] == {"equal": 1, "of": 1}


def test_with_no_reference_at_all_the_answers_are_not_verified_and_say_why():
    check = reference.output_check(measured([768], ["pool"]), None)
    assert check["status"] == "not_verified" and check["ok"] is None
    assert "no recompute reference" in check["reason"] and "results/reference/outputs.csv" in check["reason"]


def test_a_reference_read_back_from_csv_without_errors_or_answers_compares_as_written(tmp_path):
    """A reference.csv whose error column is all empty reads back as float (pandas): it compares like the frame
    that was written, with no warning that a later pandas turns into an error."""
    ROWS.to_csv(tmp_path / "reference.csv", index=False)
    read_back = pd.read_csv(tmp_path / "reference.csv")
    assert read_back["error"].dtype == float
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check = reference.output_check(measured([768, 0], ["pool", "cold"]), read_back)
    assert check["status"] == "passed" and check["value"]["compared"] == 2
    assert reference.normalized(read_back)["error"].tolist() == ["", "", ""]

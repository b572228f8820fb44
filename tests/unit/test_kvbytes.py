"""Byte-level KV checks on real pool files: which comparison a damaged chunk shows up in."""

import re

import pandas as pd
import pytest

from kvpool.measure import kvbytes

KEYS = {"doc0": "model@1@0@aa@bfloat16", "doc1": "model@1@0@bb@bfloat16",
        "followup0": "model@1@0@cc@bfloat16", "followup1": "model@1@0@dd@bfloat16"}


def write(directory, name, content):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / KEYS[name]).write_bytes(content)


def kv(name):
    return name.encode() * 1000


def run_cell(tmp_path, arm, damaged=(), store_damaged=()):
    """Lay out a cell's pool the way the pipeline fills it; ``damaged`` names chunks computed or
    stored wrong, ``store_damaged`` document chunks whose populate store alone copied wrong bytes."""
    content = {name: kv(name) + (b"!" if name in damaged else b"") for name in KEYS}
    stored = {name: content[name] + (b"?" if name in store_damaged else b"") for name in KEYS}
    dirs = ([tmp_path / arm / "shared"] * 2 if arm == "shared"
            else [tmp_path / arm / "replica-0", tmp_path / arm / "replica-1"])
    write(dirs[0], "doc0", stored["doc0"])  # populate: replica 0 prefills doc 0, replica 1 doc 1
    write(dirs[1], "doc1", stored["doc1"])
    populate = kvbytes.pool_digests(dirs)
    # reuse: replica 1 serves doc 0, replica 0 serves doc 1
    if arm == "isolated":  # no hit: the serving replica recomputes the document and stores it
        write(dirs[1], "doc0", content["doc0"])
        write(dirs[0], "doc1", content["doc1"])
    write(dirs[1], "followup0", content["followup0"])
    write(dirs[0], "followup1", content["followup1"])
    return kvbytes.pool_digests(dirs, populate)


def comparisons(tmp_path, shared_damage=(), isolated_damage=(), store_damage=()):
    shared = run_cell(tmp_path, "shared", shared_damage, store_damage)
    isolated = run_cell(tmp_path, "isolated", isolated_damage, store_damage)
    return kvbytes.compare_arms(shared, isolated, followup_exact=True).set_index("comparison")


def cpu_config(doc_tokens=2048, kind="vllm-cpu", extra_args=("--max-num-seqs", "4")):
    return {"workload": {"doc_tokens": doc_tokens}, "engine": {"kind": kind, "extra_args": list(extra_args)}}


def test_digests_record_every_copy_and_when_it_was_stored(tmp_path):
    shared = run_cell(tmp_path, "shared")
    assert sorted(shared["key"]) == sorted(KEYS.values())
    assert shared.set_index("key")["stored_in"].to_dict() == {
        KEYS["doc0"]: "populate", KEYS["doc1"]: "populate", KEYS["followup0"]: "reuse", KEYS["followup1"]: "reuse"}
    isolated = run_cell(tmp_path, "isolated")
    assert len(isolated) == 6 and set(isolated["copy"]) == {"replica-0", "replica-1"}
    assert dict(zip(shared["key"], shared["bytes"], strict=True)) == {KEYS[name]: len(kv(name)) for name in KEYS}


def test_identical_kv_agrees_everywhere(tmp_path):
    table = comparisons(tmp_path)
    assert table[["keys", "equal", "differ"]].to_dict("index") == {
        "store_across_arms": {"keys": 2, "equal": 2, "differ": 0},
        "recompute_against_store": {"keys": 2, "equal": 2, "differ": 0},
        "after_load_against_cold": {"keys": 2, "equal": 2, "differ": 0},
    }


def test_kv_damaged_by_the_load_shows_only_in_the_followup_chunks(tmp_path):
    # the document chunks were stored right, but what the serving replica computed on the loaded KV is off
    table = comparisons(tmp_path, shared_damage=("followup0", "followup1"))
    assert table.loc["store_across_arms", "differ"] == 0
    assert table.loc["after_load_against_cold", "differ"] == 2
    assert table.loc["after_load_against_cold", "example_key"] in (KEYS["followup0"], KEYS["followup1"])
    assert list(kvbytes.unexpected(table.reset_index())["comparison"]) == ["after_load_against_cold"]


def test_followup_chunks_of_unaligned_documents_may_differ_without_alarm(tmp_path):
    # a document that ends inside a chunk: the follow-up chunk holds its tail, computed after the load
    shared = run_cell(tmp_path, "shared", ("followup0",))
    table = kvbytes.kv_bytes_table({("lmcache-fs", 256, "disk", "shared"): shared,
                                    ("lmcache-fs", 256, "disk", "isolated"): run_cell(tmp_path, "isolated")},
                                   cpu_config(6000))
    row = table.set_index("comparison").loc["after_load_against_cold"]
    assert row["differ"] == 1 and not row["bit_exact_expected"]
    assert kvbytes.unexpected(table).empty
    # the document chunks still must agree
    assert table.set_index("comparison").loc["store_across_arms", "bit_exact_expected"]


def test_a_store_that_differs_between_runs_shows_in_the_store_comparison(tmp_path):
    table = comparisons(tmp_path, shared_damage=("doc1",))
    assert table.loc["store_across_arms", ["differ", "example_key"]].tolist() == [1, KEYS["doc1"]]
    assert table.loc["after_load_against_cold", "differ"] == 0


def test_table_compares_only_settings_with_both_arms(tmp_path):
    shared = run_cell(tmp_path, "shared")
    isolated = run_cell(tmp_path, "isolated")
    table = kvbytes.kv_bytes_table({("lmcache-fs", 256, "disk", "shared"): shared,
                                    ("lmcache-fs", 256, "disk", "isolated"): isolated,
                                    ("lmcache-fs", 256, "ram", "shared"): shared}, cpu_config())
    assert set(table["tier"]) == {"disk"} and len(table) == 3
    markdown = kvbytes.kv_bytes_markdown(table)
    assert "tier disk" in markdown and "| after_load_against_cold | 2 | 2 | 0 | True |" in re.sub(" +", " ", markdown)
    assert "nothing to compare" in kvbytes.kv_bytes_markdown(kvbytes.kv_bytes_table(
        {("lmcache-fs", 256, "ram", "shared"): shared}, cpu_config()))


@pytest.mark.parametrize("arm", ["shared", "isolated"])
def test_digests_survive_a_csv_round_trip(tmp_path, arm):
    digests = run_cell(tmp_path, arm)
    digests.to_csv(tmp_path / "d.csv", index=False)
    back = kvbytes.read_digests(tmp_path / "d.csv")
    pd.testing.assert_frame_equal(back, digests)


def test_finding_places_a_store_that_copies_the_wrong_bytes_on_the_store_side(tmp_path):
    # what the H200 showed: stores reproduce across arms, never equal a recompute; the shared
    # arm's follow-ups, computed on those bytes, differ too
    table = comparisons(tmp_path, shared_damage=("followup0", "followup1"), store_damage=("doc0", "doc1"))
    assert table.loc["store_across_arms", "differ"] == 0
    assert table.loc["recompute_against_store", "differ"] == 2
    finding = kvbytes.finding(table.reset_index())
    assert finding.startswith("Load side: the document chunks agree, yet 2 of 2")
    assert "Not required to agree, and differing: recompute_against_store 2 of 2." in finding
    assert finding.endswith("what a store that copies wrong bytes looks like.")
    assert list(kvbytes.unexpected(table.reset_index())["comparison"]) == ["after_load_against_cold"]


def test_finding_places_damage_after_a_faithful_store_on_the_load_side(tmp_path):
    table = comparisons(tmp_path, shared_damage=("followup0", "followup1"))
    assert kvbytes.finding(table.reset_index()).startswith("Load side: the document chunks agree, yet 2 of 2")


def test_finding_names_stores_that_do_not_reproduce(tmp_path):
    table = comparisons(tmp_path, shared_damage=("doc1",))
    assert kvbytes.finding(table.reset_index()).startswith("The stores differ: 1 of 2 document chunks")


def test_finding_of_agreeing_bytes_and_of_nothing_to_compare(tmp_path):
    finding = kvbytes.finding(comparisons(tmp_path).reset_index())
    assert finding.startswith("Every chunk that must agree bit for bit does") and "store_across_arms 2 of 2" in finding
    table = comparisons(tmp_path).reset_index().assign(bit_exact_expected=False)
    assert kvbytes.finding(table).startswith("Nothing to compare bit for bit")
    markdown = kvbytes.kv_bytes_markdown(kvbytes.kv_bytes_table(
        {("lmcache-fs", 256, "disk", "shared"): run_cell(tmp_path / "a", "shared", ("followup0",)),
         ("lmcache-fs", 256, "disk", "isolated"): run_cell(tmp_path / "a", "isolated")}, cpu_config()))
    assert "**Finding:** Load side: the document chunks agree, yet 1 of 2" in markdown


def test_a_recompute_that_rounds_differently_is_reported_never_gated(tmp_path):
    """The isolated replica computes the document inside a longer prefill: a clean CPU run with
    1,024-token documents had 3 of 12 such chunks differ. Reported, not an alarm."""
    table = comparisons(tmp_path, store_damage=("doc0",)).reset_index()  # the recompute alone differs
    row = table.set_index("comparison").loc["recompute_against_store"]
    assert row["differ"] == 1 and not row["bit_exact_expected"]
    assert kvbytes.unexpected(table).empty
    assert kvbytes.finding(table).startswith("Every chunk that must agree bit for bit does")


def test_a_chunk_two_replicas_computed_is_left_out_of_the_store_comparison(tmp_path):
    """The preflight's probe: replica 0 stores it, the isolated arm's replica 1 computes it again in a
    longer prompt; only chunks each arm stored once are the same computation in both arms."""
    shared, isolated = run_cell(tmp_path, "shared"), run_cell(tmp_path, "isolated")
    probe = {"copy": None, "key": "model@1@0@ee@bfloat16", "bytes": 5, "stored_in": "populate"}
    shared = pd.concat([shared, pd.DataFrame([{**probe, "copy": "shared", "blake2b": "p0"}])])
    isolated = pd.concat([isolated, pd.DataFrame([{**probe, "copy": "replica-0", "blake2b": "p0"},
                                                  {**probe, "copy": "replica-1", "blake2b": "p1"}])])
    table = kvbytes.compare_arms(shared, isolated, followup_exact=True).set_index("comparison")
    assert table.loc["store_across_arms", ["keys", "differ"]].tolist() == [2, 0]


def test_followup_chunks_are_gated_only_where_the_stack_computes_them_identically():
    assert kvbytes.followup_bit_exact(cpu_config(2048), 256)
    assert not kvbytes.followup_bit_exact(cpu_config(6000), 256)  # the chunk holds the document's tail
    assert not kvbytes.followup_bit_exact(cpu_config(2048, kind="vllm"), 256)
    # whole chunks, but the cold prefill's step (vLLM's 2,048 tokens on CPU) does not end at the document
    assert not kvbytes.followup_bit_exact(cpu_config(1024), 256)
    assert kvbytes.followup_bit_exact(cpu_config(1024, extra_args=("--max-num-batched-tokens", "1024")), 256)
    assert kvbytes.followup_bit_exact(cpu_config(1024, extra_args=("--max-num-batched-tokens=512",)), 256)
    assert not kvbytes.followup_bit_exact(cpu_config(2048, extra_args=("--no-enable-chunked-prefill",)), 256)


def test_whole_chunk_documents_the_cold_prefill_does_not_split_at_are_no_damage_and_real_damage_still_is(tmp_path):
    """Issue 51's clean run: 1,024-token documents (4 chunks of 256), 256-token follow-ups, CPU defaults. The
    isolated replica prefills document and follow-up cold in one step of up to 2,048 tokens, the shared one
    the follow-up alone after the load: every follow-up chunk differs, and that is no damage. The table says
    why it left them out; where the step ends at the document (a step of 1,024, or 2,048-token documents) the
    same bytes are damage and fail the gate."""
    def table(config, root):
        return kvbytes.kv_bytes_table(
            {("lmcache-fs", 256, "disk", "shared"): run_cell(root, "shared", ("followup0", "followup1")),
             ("lmcache-fs", 256, "disk", "isolated"): run_cell(root, "isolated")}, config)

    clean = table(cpu_config(1024), tmp_path / "clean")
    assert kvbytes.unexpected(clean).empty
    row = clean.set_index("comparison").loc["after_load_against_cold"]
    assert row["differ"] == 2 and not row["bit_exact_expected"]
    said = "steps of 2048 tokens (vLLM's max_num_batched_tokens), so its step holding the follow-up starts at token 0"
    assert said in row["meaning"]
    (_, _, found), = kvbytes.findings(clean)
    assert found.startswith("Every chunk that must agree bit for bit does (store_across_arms 2 of 2)")
    assert f"after_load_against_cold 2 of 2 (the isolated arm prefills cold in {said}" in found
    for number, config in enumerate((cpu_config(1024, extra_args=("--max-num-batched-tokens", "1024")),
                                     cpu_config(2048))):
        damaged = table(config, tmp_path / f"damaged{number}")
        assert list(kvbytes.unexpected(damaged)["comparison"]) == ["after_load_against_cold"]
        assert kvbytes.finding(damaged).startswith("Load side: the document chunks agree, yet 2 of 2")


@pytest.mark.parametrize("damage", ["one bit", "random bytes", "removed"])
def test_a_pool_file_changed_between_populate_and_reuse_is_caught(tmp_path, damage):
    import random

    dirs = [tmp_path / "replica-0", tmp_path / "replica-1"]
    write(dirs[0], "doc0", kv("doc0"))
    write(dirs[1], "doc1", kv("doc1"))
    populate = kvbytes.pool_digests(dirs)
    target = dirs[1] / KEYS["doc1"]
    data = bytearray(target.read_bytes())
    if damage == "one bit":
        data[len(data) // 2] ^= 0x01
    elif damage == "random bytes":
        data[:64] = random.Random(0).randbytes(64)
    if damage == "removed":
        target.unlink()
    else:
        target.write_bytes(bytes(data))
    write(dirs[0], "followup1", kv("followup1"))  # a chunk reuse adds is not a change
    found = kvbytes.unchanged(populate, kvbytes.pool_digests(dirs, populate))
    assert (found["changed"], found["missing"]) == ((0, 1) if damage == "removed" else (1, 0))
    assert found["files"] == 2 and found["example"] == f"replica-1/{KEYS['doc1']}"
    assert kvbytes.unchanged(populate, kvbytes.pool_digests(dirs[:1], populate))["missing"] >= 1

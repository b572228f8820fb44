"""Study B's design: block order and pairs, payloads, the chain and session sequencing, the block checks,
ON/OFF pairing and the tables, driven by a stand-in replica fleet that keeps a prefix cache and a pool."""

import asyncio
import math
import re
from pathlib import Path

import pandas as pd
import pytest
from support.studyb_standin import StandIn

from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.engine.plan import fleet_plan
from kvpool.measure import records, reference
from kvpool.measure.checks import verdict
from kvpool.measure.records import ChainRecord
from kvpool.report import studyb as studyb_report
from kvpool.studies import chain_stores, studyb, studyb_pool, studyb_tables

VOCAB = list(range(1000, 3000))


@pytest.fixture
def study(config):
    config["study_b"].update(contexts=[256, 512], sessions=2, turns=4, session_tokens=256, turn_tokens=32,
                             warmups=1, question_tokens=8)
    return studyb.resolved(config)


def test_blocks_run_off_on_on_off_and_pair_first_two_and_last_two():
    names = studyb.blocks({"repeats": 2})
    assert names == ["1-off", "2-on", "3-on", "4-off", "5-off", "6-on", "7-on", "8-off"]
    assert studyb.block_pairs(names) == [("1-off", "2-on"), ("4-off", "3-on"), ("5-off", "6-on"), ("8-off", "7-on")]
    # a run cut short pairs what it finished
    assert studyb.block_pairs(["1-off", "2-on", "3-on"]) == [("1-off", "2-on")]


def test_the_study_resolves_its_pool_and_refuses_what_cannot_run(config):
    study = studyb.resolved(config)
    assert (study["backend"], study["chunk"]) == (config["backends"][0], config["chunk_sizes"][0])
    assert study["tier"] == ("ram" if "ram" in config["tiers"] else next(iter(config["tiers"])))
    config["study_b"]["contexts"] = [300]
    with pytest.raises(ValueError, match=r"contexts \[300\] are not whole chunks"):
        studyb.resolved(config)
    config["study_b"].update(contexts=[256], backend="lmcache-local-disk")
    config["backends"] = ["lmcache-local-disk"]
    with pytest.raises(ValueError, match="cannot share a pool"):
        studyb.resolved(config)
    config["study_b"].update(backend=None, session_tokens=10**6)
    config["backends"] = ["lmcache-fs"]
    with pytest.raises(ValueError, match="more than engine.max_model_len"):
        studyb.resolved(config)


def test_an_on_blocks_pool_is_counted_in_whole_chunks_and_an_mp_l1_too_small_for_it_is_refused(config, study):
    """A block's pool ends with a warm-up's chunk, each chain's document and question, and each session's last turn
    with its answer, whole chunks only (the committed hybrid run's MP server wrote exactly the count: 68). An MP
    server's memory L1 that cannot hold it at l1_fill is refused before any block, at the pool's bytes a token."""
    # warm-up 1; chains (256 + 8) // 256 + (512 + 8) // 256 = 3; 2 placements x (2 sessions + a window of 2) of
    # (256 + 3 x (32 + 8) + 8) // 256 = 1 chunk each
    assert studyb_pool.pool_chunks(study, config) == 1 + 3 + 2 * (2 + 2) * 1
    config["study_b"].update(contexts=[8192], sessions=1, turns=6, session_tokens=8192, turn_tokens=1024, warmups=2,
                             windows=[], question_tokens=16)
    config["chunk_sizes"] = [256]
    config["backends"], config["tiers"] = ["lmcache-mp"], {"ram": "/dev/shm/kvpool"}
    config["lmcache_mp"].update(memory_tiers=["ram"], l1_size_gib=0.05)
    chunks = 2 + 8208 // 256 + 2 * ((8192 + 5 * (1024 + 8) + 8) // 256)
    per_token = engine_pool_bytes_per_token(config)
    needed = chunks * 256 * per_token
    assert studyb_pool.pool_chunks(studyb.resolved(config), config) == chunks
    (refused,) = studyb_pool.problems(config)
    assert f"holds {chunks} chunks of 256 tokens" in refused and "lmcache_mp.l1_size_gib 0.05" in refused
    assert f"at least {math.ceil(needed / config['lmcache_mp']['l1_fill'] / 2**30)}" in refused
    config["lmcache_mp"]["l1_size_gib"] = needed / config["lmcache_mp"]["l1_fill"] / 2**30 * 1.01
    assert studyb_pool.problems(config) == []
    config["lmcache_mp"]["memory_tiers"] = []  # a drive tier's L2 holds the pool
    config["lmcache_mp"]["l1_size_gib"] = 0.05
    assert studyb_pool.problems(config) == []


def test_payloads_are_seeded_and_no_two_documents_share_a_prefix(study):
    workload = studyb.make_workload(VOCAB, study, replicas=2)
    assert workload == studyb.make_workload(VOCAB, study, replicas=2)
    firsts = [c["prompt"][0] for c in workload["chains"]] + [s["first"][0] for s in workload["sessions"]] \
        + [w["first"][0] for w in workload["windows"]] + [w[0] for w in workload["warmups"]]
    assert len(firsts) == len(set(firsts)) == 2 + 4 + 2 * 2 + 1  # windows: 2 sessions at once per placement
    assert [len(c["prompt"]) for c in workload["chains"]] == [256 + 8, 512 + 8]
    # chains alternate which replica prefills, so both replicas serve cross-replica steps
    assert [c["replicas"] for c in workload["chains"]] == [{"A": 0, "B": 1}, {"A": 1, "B": 0}]
    assert all(len(s["increments"]) == 3 and all(len(i) == 32 for i in s["increments"]) for s in workload["sessions"])


def run_blocks(study, damage=False):
    workload = studyb.make_workload(VOCAB, study, replicas=2)
    rows = []
    for block in studyb.blocks({"repeats": 1}):
        fleet = StandIn(study["chunk"], pooled=studyb.block_arm(block) == studyb.ON, damage=damage)
        rows += asyncio.run(studyb.run_block(fleet.send, block, workload, study, 2))
    return records.frame(ChainRecord, rows)


def test_a_block_sends_warmups_chains_then_sessions_that_grow_by_answer_and_new_tokens(study):
    workload = studyb.make_workload(VOCAB, study, replicas=2)
    fleet = StandIn(study["chunk"], pooled=True)
    rows = records.frame(ChainRecord, asyncio.run(studyb.run_block(fleet.send, "2-on", workload, study, 2)))
    assert list(rows["kind"].drop_duplicates()) == ["warmup", "chain", "session", "window"]
    chain = rows[(rows["kind"] == "chain") & (rows["context"] == 256)]
    assert list(chain["step"]) == [step for step, _ in studyb.CHAIN] and list(chain["replica"]) == [0, 0, 0, 1, 1]
    assert chain.set_index("step").loc["cross", "external_hit_tokens"] == 256
    session = rows[(rows["kind"] == "session") & (rows["placement"] == "alternating") & (rows["session"] == 0)]
    assert list(session["replica"]) == [0, 1, 0, 1]
    assert list(session["prompt_tokens"]) == [256 + t * (4 + 32) for t in range(4)]  # + answer + new tokens
    fixed = rows[(rows["kind"] == "session") & (rows["placement"] == "fixed")]
    assert fixed.groupby("session")["replica"].nunique().eq(1).all()


def test_a_pool_that_stores_after_the_answer_is_waited_for_before_each_step_and_turn_outside_the_session_wall(study):
    """vllm-fs: kvpool waits for the stores before every chain step (before the fault injection or page-cache
    drop) and session turn, records each wait on the request after it, and takes the waits between a session's
    turns out of its wall time; warm-ups and windows are not waited for."""
    workload = studyb.make_workload(VOCAB, study, replicas=2)
    fleet, events = StandIn(study["chunk"], pooled=True), []

    async def send(replica, prompt):
        events.append("send")
        return await fleet.send(replica, prompt)

    async def landed():
        events.append("wait")
        await asyncio.sleep(0.05)
        return 0.05

    rows = records.frame(ChainRecord, asyncio.run(studyb.run_block(
        send, "2-on", workload, study, 2, lambda step: events.append(step), wait_for_stores=landed)))
    waited = rows.groupby("kind", sort=False)["stores_waited_s"].agg(lambda s: sorted(set(s.fillna(-1))))
    assert waited.to_dict() == {"warmup": [-1], "chain": [0.05], "session": [0.05], "window": [-1]}
    first_chain = events.index("cold")
    assert events[first_chain - 1:first_chain + 2] == ["wait", "cold", "send"]
    walls = studyb_tables.session_walls(rows).set_index(["placement", "session"])
    sessions = rows[rows["kind"] == "session"].groupby(["placement", "session"])
    raw = sessions["finished_at"].max() - sessions["started_at"].min()
    turns = study["turns"]
    assert walls["stores_waited_s"].tolist() == pytest.approx([0.05 * (turns - 1)] * len(walls))
    assert walls["wall_s"].tolist() == pytest.approx((raw - 0.05 * (turns - 1)).reindex(walls.index).tolist())
    assert (raw > 0.05 * (turns - 1)).all()  # the waits were inside the raw wall


def test_a_pools_chunks_are_named_by_their_prefix_and_a_partial_chunk_by_none():
    first = list(range(10))
    assert len(chain_stores.chunk_keys([first], 4)) == 2  # two whole chunks of 4; the last 2 tokens stay in the GPU
    assert len(chain_stores.chunk_keys([first, list(range(8)) + [99, 98]], 4)) == 2  # the same two chunks again
    assert len(chain_stores.chunk_keys([first, [0, 1, 2, 3, 9, 9, 9, 9]], 4)) == 3  # one shared, one its own
    assert len(chain_stores.chunk_keys([first, [4, 5, 6, 7, 0, 1, 2, 3]], 4)) == 4  # the same tokens after other ones


def recompute(rows: pd.DataFrame) -> pd.DataFrame:
    """A pool-less recompute of every (payload, split) the rows measured, as a faithful pool answers."""
    return reference.twin_rows(rows.assign(key=rows["payload_sha256"]), "split")


def test_each_arm_passes_its_checks_and_fails_on_a_hit_where_none_belongs(study):
    rows = run_blocks(study)
    good = recompute(rows[rows["block"] == "2-on"])
    for block in ("1-off", "2-on"):
        checks = studyb.block_checks(rows[rows["block"] == block], studyb.block_arm(block), study, 0.9, good)
        assert verdict(checks), checks
    assert studyb.block_checks(rows[rows["block"] == "1-off"], studyb.OFF, study, 0.9)[
        "output_matches_recompute"]["status"] == "not_applicable"  # an OFF block has no pool to check
    on = rows[rows["block"] == "2-on"].copy()
    cross = (on.kind == "chain") & (on["step"] == "cross")
    on.loc[cross, "local_hit_tokens"] = 16  # B found the document in its own cache: not a cross-replica step
    on.loc[(on.kind == "chain") & (on["step"] == "cold"), "external_hit_tokens"] = 256
    checks = studyb.block_checks(on, studyb.ON, study, 0.9)
    assert not checks["cross_finds_nothing_locally"]["ok"] and not checks["cold_finds_nothing"]["ok"]
    off = rows[rows["block"] == "1-off"].copy()
    off.loc[(off.kind == "chain") & (off["step"] == "cross"), "external_hit_tokens"] = 256
    assert not studyb.block_checks(off, studyb.OFF, study, 0.9)["cross_loads_nothing"]["ok"]
    missing = rows[(rows["block"] == "2-on") & ~((rows["kind"] == "session") & (rows["turn"] == 3))]
    assert not studyb.block_checks(missing, studyb.ON, study, 0.9)["every_turn_answered"]["ok"]


def test_damaged_kv_fails_an_on_block_against_the_recompute_in_its_split(study):
    """A pool that returns damaged KV changes the answers of the requests that loaded from it: the ON block's
    answers then differ from a pool-less recompute in the same splits, and the block is invalid. The
    windows' answers, sent together, are not verified without batch-invariant kernels."""
    faithful, damaged = run_blocks(study), run_blocks(study, damage=True)
    good = recompute(faithful[faithful["block"] == "2-on"])
    on = damaged[damaged["block"] == "2-on"]
    checks = studyb.block_checks(on, studyb.ON, study, 0.9, good)
    assert checks["output_matches_recompute"]["ok"] is False and not verdict(checks)
    assert checks["window_outputs_match_recompute"]["status"] == "not_verified"
    invariant = studyb.block_checks(faithful[faithful["block"] == "2-on"], studyb.ON, study, 0.9, good, True)
    assert "window_outputs_match_recompute" not in invariant
    assert invariant["output_matches_recompute"]["value"]["compared"] > checks["output_matches_recompute"]["value"][
        "compared"]  # the windows too


def test_pairs_match_by_payload_and_replica_and_their_answers_are_counted(study):
    pairs = studyb.block_pairs(studyb.blocks({"repeats": 1}))
    rows = run_blocks(study)
    checks = studyb_tables.pairing_checks(rows, pairs)
    assert checks["every_on_request_paired"]["ok"] and set(checks) == {"every_on_request_paired"}
    agreement = studyb_tables.pairing_agreement(rows, pairs)
    assert agreement["equal"] == agreement["of"] > 0
    damaged = run_blocks(study, damage=True)
    assert studyb_tables.pairing_agreement(damaged, pairs)["equal"] < agreement["equal"]
    # an answer apart changes the next turn's payload: those turns no longer pair, which the pairing explains
    # (the ON block's own gate is what fails on damaged KV: test_damaged_kv_fails_an_on_block...)
    pairing = studyb_tables.pairing_checks(damaged, pairs)["every_on_request_paired"]
    assert pairing["ok"] and pairing["value"]["after_an_answer_apart"] > 0
    # a turn unpaired for any other reason breaks the design
    broken = rows.copy()
    turn = (broken["block"] == "2-on") & (broken["kind"] == "session") & (broken["turn"] == 0)
    broken.loc[turn, "payload_sha256"] = "another prompt"
    assert not studyb_tables.pairing_checks(broken, pairs)["every_on_request_paired"]["ok"]


def test_the_tables_show_the_cross_step_and_alternating_sessions_gain_only_with_the_pool(study):
    rows = run_blocks(study)
    pairs = studyb.block_pairs(studyb.blocks({"repeats": 1}))
    locality = studyb_tables.locality_table(rows, pairs).set_index(["context", "step"])
    assert list(locality.index.get_level_values("step")[:5]) == [step for step, _ in studyb.CHAIN]
    cross = locality.loc[(512, "cross")]
    assert cross["on_external_hit_tokens"] == 512 and cross["off_external_hit_tokens"] == 0
    assert cross["mean_paired_change_pct"] < -50 and cross["pairs_matched"] == 2 and cross["outputs_equal"] == 2
    assert abs(locality.loc[(512, "cold"), "mean_paired_change_pct"]) < 1e-9  # nothing to gain when cold
    assert locality.loc[(512, "cross"), "on_observations_s"].count(";") == 1  # both ON blocks' observations
    assert pd.isna(cross["change_ci_low_pct"])  # two block pairs: no interval, as in Study B
    sessions = studyb_tables.sessions_table(rows, pairs).set_index("placement")
    assert sessions.loc["alternating", "turn_ttft_change_pct"] < -10
    assert abs(sessions.loc["fixed", "turn_ttft_change_pct"]) < 1e-9
    # decode is (N_out - 1) / (last token - first token): 3 tokens in 0.09 s, unchanged by the pool
    assert rows.loc[rows["kind"] == "session", "decode_tokens_per_s"].round(6).eq(round(3 / 0.09, 6)).all()
    assert abs(sessions.loc["alternating", "decode_change_pct"]) < 1e-6


def test_the_locality_figure_draws_one_context_or_several(study, tmp_path):
    from kvpool.report import figures

    rows = run_blocks(study)
    for name, frame in (("both", rows), ("one", rows[rows["context"] != 256])):
        drawn = figures.save(figures.locality(frame), tmp_path, name)
        assert Path(drawn["png"]).stat().st_size > 10_000


def test_three_block_pairs_or_more_get_a_bootstrap_interval():
    assert all(pd.isna(v) for v in studyb_tables.mean_change_ci(pd.Series([-40.0, -42.0])))
    low, high = studyb_tables.mean_change_ci(pd.Series([-40.0, -42.0, -38.0, -41.0]))
    assert -42.0 <= low <= -40.25 <= high <= -38.0


def test_the_off_plan_is_the_on_plan_without_connector_or_pool(config, tmp_path):
    config["study_b"]["backend"] = None
    study = studyb.resolved(config)
    on = fleet_plan(config, studyb.block_cell(study, studyb.ON), "m", tmp_path, [18100, 18101], "config",
                    pool_root=tmp_path / "pool")
    off = fleet_plan(config, studyb.block_cell(study, studyb.OFF), "m", tmp_path, [18100, 18101], "config")
    assert all(r.kv_transfer and r.pool_dir.startswith(str(tmp_path / "pool")) for r in on.replicas)
    assert all(r.kv_transfer is None and r.pool_dir is None and "--kv-transfer-config" not in r.argv
               for r in off.replicas)
    for a, b in zip(on.replicas, off.replicas, strict=True):
        i = a.argv.index("--kv-transfer-config")
        assert a.argv[:i] + a.argv[i + 2:] == b.argv
        assert {k: v for k, v in a.env.items() if k != "LMCACHE_CONFIG_FILE"} == b.env


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one token per character."""
    return [5000 + ord(c) for c in text]


def test_a_real_models_chains_carry_three_planted_codes_and_the_block_checks_the_answers(study):
    workload = studyb.make_workload(VOCAB, study, replicas=2, encode=encode)
    question = encode(studyb.PLANTED_QUESTION)
    for chain in workload["chains"]:
        prompt, codes = chain["prompt"], chain["planted"]
        assert len(prompt) == chain["context"] + len(question) and prompt[-len(question):] == question
        text = "".join(chr(t - 5000) for t in prompt if t >= 5000)
        # near the start, in the middle and at the end of the document, in that order
        where = [text.index(f"The code for {label} is {code}.") for label, code in zip(studyb.PLANTED_LABELS, codes,
                                                                                        strict=True)]
        assert where == sorted(where) and len(set(codes)) == 3 and all(len(c) == 6 for c in codes)
    assert workload == studyb.make_workload(VOCAB, study, replicas=2, encode=encode)  # seeded
    fleet = StandIn(study["chunk"], pooled=True)
    rows = records.frame(ChainRecord, asyncio.run(studyb.run_block(fleet.send, "2-on", workload, study, 2)))
    assert not rows.loc[rows["kind"] == "chain", "planted_recalled"].any()  # the stand-in cannot answer
    check = studyb.block_checks(rows, studyb.ON, study, 0.9)["planted_values_recalled"]
    assert not check["ok"] and check["value"] == 0 and check["threshold"] == 10
    answered = rows.copy()
    codes = {c["context"]: " ".join(c["planted"]) for c in workload["chains"]}
    chain_rows = answered["kind"] == "chain"
    answered.loc[chain_rows, "planted_recalled"] = [
        studyb.recalled(f"The codes are {codes[c]}.", codes[c].split()) for c in answered.loc[chain_rows, "context"]]
    assert studyb.block_checks(answered, studyb.ON, study, 0.9)["planted_values_recalled"]["ok"]
    assert "planted_values_recalled" not in studyb.block_checks(run_blocks(study), studyb.OFF, study, 0.9)


def test_a_real_model_needs_room_to_answer_the_planted_question(config):
    config["engine"]["model"] = "/models/real"
    config["workload"]["output_tokens"] = 8
    with pytest.raises(ValueError, match="output_tokens 8 is too few"):
        studyb.resolved(config)


def test_a_windows_sessions_run_at_once_through_the_concurrent_send(study):
    """Study B's short concurrency windows: W sessions sent together, each session's turns in order,
    through the send that takes its hits from the response (not /metrics deltas)."""
    workload = studyb.make_workload(VOCAB, study, replicas=2)
    fleet = StandIn(study["chunk"], pooled=True)
    together = []

    async def send_together(replica, prompt):
        together.append(len(prompt))
        return await fleet.send(replica, prompt)

    fleet.most = 0
    sent = asyncio.run(studyb.run_block(fleet.send, "2-on", workload, study, 2, None, send_together))
    rows = records.frame(ChainRecord, sent)
    windows = rows[rows["kind"] == "window"]
    assert len(windows) == len(together) == 2 * 2 * study["window_turns"]  # 2 at once, 2 placements
    assert fleet.most == 2  # only the windows overlap
    for (placement, _), turns in windows.groupby(["placement", "session"]):
        assert list(turns["turn"]) == list(range(study["window_turns"]))
        assert list(turns["prompt_tokens"]) == [256 + t * (4 + 32) for t in range(study["window_turns"])]
        assert turns["replica"].nunique() == (2 if placement == "alternating" else 1)
    checks = studyb.block_checks(rows, studyb.ON, study, 0.9)
    assert checks["every_window_turn_answered"]["ok"]
    short = rows.drop(windows.index[-1])
    assert not studyb.block_checks(short, studyb.ON, study, 0.9)["every_window_turn_answered"]["ok"]


def test_the_windows_table_pairs_throughput_across_blocks():
    def window_rows(block, wall_s):
        return [{"block": block, "arm": studyb.block_arm(block), "kind": "window", "window": 2,
                 "placement": "alternating", "session": s, "turn": t, "ttft_s": 0.1 * wall_s,
                 "started_at": 100.0 + t * wall_s / 4, "finished_at": 100.0 + (t + 1) * wall_s / 4, "error": None}
                for s in range(2) for t in range(4)]

    rows = pd.DataFrame(window_rows("1-off", 2.0) + window_rows("2-on", 1.0) + window_rows("3-on", 1.0)
                        + window_rows("4-off", 4.0))
    table = studyb_tables.windows_table(rows, [("1-off", "2-on"), ("4-off", "3-on")], output_tokens=4)
    (row,) = table.itertuples()
    # 8 answered turns x 4 tokens over each window's wall time
    assert (row.off_tokens_per_s_median, row.on_tokens_per_s_median) == (pytest.approx(12.0), pytest.approx(32.0))
    assert row.mean_paired_change_pct == pytest.approx((100 + 300) / 2) and row.block_pairs == 2
    study = {"backend": "lmcache-mp", "chunk": 256, "tier": "ram", "warmups": 1, "window_turns": 4}
    gate = {"valid": True, "blocks": {}, "checks": {}}
    page = studyb_report.markdown(study, ["1-off", "2-on"], gate, pd.DataFrame(), pd.DataFrame(), [], table)
    assert "## Short concurrency windows" in page and "| 2 | alternating | 12 tok/s | 32 tok/s | 200% |" in page
    assert "stores after the answer" not in page  # no request waited: LMCache's MP server stores before it answers
    assert studyb_tables.windows_table(rows[rows["kind"] != "window"], [], 4).empty  # a run without windows
    # vllm-fs stores after the answer: where the records hold waits the page says the chains and sessions waited,
    # and how long, and the windows did not
    on_vllm_fs = studyb_report.markdown({**study, "backend": "vllm-fs"}, ["1-off", "2-on"], gate, pd.DataFrame(),
                                        pd.DataFrame(), [], table, waited_s=12.34)
    assert "waited for the stores of the requests before it (12.3 s in all" in on_vllm_fs
    assert "The windows' turns did not wait" in on_vllm_fs
    without_windows = studyb_report.markdown({**study, "backend": "vllm-fs"}, ["1-off", "2-on"], gate,
                                             pd.DataFrame(), pd.DataFrame(), [], pd.DataFrame(), waited_s=0.0)
    assert "(0.0 s in all" in without_windows and "windows' turns" not in without_windows


def test_studyb_md_builds_study_b_when_all_leaves_it_out_and_says_why_where_it_cannot(config, tmp_path):
    """config/backends.yaml disables Study B; `snakemake results/studyb.md` builds it all the same, as the
    README and the schema say. Where it has no block (a disabled study that cannot run with the config, or
    measured_only before any block finished) its page and record say that nothing was measured and why. Its
    blocks log under their results path: a replica's log a check reads is never one that a block of another
    backend, chunk size or tier appended to."""
    import json
    import subprocess
    import sys

    from support import REPO

    dry = subprocess.run([sys.executable, "-m", "snakemake", "-n", "results/studyb.md", "--directory", str(tmp_path),
                          "-s", str(REPO / "Snakefile"), "--configfile", str(REPO / "config" / "backends.yaml")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert re.search(r"^studyb_block\s+4$", dry.stdout, re.M), dry.stdout[-3000:]
    assert "results/studyb/backend~lmcache-fs/chunk~256/tier~ram/block~1-off/block.json" in dry.stdout
    logs = re.findall(r"^\s+log: (logs/studyb/\S*block~\S+)$", dry.stdout, re.M)
    assert len(logs) == 4
    assert all(log.startswith("logs/studyb/backend~lmcache-fs/chunk~256/tier~ram/block~") for log in logs)
    out = {name: tmp_path / name for name in ("locality.csv", "sessions.csv", "summary.csv", "windows.csv",
                                              "validity.json", "studyb.md")}
    why = "study_b.enabled is false, and Study B cannot run with this config: study_b.backend ..."
    studyb_report.run_studyb_tables(config, None, {}, locality_csv=out["locality.csv"],
                                    sessions_csv=out["sessions.csv"], summary_csv=out["summary.csv"],
                                    windows_csv=out["windows.csv"], validity_out=out["validity.json"],
                                    md_out=out["studyb.md"], figures_dir=tmp_path / "figures", missing=why)
    assert f"No block of Study B was measured: {why}." in out["studyb.md"].read_text()
    record = json.loads(out["validity.json"].read_text())
    assert record["valid"] is False and record["not_measured"] == why and record["blocks"] == {}


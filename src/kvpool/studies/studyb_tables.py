"""Study B's tables from its blocks' records: ON requests paired with their OFF twins (same payload, same
replica) per block pair, the locality chains (Study B's Table 3), the sessions (Table 4), the short
concurrency windows, and the study's gate (each block's checks and the pairing). kvpool.report.studyb
writes them, their figures and the page."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvpool.measure.checks import FAILED, check, status, tally, verdict
from kvpool.measure.files import read_json
from kvpool.measure.records import read_records
from kvpool.studies.studyb import CHAIN, OFF, ON, block_pairs


def paired(rows: pd.DataFrame, pairs: list[tuple[str, str]], key: list[str]) -> pd.DataFrame:
    """ON rows beside their OFF rows, one line per ON/OFF block pair and ``key`` (the request's place in
    the design); a pair holds only when payload and replica agree too."""
    frames = []
    for number, (off_block, on_block) in enumerate(pairs, start=1):
        off = rows[rows["block"] == off_block].set_index(key)
        on = rows[rows["block"] == on_block].set_index(key)
        both = on.merge(off, how="outer", left_index=True, right_index=True, suffixes=("_on", "_off"))
        both["pair"] = number
        both["paired"] = ((both["payload_sha256_on"] == both["payload_sha256_off"])
                          & (both["replica_on"] == both["replica_off"]))
        both["output_equal"] = both["paired"] & (both["output_text_on"] == both["output_text_off"])
        both["change_pct"] = 100 * (both["ttft_s_on"] / both["ttft_s_off"] - 1)
        frames.append(both.reset_index())
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def mean_change_ci(per_pair: pd.Series, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the mean paired change across ON/OFF block pairs (``per_pair``: one mean
    per pair); NaN below three pairs, where Study B reported none either."""
    from scipy.stats import bootstrap

    values = per_pair.dropna().to_numpy(dtype=float)
    if len(values) < 3:
        return float("nan"), float("nan")
    if np.all(values == values[0]):
        return float(values[0]), float(values[0])
    result = bootstrap((values,), np.mean, confidence_level=confidence, n_resamples=2000, method="percentile",
                       random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def _observations(values: pd.Series) -> str:
    return ";".join(f"{v:.4g}" for v in values.dropna())


def _mean_change(changes: pd.DataFrame) -> dict:
    """The mean of ``changes``' paired changes (``change_pct``) and its interval across block pairs."""
    per_pair = changes.groupby("pair")["change_pct"].mean()
    low, high = mean_change_ci(per_pair)
    return {"mean_paired_change_pct": float(changes["change_pct"].mean()) if changes["change_pct"].notna().any()
            else np.nan, "change_ci_low_pct": low, "change_ci_high_pct": high,
            "block_pairs": int(per_pair.notna().sum())}


def locality_table(rows: pd.DataFrame, pairs: list[tuple[str, str]]) -> pd.DataFrame:
    """Study B's Table 3: per context and chain step, each arm's median TTFT, its observations and hit
    tokens by source, and the mean ON/OFF paired change."""
    chains = rows[rows["kind"] == "chain"]
    matched = paired(chains, pairs, ["context", "chain", "step"])
    table = []
    for (context, step), group in chains.groupby(["context", "step"], sort=False):
        row = {"context": int(context), "step": step}
        for arm in (OFF, ON):
            values = group[group["arm"] == arm]
            row.update({f"{arm}_ttft_median_s": values["ttft_s"].median(), f"{arm}_n": int(values["ttft_s"].count()),
                        f"{arm}_observations_s": _observations(values["ttft_s"]),
                        f"{arm}_local_hit_tokens": values["local_hit_tokens"].median(),
                        f"{arm}_external_hit_tokens": values["external_hit_tokens"].median(),
                        f"{arm}_computed_tokens": values["computed_tokens"].median()})
        at = matched[(matched["context"] == context) & (matched["step"] == step)]
        row.update({**_mean_change(at), "pairs_matched": int(at["paired"].sum()),
                    "outputs_equal": int(at["output_equal"].sum())})
        table.append(row)
    order = {step: i for i, (step, _) in enumerate(CHAIN)}
    return pd.DataFrame(table).sort_values(["context", "step"], key=lambda s: s.map(order) if s.name == "step"
                                           else s).reset_index(drop=True)


def session_walls(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per block and session: its wall time, first request sent to last answer complete, less kvpool's
    waits between its turns for the pool's stores to land (a pool that stores after the answer: vllm-fs)."""
    sessions = rows[rows["kind"] == "session"]
    # the wait before the first turn comes before the session starts
    between = sessions.get("stores_waited_s", pd.Series(0.0, index=sessions.index)).fillna(0.0).where(
        sessions["turn"] > 0, 0.0)
    grouped = sessions.assign(between=between).groupby(["block", "arm", "placement", "session"], sort=False)
    walls = grouped.agg(started=("started_at", "min"), finished=("finished_at", "max"), turns=("turn", "count"),
                        ttft_total_s=("ttft_s", "sum"), errors=("error", "count"),
                        stores_waited_s=("between", "sum")).reset_index()
    walls["wall_s"] = walls["finished"] - walls["started"] - walls["stores_waited_s"]
    return walls.drop(columns=["started", "finished"])


def sessions_table(rows: pd.DataFrame, pairs: list[tuple[str, str]]) -> pd.DataFrame:
    """Study B's Table 4: per placement, each arm's median session wall time and its observations,
    the mean ON/OFF paired change of the wall time, and of the TTFT per turn."""
    walls = session_walls(rows)
    sessions = rows[rows["kind"] == "session"]
    turns = paired(sessions, pairs, ["placement", "session", "turn"])
    wall_pairs = []
    for number, (off_block, on_block) in enumerate(pairs, start=1):
        off = walls[walls["block"] == off_block].set_index(["placement", "session"])["wall_s"]
        on = walls[walls["block"] == on_block].set_index(["placement", "session"])["wall_s"]
        wall_pairs.append(pd.DataFrame({"pair": number, "change_pct": 100 * (on / off - 1)}).reset_index())
    wall_change = pd.concat(wall_pairs, ignore_index=True) if wall_pairs else pd.DataFrame()
    table = []
    for placement, group in walls.groupby("placement", sort=False):
        row = {"placement": placement}
        for arm in (OFF, ON):
            values = group[group["arm"] == arm]["wall_s"]
            row.update({f"{arm}_wall_median_s": values.median(), f"{arm}_n": int(values.count()),
                        f"{arm}_observations_s": _observations(values)})
        placed = turns[turns["placement"] == placement]
        decode = placed["decode_tokens_per_s_on"] / placed["decode_tokens_per_s_off"]
        row.update({"decode_change_pct": float(100 * (decode.mean() - 1)) if decode.notna().any() else np.nan,
                    **_mean_change(wall_change[wall_change["placement"] == placement]),
                    "turn_ttft_change_pct": placed["change_pct"].mean(),
                    "turns_matched": int(placed["paired"].sum()), "outputs_equal": int(placed["output_equal"].sum())})
        table.append(row)
    return pd.DataFrame(table)


WINDOW_COLUMNS = ["window", "placement", "off_tokens_per_s_median", "off_n", "off_observations",
                  "on_tokens_per_s_median", "on_n", "on_observations", "off_turn_ttft_median_s",
                  "on_turn_ttft_median_s", "mean_paired_change_pct", "change_ci_low_pct", "change_ci_high_pct",
                  "block_pairs"]


def window_walls(rows: pd.DataFrame, output_tokens: int) -> pd.DataFrame:
    """One row per block, window size and placement: the window's wall time (first request sent to
    last answer complete) and its output tokens per second (answered turns x ``output_tokens``)."""
    windows = rows[rows["kind"] == "window"] if "window" in rows else rows.iloc[0:0]
    if windows.empty:
        return pd.DataFrame(columns=["block", "arm", "window", "placement", "turns", "answered", "wall_s",
                                     "output_tokens_per_s"])
    grouped = windows.groupby(["block", "arm", "window", "placement"], sort=False)
    walls = grouped.agg(started=("started_at", "min"), finished=("finished_at", "max"), turns=("turn", "count"),
                        answered=("error", lambda errors: int(errors.isna().sum()))).reset_index()
    walls["wall_s"] = walls["finished"] - walls["started"]
    walls["output_tokens_per_s"] = walls["answered"] * output_tokens / walls["wall_s"]
    return walls.drop(columns=["started", "finished"])


def windows_table(rows: pd.DataFrame, pairs: list[tuple[str, str]], output_tokens: int) -> pd.DataFrame:
    """Study B's short concurrency windows: per window size and placement, each arm's median output
    tokens per second, its observations and median turn TTFT, and the mean ON/OFF paired change of the
    throughput across block pairs."""
    walls = window_walls(rows, output_tokens)
    if walls.empty:
        return pd.DataFrame(columns=WINDOW_COLUMNS)
    turns = rows[rows["kind"] == "window"]
    key = ["window", "placement"]
    changes = []
    for number, (off_block, on_block) in enumerate(pairs, start=1):
        off = walls[walls["block"] == off_block].set_index(key)["output_tokens_per_s"]
        on = walls[walls["block"] == on_block].set_index(key)["output_tokens_per_s"]
        changes.append(pd.DataFrame({"pair": number, "change_pct": 100 * (on / off - 1)}).reset_index())
    change = pd.concat(changes, ignore_index=True) if changes else pd.DataFrame(columns=[*key, "pair", "change_pct"])
    table = []
    for (window, placement), group in walls.groupby(key, sort=False):
        row = {"window": int(window), "placement": placement}
        for arm in (OFF, ON):
            values = group[group["arm"] == arm]["output_tokens_per_s"]
            ttft = turns[(turns["window"] == window) & (turns["placement"] == placement) & (turns["arm"] == arm)]
            row.update({f"{arm}_tokens_per_s_median": values.median(), f"{arm}_n": int(values.count()),
                        f"{arm}_observations": _observations(values),
                        f"{arm}_turn_ttft_median_s": ttft["ttft_s"].median()})
        row.update(_mean_change(change[(change["window"] == window) & (change["placement"] == placement)]))
        table.append(row)
    return pd.DataFrame(table, columns=WINDOW_COLUMNS)


def pairing_checks(rows: pd.DataFrame, pairs: list[tuple[str, str]]) -> dict:
    """Every measured ON request has its OFF twin (same payload, same replica): the design's pairing. A
    session turn whose prompt holds an earlier turn's answer pairs only while the twins' answers agree:
    after a turn whose twins answered apart (another prefill split, :func:`pairing_agreement`) its later
    turns have other prompts by design, and are counted as explained, not as a broken pairing."""
    both = _pairs(rows, pairs)
    total = len(both)
    apart = both[both["paired"] & ~both["output_equal"] & both["turn"].notna()] if total else both
    unpaired = both[~both["paired"]] if total else both
    explained = sum(bool(((apart["pair"] == row.pair) & (apart["placement"] == row.placement)
                          & (apart["session"] == row.session) & (apart["turn"] < row.turn)).any())
                    for row in unpaired.itertuples() if pd.notna(row.turn))
    return {"every_on_request_paired": check(total > 0 and len(unpaired) == explained,
                                              {"paired": int(both["paired"].sum()) if total else 0,
                                               "after_an_answer_apart": explained}, total)}


def pairing_agreement(rows: pd.DataFrame, pairs: list[tuple[str, str]]) -> dict:
    """How many ON requests gave their OFF twin's greedy answer (information, not the verdict)."""
    both = _pairs(rows, pairs)
    return {"equal": int(both["output_equal"].sum()) if len(both) else 0, "of": len(both)}


def _pairs(rows: pd.DataFrame, pairs: list[tuple[str, str]]) -> pd.DataFrame:
    measured = rows[rows["kind"] != "warmup"]
    chains = paired(measured[measured["kind"] == "chain"], pairs, ["context", "chain", "step"])
    sessions = paired(measured[measured["kind"] == "session"], pairs, ["placement", "session", "turn"])
    return pd.concat([chains, sessions], ignore_index=True)


def with_pairs(frame: pd.DataFrame, pairs: list[tuple[str, str]]) -> pd.DataFrame:
    """``frame`` with the number of the ON/OFF block pair each row's block belongs to."""
    number = {block: i for i, pair in enumerate(pairs, start=1) for block in pair}
    return frame.assign(pair=frame["block"].map(number))


@dataclass(frozen=True)
class StudyBTables:
    """Study B's tables: the blocks in run order (``names``) and their ON/OFF ``pairs``, every request
    (``rows``), Table 3 (``locality``), every session turn with its session's wall time (``turns``), Table
    4 (``sessions``), the concurrency windows (``windows``), each session's wall time with its block pair
    (``walls``) and the study's ``gate``."""

    names: list[str]
    pairs: list[tuple[str, str]]
    rows: pd.DataFrame
    locality: pd.DataFrame
    turns: pd.DataFrame
    sessions: pd.DataFrame
    windows: pd.DataFrame
    walls: pd.DataFrame
    gate: dict


def studyb_tables(config: dict, study: dict, blocks: dict) -> StudyBTables:
    """Study B's tables from every block (``blocks``: name -> requests.csv and block.json): the locality
    chains, every session turn and the sessions per placement, the windows, and the study's gate (each
    block's checks and the ON/OFF pairing)."""
    names = list(blocks)
    rows = pd.concat([read_records(paths["csv"]) for paths in blocks.values()], ignore_index=True)
    pairs = block_pairs(names)
    locality = locality_table(rows, pairs)
    turns = rows[rows["kind"] == "session"].merge(
        session_walls(rows)[["block", "placement", "session", "wall_s"]], on=["block", "placement", "session"])
    turns = turns.rename(columns={"wall_s": "session_wall_s", "context": "prompt_context"})
    turns = turns.drop(columns=["kind", "chain", "step", "window", "output_text"], errors="ignore")
    sessions = sessions_table(rows, pairs)
    windows = windows_table(rows, pairs, config["workload"]["output_tokens"])
    metas = {name: read_json(paths["meta"]) for name, paths in blocks.items()}
    checks = pairing_checks(rows, pairs)
    gate = {"blocks": {name: {"arm": meta["arm"], "valid": meta["valid"],
                              "failed": [c for c, check in meta["checks"].items() if status(check) == FAILED],
                              "checks": tally(meta["checks"])}
                       for name, meta in metas.items()},
            "checks": checks, "information": {"outputs_equal_across_pairs": pairing_agreement(rows, pairs)},
            "backend": study["backend"], "tier": study["tier"], "chunk": study["chunk"]}
    gate["valid"] = all(b["valid"] for b in gate["blocks"].values()) and verdict(checks)
    return StudyBTables(names, pairs, rows, locality, turns, sessions, windows,
                        with_pairs(session_walls(rows), pairs), gate)

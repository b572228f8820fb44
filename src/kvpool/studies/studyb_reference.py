"""Study B's split-matched reference: what an ON block's answers are compared with.

An ON block's request must answer as a pool-less recompute in the split it ran in. Most of those splits
an OFF block ran itself (its answers are pool-less: ``twin_rows``). The rest are the pool's: a session
turn served by the replica that did not serve the turn before it finds that turn's whole chunks in the
shared pool, more than its own cache held. An OFF block that an ON block follows computes those
predicted splits on its own pool-less fleet, after its timed window and before its replicas stop, into
its ``reference.csv``; the ON blocks read it (``known_answers``) and start a reference replica of their
own only for a split no prediction covered (kvpool.measure.timed.recompute_in_splits).
"""

from __future__ import annotations

import pandas as pd

from kvpool.measure import reference as split_reference
from kvpool.measure.records import read_records

# The reference rows an OFF block computed for the ON blocks after it.
PREDICTED = "predicted_on"


def known_answers(paths: list[str], off: str) -> pd.DataFrame:
    """Pool-less answers recorded by earlier units, as reference rows: an OFF block's requests (each in
    its own split; ``off`` is the OFF arm's name) and any reference.csv (an OFF block's predicted splits,
    an ON block's computed ones)."""
    frames = []
    for path in paths:
        rows = read_records(path)
        if "arm" in rows:  # a Study B block's requests: only an OFF block's ran without a pool
            pool_less = rows[(rows["arm"] == off) & (rows["kind"] != "warmup")]
            frames.append(known_answers_of(pool_less))
        else:
            frames.append(split_reference.normalized(rows))
    return pd.concat(frames, ignore_index=True) if frames else split_reference.normalized(None)


def predicted_pool_splits(rows: pd.DataFrame, chunk: int) -> list[tuple[str, int]]:
    """(payload, split) pairs an ON block is predicted to run in that ``rows`` (an OFF block's answered
    chains and sessions, keyed by ``payload_sha256``) did not: a session turn on another replica than its
    previous turn finds that turn's whole chunks in the pool, and a cross step its document's whole
    chunks, wherever that is more than the OFF block's own cache gave."""
    ok = rows[(rows["error"].fillna("") == "") & rows["kind"].isin(["chain", "session"])]
    predicted = []
    for row in ok[(ok["kind"] == "chain") & (ok["step"] == "cross")].itertuples():
        predicted.append((row.payload_sha256, int(row.prompt_tokens) // chunk * chunk, int(row.cached_tokens)))
    sessions = ok[ok["kind"] == "session"].sort_values("turn")
    for _, turns in sessions.groupby(["placement", "session"]):
        for before, turn in zip(turns.iloc[:-1].itertuples(), turns.iloc[1:].itertuples(), strict=True):
            if turn.replica != before.replica and turn.turn == before.turn + 1:
                predicted.append((turn.payload_sha256, int(before.prompt_tokens) // chunk * chunk,
                                  int(turn.cached_tokens)))
    covered = known_answers_of(ok)
    return [(key, split) for key, split, own in dict.fromkeys(predicted)
            if split > own and not ((covered["key"] == key) & (covered["achieved_split"] == split)).any()]


def known_answers_of(rows: pd.DataFrame) -> pd.DataFrame:
    """An OFF block's own answered requests as reference rows (each in the split it achieved)."""
    return split_reference.twin_rows(rows.assign(key=rows["payload_sha256"]), "off_block")

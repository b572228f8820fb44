"""Where a pool reload starts paying and the read rate at which it stops: a prefill model and a reload
model fitted to measured TTFTs of Study B's locality chains (kvpool.studies.studyb).

Prefill (the OFF arm's cold step, nothing cached): ``c + a*n + b*n**2`` seconds for ``n`` tokens,
the linear and the attention terms. Reload (the ON arm's cross step, the whole document from the
pool): ``overhead + n * bytes_per_token / read_rate``. From the two: the context from which a
reload beats the prefill, and, at each context, the read rate below which it no longer would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

# The locality chain's steps whose TTFTs the two models are fitted to (kvpool.studies.studyb.CHAIN)
PREFILL_STEP, RELOAD_STEP = "cold", "cross"
MIN_CONTEXTS = 3  # a quadratic through fewer points is not a fit


@dataclass(frozen=True)
class Fit:
    prefill: tuple[float, float, float]  # c, a, b of c + a*n + b*n**2 (s, s per token, s per token**2)
    overhead_s: float  # the reload's fixed part
    read_rate: float  # bytes per second the reloads moved, from the slope over the document's bytes
    bytes_per_token: int

    def prefill_s(self, tokens) -> np.ndarray:
        return np.polynomial.polynomial.polyval(np.asarray(tokens, dtype=float), self.prefill)

    def reload_s(self, tokens) -> np.ndarray:
        return self.overhead_s + np.asarray(tokens, dtype=float) * self.bytes_per_token / self.read_rate

    def break_even_rate(self, tokens) -> np.ndarray:
        """The read rate (bytes/s) at which a reload of ``tokens`` takes as long as their prefill;
        NaN where the prefill is no longer than the reload's fixed part (no rate pays)."""
        tokens = np.asarray(tokens, dtype=float)
        spare = self.prefill_s(tokens) - self.overhead_s
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(spare > 0, tokens * self.bytes_per_token / spare, np.nan)

    def crossover_tokens(self) -> float:
        """The smallest context (tokens) from which the reload is faster than the prefill: 0 when it
        already is as the context goes to zero, NaN when it is at no context."""
        c, a, b = self.prefill
        # prefill - reload, a quadratic in n: positive where the pool pays
        gap = (c - self.overhead_s, a - self.bytes_per_token / self.read_rate, b)
        if gap[0] > 0:
            return 0.0
        roots = np.atleast_1d(np.polynomial.polynomial.polyroots(gap))
        for root in sorted(r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0):
            if np.polynomial.polynomial.polyval(root * (1 + 1e-6) + 1e-6, gap) > 0:
                return float(root)
        return float("nan")


def fit(contexts, prefill_s, reload_s, bytes_per_token: int) -> Fit:
    """Fit both models (least squares) to per-context medians; ``contexts`` needs MIN_CONTEXTS values."""
    contexts = np.asarray(contexts, dtype=float)
    if len(np.unique(contexts)) < MIN_CONTEXTS:
        raise ValueError(f"a crossover needs at least {MIN_CONTEXTS} contexts, got {sorted(set(contexts))}")
    prefill = np.polynomial.polynomial.polyfit(contexts, np.asarray(prefill_s, dtype=float), 2)
    overhead, per_byte = np.polynomial.polynomial.polyfit(contexts * bytes_per_token, np.asarray(reload_s, float), 1)
    if per_byte <= 0:
        raise ValueError("the reloads do not grow with the document's bytes: no read rate to fit")
    return Fit(tuple(float(v) for v in prefill), float(overhead), float(1 / per_byte), bytes_per_token)


def table(locality: pd.DataFrame, bytes_per_token: int, tier: str) -> tuple[pd.DataFrame, Fit | str]:
    """Per context of Study B's locality table (``results/locality.csv``): the measured prefill (OFF,
    cold) and reload (ON, cross) medians, both fitted, and the break-even read rate; the fit's read
    rate, overhead and crossover context on every row. Where no fit can be made (fewer than
    MIN_CONTEXTS contexts, reloads that do not grow with the bytes) its columns are empty and the
    reason comes back in the fit's place."""
    cold = locality[locality["step"] == PREFILL_STEP].set_index("context")["off_ttft_median_s"]
    cross = locality[locality["step"] == RELOAD_STEP].set_index("context")["on_ttft_median_s"]
    return fitted(pd.DataFrame({"prefill_s": cold, "reload_s": cross}), bytes_per_token, tier)


def fitted(measured: pd.DataFrame, bytes_per_token: int, tier: str) -> tuple[pd.DataFrame, Fit | str]:
    """``measured`` (per context, its index: the prefill and reload medians, ``prefill_s`` and
    ``reload_s``) with both models fitted, as ``table`` returns it."""
    measured = measured[["prefill_s", "reload_s"]].dropna().sort_index()
    frame = measured.rename_axis("context").reset_index()
    frame.insert(0, "tier", tier)
    frame["speedup"] = frame["prefill_s"] / frame["reload_s"]
    frame["kv_bytes"] = frame["context"] * bytes_per_token
    try:
        result = fit(frame["context"], frame["prefill_s"], frame["reload_s"], bytes_per_token)
    except ValueError as exc:
        columns = ("prefill_fit_s", "reload_fit_s", "break_even_read_gbps", "fit_read_gbps", "fit_overhead_s",
                   "crossover_tokens")
        return frame.assign(**{name: np.nan for name in columns}), str(exc)
    tokens = frame["context"]
    return frame.assign(prefill_fit_s=result.prefill_s(tokens), reload_fit_s=result.reload_s(tokens),
                        break_even_read_gbps=result.break_even_rate(tokens) / 1e9,
                        fit_read_gbps=result.read_rate / 1e9, fit_overhead_s=result.overhead_s,
                        crossover_tokens=result.crossover_tokens()), result

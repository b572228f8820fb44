"""The statistics every table rests on: percentiles with their sample rules, bootstrap and Wilson intervals,
and what an interval of a change lets a table claim. The ground floor: it imports nothing of kvpool."""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import binomtest, bootstrap

PERCENTILES = (50, 95, 99)
# Fewest samples a percentile is reported from: below it the table gives the largest sample, labelled
# "max of n" (a p99 from 24 samples is the largest of them under another name).
MIN_SAMPLES = {50: 1, 95: 20, 99: 100}
# Fewest samples per arm a ratio's bootstrap interval is drawn from: with two or three a resampled median
# can only take a few values, and the interval it gives looks far tighter than it is.
MIN_RATIO_SAMPLES = 5
CONFIDENCE = 0.95


def reported_percentile(values, q: int, seed: int = 0) -> dict:
    """The q-th percentile of ``values`` as a table reports it: ``value``, ``basis`` (``p95``, or ``max of
    n`` below :data:`MIN_SAMPLES`), ``n`` and its bootstrap 95% interval (none for a maximum)."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    n = len(values)
    if not n:
        return {"value": np.nan, "basis": "no samples", "n": 0, "ci_low": np.nan, "ci_high": np.nan}
    if n < MIN_SAMPLES.get(q, 1):
        return {"value": float(values.max()), "basis": f"max of {n}", "n": n, "ci_low": np.nan, "ci_high": np.nan}
    low, high = percentile_ci(values, q, seed=seed)
    return {"value": float(np.percentile(values, q)), "basis": f"p{q}", "n": n, "ci_low": low, "ci_high": high}


def ratio_ci(numerator, denominator, q: int = 50, confidence: float = CONFIDENCE,
             seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the ratio of two samples' q-th percentiles (each resampled on its own); NaN
    with fewer than :data:`MIN_RATIO_SAMPLES` values on either side or a percentile below :data:`MIN_SAMPLES`."""
    a, b = (np.asarray(v, dtype=float) for v in (numerator, denominator))
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if min(len(a), len(b)) < max(MIN_RATIO_SAMPLES, MIN_SAMPLES.get(q, 1)):
        return np.nan, np.nan

    def statistic(x, y, axis):
        return np.percentile(x, q, axis=axis) / np.percentile(y, q, axis=axis)

    result = bootstrap((a, b), statistic, confidence_level=confidence, n_resamples=2000, method="percentile",
                       paired=False, random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def proportion_ci(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion (reload rate, SLO attainment); NaN with no trials."""
    if not n:
        return np.nan, np.nan
    interval = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(interval.low), float(interval.high)


def mean_ci(values, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of a mean; NaN with fewer than 2 values, the value itself when all are equal."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if len(values) < 2:
        return np.nan, np.nan
    if np.all(values == values[0]):
        return float(values[0]), float(values[0])
    result = bootstrap((values,), np.mean, confidence_level=confidence, n_resamples=2000, method="percentile",
                       random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def change_claim(low: float, high: float, tolerance_pct: float | None = None) -> str:
    """What an interval of a change in percent lets a table say: a direction where it excludes 0, "no
    difference shown" where it spans 0, "within X%" only where the whole interval lies inside ±X%."""
    if pd.isna(low) or pd.isna(high):
        return "no interval (too few samples)"
    if tolerance_pct is not None and -tolerance_pct <= low and high <= tolerance_pct:
        return f"within {tolerance_pct:g}%"
    if high < 0:
        return "lower"
    if low > 0:
        return "higher"
    return "no difference shown (the interval spans 0)"


def percentile_ci(values, q: float, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Bootstrap (percentile method) confidence interval of the q-th percentile; NaN with under 2 values."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if len(values) < 2 or np.all(values == values[0]):
        return (float(values[0]), float(values[0])) if len(values) else (np.nan, np.nan)
    result = bootstrap((values,), lambda x, axis: np.percentile(x, q, axis=axis), confidence_level=confidence,
                       n_resamples=2000, method="percentile", random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


# What a figure measured once per cell rests on: one window of the phase, no interval to draw.
ONE_WINDOW = "one window"

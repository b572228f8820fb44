"""The crossover: prefill and reload models fitted to chain medians, where the pool starts paying and
the read rate at which it stops."""

import math

import numpy as np
import pandas as pd
import pytest

from kvpool.report import crossover as crossover_report
from kvpool.studies import crossover

PER_TOKEN = 65536


def locality(contexts, prefill, reload):
    """Study B's locality table as results/locality.csv holds it (the two steps the fit reads)."""
    rows = [{"context": n, "step": "cold", "off_ttft_median_s": p, "on_ttft_median_s": p * 1.01} for n, p in
            zip(contexts, prefill, strict=True)]
    rows += [{"context": n, "step": "cross", "off_ttft_median_s": p, "on_ttft_median_s": r} for n, p, r in
             zip(contexts, prefill, reload, strict=True)]
    rows.append({"context": contexts[0], "step": "local-1", "off_ttft_median_s": 0.01, "on_ttft_median_s": 0.01})
    return pd.DataFrame(rows)


def test_known_models_are_recovered_with_their_crossover_and_break_even_rates():
    contexts = np.array([2048, 8192, 32768, 65536])
    prefill = 0.02 + 2e-5 * contexts + 5e-10 * contexts ** 2
    rate, overhead = 2e9, 0.3  # a slow drive: small documents are quicker to recompute
    reload = overhead + contexts * PER_TOKEN / rate
    frame, fit = crossover.table(locality(contexts, prefill, reload), PER_TOKEN, "disk")
    assert fit.read_rate == pytest.approx(rate) and fit.overhead_s == pytest.approx(overhead)
    assert np.allclose(fit.prefill, (0.02, 2e-5, 5e-10), rtol=1e-6, atol=1e-12)
    n = frame["crossover_tokens"].iloc[0]  # prefill(n) == reload(n) there, and the pool pays beyond it
    assert fit.prefill_s(n) == pytest.approx(fit.reload_s(n)) and 32768 < n < 65536
    assert fit.prefill_s(2 * n) > fit.reload_s(2 * n) and fit.prefill_s(n / 2) < fit.reload_s(n / 2)
    # at the break-even rate a reload takes exactly the prefill's time; a prefill shorter than the
    # reload's overhead (2,048 and 8,192 tokens here) has no such rate
    for tokens, gbps in zip(frame["context"], frame["break_even_read_gbps"], strict=True):
        if math.isnan(gbps):
            assert fit.prefill_s(tokens) <= overhead and tokens in (2048, 8192)
        else:
            assert overhead + tokens * PER_TOKEN / (gbps * 1e9) == pytest.approx(fit.prefill_s(tokens))
    assert frame["break_even_read_gbps"].dropna().is_monotonic_decreasing  # longer prompts pay on slower drives
    assert list(frame["speedup"]) == pytest.approx(list(prefill / reload))


def test_a_reload_faster_everywhere_crosses_at_zero_and_a_slow_one_only_far_out():
    contexts = np.array([1024, 4096, 16384])
    prefill = 0.05 + 1e-5 * contexts + 1e-10 * contexts ** 2
    _, fast = crossover.table(locality(contexts, prefill, 0.01 + contexts * PER_TOKEN / 50e9), PER_TOKEN, "ram")
    assert fast.crossover_tokens() == 0.0
    _, slow = crossover.table(locality(contexts, prefill, 1.0 + contexts * PER_TOKEN / 0.1e9), PER_TOKEN, "disk")
    # the prefill's quadratic term overtakes any linear reload, here far beyond what was measured
    assert slow.crossover_tokens() > 100 * contexts.max()
    assert math.isnan(slow.break_even_rate(10))  # a prefill shorter than the reload's overhead: no rate pays


def test_no_fit_says_why_and_keeps_the_measured_medians():
    two, reason = crossover.table(locality([512, 1024], [0.1, 0.2], [0.05, 0.06]), 4096, "ram")
    assert "at least 3 contexts" in reason and list(two["prefill_s"]) == [0.1, 0.2]
    assert two["crossover_tokens"].isna().all()
    flat, reason = crossover.table(locality([512, 1024, 2048], [0.08, 0.11, 0.27], [0.045, 0.026, 0.031]), 4096,
                                   "ram")
    assert "do not grow" in reason
    page = crossover_report.markdown(flat, reason)
    assert "No fit" in page and "2,048 tokens: 0.27 s / 0.031 s" in page


def test_the_h200_chains_put_the_break_even_near_1_25_gb_s_at_64k():
    """The H200 runs' prose figure (a reload from disk stops paying near 1.2-1.3 GB/s at 64K tokens),
    now computed from docs/results/h200-mp-studyb's chains."""
    from pathlib import Path

    measured = pd.read_csv(Path(__file__).resolve().parents[2] / "docs/results/h200-mp-studyb/results/locality.csv")
    frame, fit = crossover.table(measured, PER_TOKEN, "ram")
    at_64k = frame.set_index("context").loc[65536, "break_even_read_gbps"]
    assert 1.2 < at_64k < 1.3 and 15e9 < fit.read_rate < 30e9

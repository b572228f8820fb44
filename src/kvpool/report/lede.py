"""The page's first sentence, right under its title: what a reader takes away before anything else (the
shared against the isolated TTFT p50, their ratio with its interval and the follow-ups it rests on), the
scope it holds for (engine, model, hardware) and the run's gate. Every number is Table 1's, as measured."""

from __future__ import annotations

import pandas as pd

from kvpool.engine import shapes
from kvpool.engine.model import random_model_parameters
from kvpool.report.format import fmt_interval, fmt_value
from kvpool.stats import MIN_RATIO_SAMPLES
from kvpool.studies.tables import headline


def _count(n: float) -> str:
    """A large count in a few characters: 4.4M, 7.1B, 22K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return f"{n:.0f}"


def model_words(config: dict) -> str:
    """The served model as the sentence names it: a local or hub model by its name, the random model by
    its size."""
    model = config["engine"].get("model")
    if model:
        return f"model {str(model).rstrip('/').rsplit('/', 1)[-1]}"
    spec = config.get("random_model")
    if not spec:
        return "a random Llama"
    name = shapes.NAMES[spec.get("architecture", "llama")]
    return f"a {_count(random_model_parameters(spec))}-parameter random {name}"


def engine_words(config: dict, versions: dict) -> str:
    """The engine and LMCache with the versions the cells' manifests recorded (none: not named)."""
    kind = config["engine"]["kind"]
    version = versions.get(kind) or versions.get("vllm")
    lmcache = versions.get("lmcache")
    return (f"{kind} {version}" if version else kind) + (f" with LMCache {lmcache}" if lmcache else "")


def hardware_words(hardware: dict) -> str:
    """Where it ran, as the manifest's hardware says: its GPUs, or its CPU where there is none."""
    gpu = hardware.get("gpu") or {}
    devices = gpu.get("devices") or []
    if gpu.get("available") and devices:
        named = list(dict.fromkeys(devices))
        return ", ".join(f"{devices.count(d)} x {d}" if devices.count(d) > 1 else d for d in named)
    cpu = hardware.get("cpu") or "an unnamed CPU"
    cpus = hardware.get("usable_cpus")
    return f"{cpu} ({cpus} CPUs, no GPU)" if cpus else f"{cpu} (no GPU)"


def scope_words(config: dict, manifest: dict) -> str:
    """The scope a headline holds for: engine and versions, model, hardware (``manifest``: a cell's)."""
    return (f"{engine_words(config, manifest.get('versions', {}))}, {model_words(config)}, "
            f"on {hardware_words(manifest.get('hardware', {}))}")


def _plural(n: int, words: str) -> str:
    return f"{n} {words}" + ("s" if n != 1 else "")


def _gate_words(failed: list[str]) -> str:
    if not failed:
        return "gate: VALID"
    first = failed[0].strip()
    more = f"; {_plural(len(failed) - 1, 'more failure')} below" if len(failed) > 1 else ""
    return f"gate: INVALID ({first}{more})"


def _ratio(p50: pd.Series) -> str:
    """The ratio with its interval and the follow-ups it rests on; without an interval, why."""
    iso, sha = int(p50["isolated_n"]), int(p50["shared_n"])
    samples = f"n = {iso} per arm" if iso == sha else f"n = {iso} isolated, {sha} shared"
    if pd.isna(p50["ratio"]):
        return f"no ratio, {samples}"
    low, high = p50["ratio_ci_low"], p50["ratio_ci_high"]
    if pd.notna(low) and pd.notna(high):
        return f"{p50['ratio']:.2g}x [{low:.2g}, {high:.2g}] ({samples})"
    why = f" (fewer than {MIN_RATIO_SAMPLES} samples an arm)" if min(iso, sha) < MIN_RATIO_SAMPLES else ""
    return f"{p50['ratio']:.2g}x, no interval{why}, {samples}"


def first_sentence(table: pd.DataFrame, scope: str, failed: list[str]) -> str:
    """The page's first sentence from Table 1's long form (``table``: results/table1.csv), the run's
    ``scope`` (:func:`scope_words`) and its gate (``failed``: a line per failure, none when it passes).

    It leads with the first setting (backend, chunk, tier) whose two arms are both valid (Table 1's
    headline, :func:`kvpool.studies.tables.headline`) and says how many more follow; where no pair is
    valid it says so, with the gate's reason. The interval and the follow-ups are the measured ones: a
    ratio without an interval says why it has none."""
    head = headline(table)
    if head.empty:
        paired = table.dropna(subset=["isolated_valid", "shared_valid"]) if len(table) else table
        alone = table[(table["metric"] == "ttft_p50_s") & table["isolated_valid"].isna()
                      & table["shared_valid"].astype(str).eq("True")] if len(table) else table
        if len(paired) or alone.empty:
            what = ("No setting has both its isolated and its shared cell valid" if len(paired)
                    else "This run measured no setting in both arms")
            return f"{what}, so no ratio is given ({scope}); {_gate_words(failed)}."
        first = alone.iloc[0]
        shown = fmt_value(first["shared"], "s") + fmt_interval(first["shared_ci_low"], first["shared_ci_high"])
        return (f"Shared pool ({first['backend']}, chunk {first['chunk']}, tier {first['tier']}): TTFT p50 {shown} "
                f"(n = {int(first['shared_n'])}); no isolated arm was measured, so no ratio is given; {scope}; "
                f"{_gate_words(failed)}.")
    lead = head.iloc[0]
    rows = table[(table["backend"] == lead["backend"]) & (table["chunk"] == lead["chunk"])
                 & (table["tier"] == lead["tier"])]
    p50 = rows.set_index("metric").loc["ttft_p50_s"]
    more = f"; {_plural(len(head) - 1, 'more valid setting')} in the table below" if len(head) > 1 else ""
    return (f"Shared pool ({lead['backend']}, chunk {lead['chunk']}, tier {lead['tier']}): TTFT p50 "
            f"{fmt_value(p50['shared'], 's')} against {fmt_value(p50['isolated'], 's')} isolated, "
            f"{_ratio(p50)}{more}; {scope}; {_gate_words(failed)}.")

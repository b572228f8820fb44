"""The report's figures, drawn with plotnine from the report's tables and samples.

Invalid cells are drawn faded and labelled INVALID, never dropped.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from plotnine import (
    aes,
    annotate,
    element_blank,
    element_text,
    facet_grid,
    facet_wrap,
    geom_col,
    geom_errorbar,
    geom_hline,
    geom_line,
    geom_point,
    geom_text,
    ggplot,
    labs,
    position_dodge,
    scale_alpha_manual,
    scale_colour_manual,
    scale_fill_manual,
    stat_ecdf,
    theme,
    theme_bw,
)

from kvpool.cells import Arm
from kvpool.studies.studyb import CHAIN, OFF, ON

ARM_COLOURS = {Arm.SHARED: "#1b9e77", Arm.ISOLATED: "#d95f02"}
FAINT_INVALID = {"valid": 1.0, "INVALID": 0.35}


def short_cell(name: str) -> str:
    """A cell's name as a figure labels it: ``lmcache-fs/shared/c256/disk``."""
    return name.replace("backend~", "").replace("arm~", "").replace("chunk~", "c").replace("tier~", "")


def _label(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    frame["setting"] = frame["backend"] + " / chunk " + frame["chunk"].astype(str) + " / " + frame["tier"]
    frame["validity"] = frame["valid"].map({True: "valid", False: "INVALID"})
    frame["bar_label"] = frame.apply(lambda r: ("INVALID " if not r["valid"] else "") + f"{r['value']:.3g}", axis=1)
    return frame


def _bars(frame: pd.DataFrame, value: str, title: str, ylabel: str, low: str | None = None, high: str | None = None):
    data = _label(frame.assign(value=frame[value]))
    # The label sits on top of the interval's whisker, not through it.
    data["label_y"] = data[["value", high]].max(axis=1) if high else data["value"]
    plot = (ggplot(data, aes("arm", "value", fill="arm", alpha="validity"))
            + geom_col(width=0.6)
            + geom_text(aes(y="label_y", label="bar_label"), va="bottom", size=8)
            + facet_wrap("~setting")
            + scale_fill_manual(values=ARM_COLOURS)
            + scale_alpha_manual(values=FAINT_INVALID)
            + labs(title=title, x="", y=ylabel)
            + theme_bw() + theme(figure_size=(8, 4), plot_title=element_text(size=11)))
    if low and high:
        plot += geom_errorbar(aes(ymin=low, ymax=high), width=0.2, alpha=1)
    return plot


def ttft_p50(table: pd.DataFrame):
    return _bars(table, "ttft_p50_s", "Figure 1. Cross-replica TTFT, p50 (bars: bootstrap 95% CI)", "seconds",
                 "ttft_p50_ci_low_s", "ttft_p50_ci_high_s")


def ttft_p99(table: pd.DataFrame):
    """TTFT p99 per arm; where a cell has under 100 follow-ups the bar is its largest TTFT, labelled so."""
    plot = _bars(table, "ttft_p99_s", "Figure 2. Cross-replica TTFT, p99 (bars: bootstrap 95% CI; "
                 "\"max of n\": too few follow-ups for a p99)", "seconds", "ttft_p99_ci_low_s", "ttft_p99_ci_high_s")
    if "ttft_p99_basis" in table:
        basis = table["ttft_p99_basis"].fillna("p99")
        plot.data["bar_label"] = [label if b == "p99" else f"{b}: {label}"
                                  for label, b in zip(plot.data["bar_label"], basis, strict=True)]
    return plot


def wall_clock(table: pd.DataFrame):
    return _bars(table, "wall_clock_s", "Figure 3. Wall clock of the reuse phase", "seconds")


def power(table: pd.DataFrame):
    """Mean GPU power during reuse where measured; otherwise what was measured instead, labelled as such."""
    if table["mean_power_w"].notna().any():
        return _bars(table, "mean_power_w", "Figure 4. Mean GPU power during reuse (energy counter over the phase)",
                     "watts")
    return _bars(table, "replica_cpu_s_per_followup",
                 "Figure 4. No GPU here: replica CPU seconds per follow-up during reuse (not watts)",
                 "CPU seconds per follow-up")


def energy(table: pd.DataFrame):
    return _bars(table, "energy_per_followup_j", "Energy per follow-up during reuse (GPU energy counter)", "joules")


def ttft_ecdf(requests: pd.DataFrame):
    data = requests[requests["error"].fillna("") == ""].copy()
    data["setting"] = data["backend"] + " / chunk " + data["chunk"].astype(str) + " / " + data["tier"]
    data["series"] = data["arm"] + data["valid"].map({True: "", False: " (INVALID)"})
    return (ggplot(data, aes("ttft_s", color="series"))
            + stat_ecdf(size=1)
            + facet_wrap("~setting")
            + labs(title="TTFT distribution per arm (ECDF)", x="TTFT (s)", y="share of follow-ups", color="")
            + theme_bw() + theme(figure_size=(8, 4)))


def timeline(drive: pd.DataFrame, power_samples: pd.DataFrame, cells: pd.DataFrame):
    """Drive read rate, queue depth and replica CPU (or GPU power) through each cell's populate and reuse; a
    note saying so where none of them was sampled."""
    series = []
    if not drive.empty:
        per_tick = drive.groupby(["cell", "phase", "since_start_s"], as_index=False)[["r_mb_per_s", "aqu_sz"]].sum()
        series += [per_tick.assign(metric="drive read MB/s", value=per_tick["r_mb_per_s"]),
                   per_tick.assign(metric="queue depth (aqu-sz)", value=per_tick["aqu_sz"])]
    if not power_samples.empty:
        gpus = power_samples[power_samples["source"].str.startswith("gpu")]
        if not gpus.empty:
            watts = gpus.groupby(["cell", "phase", "since_start_s"], as_index=False)["power_w"].sum()
            series.append(watts.assign(metric="GPU power W", value=watts["power_w"]))
        replicas = power_samples[power_samples["source"].str.startswith("replica")].sort_values("since_start_s")
        if not replicas.empty:
            by_series = replicas.groupby(["cell", "phase", "source"])
            replicas = replicas.assign(cpu_pct=by_series["cpu_s"].diff() / by_series["since_start_s"].diff() * 100)
            cpu = replicas.groupby(["cell", "phase", "since_start_s"], as_index=False)["cpu_pct"].sum()
            series.append(cpu.assign(metric="replica CPU %", value=cpu["cpu_pct"]))
    if not series:  # an external fleet's replicas are no processes of ours, and without pool_dirs no drive is seen
        return placeholder_note("Timeline per cell and phase: nothing was sampled",
                                "no drive was watched and no replica's CPU or GPU power was read\n(an external "
                                "fleet: fleet.pool_dirs names the folders whose drive is watched)")
    data = pd.concat(series, ignore_index=True).dropna(subset=["value"])
    starts = {(c["cell"], phase): start for _, c in cells.iterrows() for phase, (start, _) in c["phases"].items()}
    data["since_phase_s"] = data["since_start_s"] - [starts[(c, p)]
                                                     for c, p in zip(data["cell"], data["phase"], strict=True)]
    labels = {c: short_cell(c).replace("/", "/\n", 2) for c in cells["cell"]}
    data["column"] = pd.Categorical(data["cell"].map(labels), categories=list(labels.values()))
    # a column per cell, its phases as colours; past 12 cells the columns narrow (plotnine refuses over 25 in)
    return (ggplot(data, aes("since_phase_s", "value", colour="phase"))
            + geom_line(size=0.4)
            + facet_grid("metric ~ column", scales="free")
            + labs(title="Timeline per cell and phase (the pool is dropped from the page cache between populate "
                         "and reuse)", x="seconds since the phase started", y="", colour="")
            + theme_bw() + theme(figure_size=(min(24, max(8, 2 * data["column"].nunique())), 6),
                                 strip_text=element_text(size=7), plot_title=element_text(size=10),
                                 legend_position="bottom"))


def reload_efficiency(tiers: pd.DataFrame):
    data = tiers.melt(id_vars=["backend", "chunk", "tier", "valid"],
                      value_vars=["drive_read_active_gb_per_s", "ceiling_read_gb_per_s"], var_name="what",
                      value_name="gb_per_s")
    data["what"] = data["what"].map({"drive_read_active_gb_per_s": "reload read rate (reuse)",
                                     "ceiling_read_gb_per_s": "measured sequential ceiling"})
    data["setting"] = data["backend"] + " / chunk " + data["chunk"].astype(str)
    return (ggplot(data.dropna(subset=["gb_per_s"]), aes("tier", "gb_per_s", fill="what"))
            + geom_col(position="dodge", width=0.7)
            + facet_wrap("~setting")
            + labs(title="Reload read rate against the tier's measured ceiling (shared arm)", x="tier", y="GB/s",
                   fill="")
            + theme_bw() + theme(figure_size=(8, 4)))


def by_chunk(table: pd.DataFrame):
    data = table.copy()
    data["series"] = data["arm"] + " / " + data["tier"]
    return (ggplot(data, aes("chunk", "ttft_p50_s", color="series"))
            + geom_line() + geom_point(aes(shape="valid"), size=3)
            + facet_wrap("~backend")
            + labs(title="TTFT p50 by LMCache chunk size", x="chunk size (tokens)", y="seconds", shape="valid")
            + theme_bw() + theme(figure_size=(8, 4)))


def save(plot, folder: Path, stem: str) -> dict:
    """Write ``stem``.png and ``stem``.svg; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"png": folder / f"{stem}.png", "svg": folder / f"{stem}.svg"}
    plot.save(paths["png"], dpi=110, verbose=False)
    plot.save(paths["svg"], verbose=False)
    return paths


def untitled(plot):
    """``plot`` without its title drawn: for a figure the page captions with that title (kept in its labels),
    so a reader meets it once."""
    return plot + theme(plot_title=element_blank())


def placeholder_note(title: str, text: str):
    """A figure that says why there is nothing to draw (keeps every referenced image real)."""
    return (ggplot() + annotate("text", x=0, y=0, label=text, size=11) + theme_bw()
            + theme(figure_size=(8, 2)) + labs(title=title, x="", y=""))


def _load_frame(load: pd.DataFrame) -> pd.DataFrame:
    data = load.copy()
    data["setting"] = data["backend"] + " / chunk " + data["chunk"].astype(str) + " / " + data["tier"]
    data["series"] = data["arm"] + data["valid"].astype(bool).map({True: "", False: " (INVALID)"})
    return data


def load_ttft(load: pd.DataFrame):
    """TTFT p50 (with its interval) and p99 against follow-ups in flight, per arm: where a reload path
    saturates, its curve bends up."""
    data = _load_frame(load[load["level_kind"] == "concurrency"])
    long = pd.concat([data.assign(stat="p50", value=data["ttft_p50_s"]),
                      data.assign(stat="p99", value=data["ttft_p99_s"])])
    return (ggplot(long, aes("level_value", "value", colour="arm", linetype="stat", group="series + stat"))
            + geom_line() + geom_point()
            + geom_errorbar(aes(ymin="ttft_p50_ci_low_s", ymax="ttft_p50_ci_high_s"),
                            data=data.assign(stat="p50", value=data["ttft_p50_s"]), width=0.1)
            + facet_wrap("~setting") + scale_colour_manual(values=ARM_COLOURS)
            + labs(title="TTFT against follow-ups in flight (closed loop)", x="follow-ups in flight",
                   y="seconds", linetype="")
            + theme_bw() + theme(figure_size=(8, 4), plot_title=element_text(size=11)))


def load_throughput(load: pd.DataFrame):
    """Latency against what the fleet delivered, every level of each arm: the latency-throughput curve."""
    data = _load_frame(load).sort_values("achieved_rps")
    return (ggplot(data, aes("achieved_rps", "ttft_p50_s", colour="arm", group="series"))
            + geom_line() + geom_point() + geom_text(aes(label="level"), va="bottom", size=7)
            + facet_wrap("~setting") + scale_colour_manual(values=ARM_COLOURS)
            + labs(title="TTFT p50 against achieved follow-ups per second (every level)",
                   x="follow-ups per second", y="seconds")
            + theme_bw() + theme(figure_size=(8, 4), plot_title=element_text(size=11)))


def load_goodput(load: pd.DataFrame):
    """Follow-ups meeting the TTFT SLO per second against the offered rate (open loop)."""
    data = _load_frame(load[load["level_kind"] == "rate"])
    return (ggplot(data, aes("level_value", "goodput_rps", colour="arm", group="series"))
            + geom_line() + geom_point() + facet_wrap("~setting") + scale_colour_manual(values=ARM_COLOURS)
            + labs(title="Goodput (TTFT within slo_s) against the offered rate (open loop)",
                   x="offered follow-ups per second", y="follow-ups per second within the SLO")
            + theme_bw() + theme(figure_size=(8, 4), plot_title=element_text(size=11)))


def load_reload_rate(load: pd.DataFrame, ceilings: pd.DataFrame):
    """The shared arm's reload rate against follow-ups in flight: the drive's read rate and the KV the
    replicas loaded (hit tokens x KV bytes per token, the only rate a memory pool shows), beside the
    tier's measured ceiling (dashed) where there is one: where the curves flatten below the line, the
    reload path, not the drive, saturates."""
    data = _load_frame(load[(load["level_kind"] == "concurrency") & (load["arm"] == Arm.SHARED)])
    long = pd.concat([data.assign(measure="drive read", gb_per_s=data["drive_read_gb_per_s"]),
                      data.assign(measure="KV loaded", gb_per_s=data.get("loaded_gb_per_s", float("nan")))])
    long = long[long["gb_per_s"].notna()]
    plot = (ggplot(long, aes("level_value", "gb_per_s", linetype="measure", group="series + measure"))
            + geom_line(colour=ARM_COLOURS[Arm.SHARED]) + geom_point(colour=ARM_COLOURS[Arm.SHARED])
            + facet_wrap("~setting")
            + labs(title="Reload rate against follow-ups in flight (dashed: the tier's measured ceiling)",
                   x="follow-ups in flight", y="GB/s during the level", linetype="")
            + theme_bw() + theme(figure_size=(8, 4), plot_title=element_text(size=11)))
    lines = _load_frame(ceilings.assign(arm=Arm.SHARED.value, valid=True)).dropna(subset=["ceiling_read_gb_per_s"])
    if len(lines):
        plot += geom_hline(aes(yintercept="ceiling_read_gb_per_s"), data=lines, linetype="dashed")
    return plot


STUDYB_COLOURS = {OFF: "#7570b3", ON: "#1b9e77"}


def locality(rows: pd.DataFrame):
    """Study B's Figure 3: TTFT against context per chain step, OFF and ON, every observation and the
    medians (log axes)."""
    from plotnine import scale_x_continuous, scale_x_log10, scale_y_log10

    chains = rows[(rows["kind"] == "chain") & rows["ttft_s"].notna()].copy()
    chains["step"] = pd.Categorical(chains["step"], [step for step, _ in CHAIN])
    medians = chains.groupby(["arm", "step", "context"], observed=True)["ttft_s"].median().reset_index()
    contexts = sorted(chains["context"].unique())
    # a log axis over one context has no decade to draw minor breaks in (mizani fails)
    x_axis = scale_x_log10(breaks=contexts) if len(contexts) > 1 else scale_x_continuous(breaks=contexts)
    return (ggplot(chains, aes("context", "ttft_s", colour="arm"))
            + geom_point(alpha=0.5, size=1.5)
            + geom_line(aes(group="arm"), data=medians)
            + facet_wrap("~step", nrow=1)
            + x_axis + scale_y_log10()
            + scale_colour_manual(values=STUDYB_COLOURS)
            + labs(title="Study B's locality chain: TTFT per step (points: observations, lines: medians)",
                   x="context (tokens)", y="TTFT (s)", colour="")
            + theme_bw() + theme(figure_size=(10, 3.6), plot_title=element_text(size=11),
                                 axis_text_x=element_text(rotation=45, size=7)))


def sessions(walls: pd.DataFrame):
    """Study B's Figure 4: each session's wall time OFF and ON, a line per session and ON/OFF block
    pair (``walls``: studyb.session_walls with its ``pair``)."""
    walls = walls.copy()
    walls["line"] = walls["placement"] + " " + walls["session"].astype(str) + " / pair " + walls["pair"].astype(str)
    return (ggplot(walls, aes("arm", "wall_s", colour="placement"))
            + geom_point(size=2)
            + geom_line(aes(group="line"), alpha=0.6)
            + facet_wrap("~placement")
            + labs(title="Study B's sessions: wall time per session, OFF and ON", x="", y="session wall time (s)",
                   colour="")
            + theme_bw() + theme(figure_size=(7, 3.6), plot_title=element_text(size=11)))


def crossover(frame, fit):
    """Prefill and reload TTFT against context: the measured medians (points) and the fitted models
    (lines) of kvpool.studies.crossover, log axes; ``fit`` is the fit, or why there is none."""
    import numpy as np
    from plotnine import scale_x_log10, scale_y_log10

    title = "Prefill (OFF, cold) against reload (ON, cross): measured medians and fitted models"
    if isinstance(fit, str):
        return placeholder_note(title, f"No fit: {fit}")
    points = pd.concat([frame.assign(path="prefill", ttft_s=frame["prefill_s"]),
                        frame.assign(path="reload", ttft_s=frame["reload_s"])])
    grid = np.geomspace(frame["context"].min() / 2, frame["context"].max() * 2, 60)
    lines = pd.concat([pd.DataFrame({"context": grid, "ttft_s": fit.prefill_s(grid), "path": "prefill"}),
                       pd.DataFrame({"context": grid, "ttft_s": fit.reload_s(grid), "path": "reload"})])
    colours = {"prefill": STUDYB_COLOURS[OFF], "reload": STUDYB_COLOURS[ON]}
    return (ggplot(points, aes("context", "ttft_s", colour="path"))
            + geom_point(size=2.5) + geom_line(data=lines[lines["ttft_s"] > 0])
            + scale_x_log10() + scale_y_log10() + scale_colour_manual(values=colours)
            + labs(title=title, x="context (tokens)", y="TTFT (s)", colour="")
            + theme_bw() + theme(figure_size=(8, 4), plot_title=element_text(size=11)))


CONTEXT_PATHS = {"prefill (cold)": "#d95f02", "pool (cross)": "#1b9e77", "own cache (local)": "#7570b3"}


def contexts(table, fits):
    """Cold, shared-pool and local-hit TTFT against the document's length, one panel per shared cell:
    the measured medians (points; hollow where the unit is invalid) and the fitted prefill and reload
    models (lines, kvpool.studies.contexts), log axes."""
    import numpy as np
    from plotnine import scale_shape_manual, scale_x_log10, scale_y_log10

    data = table.assign(setting=table["backend"] + " / chunk " + table["chunk"].astype(str) + " / " + table["tier"])
    points = pd.concat([data.assign(path=path, ttft_s=data[column]) for path, column in
                        zip(CONTEXT_PATHS, ("prefill_s", "reload_s", "local_s"), strict=True)])
    points["validity"] = points["valid"].map({True: "valid", False: "INVALID"})
    lines = []
    for name, fit in fits.items():
        if isinstance(fit, str):
            continue
        cell = data[data["cell"] == name]
        grid = np.geomspace(cell["context"].min() / 1.5, cell["context"].max() * 1.5, 60)
        setting = cell["setting"].iloc[0]
        prompt = grid + (cell["prompt_tokens"] - cell["context"]).median()  # the fits' axis: document and question
        lines += [pd.DataFrame({"context": grid, "ttft_s": fit.prefill_s(prompt), "path": "prefill (cold)",
                                "setting": setting}),
                  pd.DataFrame({"context": grid, "ttft_s": fit.reload_s(prompt), "path": "pool (cross)",
                                "setting": setting})]
    plot = (ggplot(points, aes("context", "ttft_s", colour="path"))
            + geom_point(aes(shape="validity"), size=2.5)
            + scale_x_log10() + scale_y_log10() + scale_colour_manual(values=CONTEXT_PATHS)
            + scale_shape_manual(values={"valid": "o", "INVALID": "x"}) + facet_wrap("~setting")
            + labs(title="TTFT against document length: prefill, the pool and the replica's own cache",
                   x="document (tokens)", y="TTFT (s)", colour="", shape="")
            + theme_bw() + theme(figure_size=(8, 4), plot_title=element_text(size=11)))
    if lines:
        fitted = pd.concat(lines)
        plot += geom_line(data=fitted[fitted["ttft_s"] > 0])
    return plot


def capacity(table):
    """Pool capacity (kvpool.studies.capacity): the window's pool hit rate (Wilson 95% interval), TTFT mean
    (the operator's number reads it) and p50 (bootstrap 95% intervals) against the pool's size as a
    fraction of the working set, per shared cell;
    hollow where the unit is invalid."""
    from plotnine import scale_shape_manual

    data = table.assign(setting=table["backend"] + " / chunk " + table["chunk"].astype(str) + " / " + table["tier"],
                        validity=table["valid"].map({True: "valid", False: "INVALID"}))
    panels = pd.concat([
        data.assign(measure="follow-ups served from the pool", value=data["hit_rate"], low=data["hit_rate_low"],
                    high=data["hit_rate_high"]),
        data.assign(measure="TTFT mean (s)", value=data["ttft_mean_s"], low=data["ttft_mean_ci_low_s"],
                    high=data["ttft_mean_ci_high_s"]),
        data.assign(measure="TTFT p50 (s)", value=data["ttft_p50_s"], low=data["ttft_p50_ci_low_s"],
                    high=data["ttft_p50_ci_high_s"])])
    panels["measure"] = pd.Categorical(panels["measure"], ["follow-ups served from the pool", "TTFT mean (s)",
                                                           "TTFT p50 (s)"])
    return (ggplot(panels, aes("fraction", "value", colour="setting"))
            + geom_line() + geom_point(aes(shape="validity"), size=2.5)
            + geom_errorbar(aes(ymin="low", ymax="high"), width=0.02)
            + scale_shape_manual(values={"valid": "o", "INVALID": "x"})
            + facet_wrap("~measure", scales="free_y")
            + labs(title="A pool smaller than the working set: hit rate and TTFT against its capacity",
                   x="pool capacity (fraction of the working set's KV bytes)", y="", colour="", shape="")
            + theme_bw() + theme(figure_size=(10, 3.6), plot_title=element_text(size=11)))


ROUTER_PHASES = ["follow-up", "hot", "after-loss"]
SOURCE_COLOURS = {"own cache": "#7570b3", "pool": "#1b9e77", "computed": "#d95f02"}


def _router_frame(table: pd.DataFrame, split: bool = False) -> pd.DataFrame:
    """The routers table's phases drawn; with ``split``, a phase whose requests moved and stayed is drawn
    as its two groups (two populations), each router labelled with its group."""
    data = table[table["phase"].isin(ROUTER_PHASES)].copy()
    if "group" in data:
        keys = ["cell", "router", "phase"]
        parts = data[data["group"] != "all"]
        has_parts = data.set_index(keys).index.isin(parts.set_index(keys).index)
        data = (pd.concat([data[(data["group"] == "all") & ~has_parts], parts]) if split
                else data[data["group"] == "all"]).copy()
        data["router"] = data["router"] + data["group"].map(lambda g: "" if g == "all" else f" ({g})")
    data["setting"] = data["backend"] + " / chunk " + data["chunk"].astype(str) + " / " + data["tier"]
    data["phase"] = pd.Categorical(data["phase"], ROUTER_PHASES)
    data["validity"] = data["valid"].map({True: "valid", False: "INVALID"})
    return data


def router_ttft(table: pd.DataFrame):
    """TTFT p50 (bars, with its interval) and p99 (points) per router and arm, one panel per phase: where
    a router alone keeps requests on the replica that holds their document, and where only the pool helps;
    requests that moved to a replica new to their document and those that stayed are drawn apart."""
    data = _router_frame(table, split=True)
    return (ggplot(data, aes("router", "ttft_p50_s", fill="arm", alpha="validity"))
            + geom_col(position="dodge", width=0.7)
            + geom_errorbar(aes(ymin="ttft_p50_ci_low_s", ymax="ttft_p50_ci_high_s"), position="dodge", width=0.7)
            + geom_point(aes(y="ttft_p99_s", colour="arm"), position=position_dodge(width=0.7), shape="^")
            + facet_grid("setting ~ phase") + scale_fill_manual(values=ARM_COLOURS)
            + scale_colour_manual(values=ARM_COLOURS) + scale_alpha_manual(values=FAINT_INVALID)
            + labs(title="TTFT p50 (bars) and p99 (triangles) per router", x="", y="seconds")
            + theme_bw() + theme(figure_size=(10, 4), plot_title=element_text(size=11),
                                 axis_text_x=element_text(rotation=30, ha="right")))


def router_sources(table: pd.DataFrame):
    """Where each router's prompt tokens came from: the serving replica's own cache, the pool, or computed."""
    data = _router_frame(table)
    long = pd.concat([data.assign(source=name, fraction=data[column]) for name, column in
                      (("own cache", "local_cache_fraction"), ("pool", "pool_fraction"),
                       ("computed", "computed_fraction"))])
    long["source"] = pd.Categorical(long["source"], list(SOURCE_COLOURS))
    return (ggplot(long, aes("router", "fraction", fill="source", alpha="validity"))
            + geom_col(width=0.7) + facet_grid("setting + arm ~ phase")
            + scale_fill_manual(values=SOURCE_COLOURS) + scale_alpha_manual(values=FAINT_INVALID)
            + labs(title="Where the prompt tokens came from, per router", x="", y="fraction of prompt tokens")
            + theme_bw() + theme(figure_size=(10, 5), plot_title=element_text(size=11),
                                 axis_text_x=element_text(rotation=30, ha="right")))


# results/routers/<stem>.png: how each is drawn, and its title on the report page
ROUTER_FIGURES = {"ttft": (router_ttft, "TTFT per router and arm, by phase"),
                  "sources": (router_sources, "Where each router's prompt tokens came from")}

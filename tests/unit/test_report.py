"""The report builds from a recorded results tree alone (no servers) and flags what is invalid."""

import base64
import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest
from support import REPO

from kvpool.cells import Cell
from kvpool.report.breakdown import run_breakdown
from kvpool.report.figures import placeholder_note, save
from kvpool.report.page import build_report
from kvpool.report.tables import run_table1, run_tier_compare
from kvpool.report.trace import run_trace_table

TREE = Path(__file__).parents[1] / "fixtures" / "results-tree"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CELLS = [Cell("lmcache-fs", "shared", 256, "disk"), Cell("lmcache-fs", "isolated", 256, "disk"),
         Cell("lmcache-local-disk", "shared", 256, "disk")]
INVALID = "backend~lmcache-local-disk/arm~shared/chunk~256/tier~disk"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    shutil.copytree(TREE / "results", root / "results")
    return build(root)


def build(root: Path) -> Path:
    """Study A's tables, the breakdown and the page of the tree under ``root``, as their rules make them."""
    cell = TREE / "results" / "cells" / CELLS[0].name
    config = json.loads((cell / "manifest.json").read_text())["config"]
    config["backends"] = ["lmcache-fs", "lmcache-local-disk"]
    results = root / "results"
    folders = [results / "cells" / cell.name for cell in CELLS]
    # the tables first, as their rules make them; the report only reads them
    run_table1(config, CELLS, [f / "reuse.csv" for f in folders], [f / "reuse.json" for f in folders],
                [f / "validity.json" for f in folders], [f / "telemetry" / "summary.json" for f in folders],
                [f / "manifest.json" for f in folders], cells_csv=results / "cell_table.csv",
                csv_out=results / "table1.csv", md_out=results / "table1.md")
    shared = [(cell, f) for cell, f in zip(CELLS, folders, strict=True) if cell.arm == "shared"]
    run_tier_compare(config, [c for c, _ in shared], [f / "telemetry" / "summary.json" for _, f in shared],
                     [f / "reuse.csv" for _, f in shared], [f / "telemetry" / "drive.csv" for _, f in shared],
                     [str(results / "tiers" / "disk" / "ceiling.json")], tiers_csv=results / "tier_table.csv",
                     csv_out=results / "tier_compare.csv", md_out=results / "tier_compare.md")
    files = {name: [f / path for f in folders] for name, path in (
        ("validity", "validity.json"), ("reuse", "reuse.csv"), ("reuse_meta", "reuse.json"),
        ("populate_meta", "populate.json"), ("manifest", "manifest.json"), ("telemetry", "telemetry/summary.json"),
        ("drive", "telemetry/drive.csv"), ("power", "telemetry/power.csv"))}
    # the breakdown as its rule makes it: these records are from before kvpool read a request's times
    run_breakdown(config, [{"cell": c.name, "source": "reuse"} for c in CELLS], [f / "reuse.csv" for f in folders],
                  csv_out=results / "breakdown.csv", md_out=results / "breakdown.md",
                  figure_dir=str(results / "figures"))
    # a length sweep's table (the committed CPU one) and its figure where its rule leaves it
    shutil.copy(REPO / "docs" / "results" / "cpu-contexts" / "results" / "contexts.csv", results / "contexts.csv")
    save(placeholder_note("TTFT against document length", "drawn by the contexts rule"), results / "contexts",
         "contexts")
    # a trace replay's table and figures (the committed CPU one), as its rule makes them
    traced = [(Cell("lmcache-fs", arm, 256, "disk"), router) for arm in ("shared", "off")
              for router in ("round-robin", "prefix-affinity")]
    units = [REPO / "docs" / "results" / "cpu-trace" / "results" / "cells" / c.name / f"trace~{r}" for c, r in traced]
    run_trace_table(traced, csvs=[str(u / "requests.csv") for u in units], metas=[str(u / "run.json") for u in units],
                    slo_s=5.0, csv_out=str(results / "trace.csv"), md_out=str(results / "trace.md"),
                    figures_dir=str(results / "trace"))
    build_report(config, CELLS, files, [results / "tiers" / "disk" / "ceiling.json"],
                 cell_table=results / "cell_table.csv", table1_csv=results / "table1.csv",
                 tier_table=results / "tier_table.csv",
                 kv_bytes=None, out_html=results / "report.html", figures_dir=results / "report" / "figures",
                 tables_dir=results / "report" / "tables", breakdown=str(results / "breakdown.csv"),
                 contexts=str(results / "contexts.csv"), trace_csv=str(results / "trace.csv"))
    return results


def test_a_run_that_sampled_no_drive_and_no_replica_builds_its_page_and_says_so(tmp_path):
    """An external fleet without fleet.pool_dirs: kvpool watches no drive (it sees no pool folder) and samples
    no replica (no process of its own), so its cells' telemetry is empty. The page still builds, and its
    timeline says why it draws nothing."""
    shutil.copytree(TREE / "results", tmp_path / "results")
    for folder in (tmp_path / "results" / "cells").glob("backend~*/arm~*/chunk~*/tier~*"):
        telemetry = folder / "telemetry"
        (telemetry / "drive.csv").write_text("\n")  # as run_telemetry writes no sample at all
        power = pd.read_csv(telemetry / "power.csv")
        power[power["source"] == "host"].to_csv(telemetry / "power.csv", index=False)
        summary = json.loads((telemetry / "summary.json").read_text())
        for window in summary.values():
            window.update(devices=[], disks=[], drive={"available": False})
            window["power"]["replicas"] = {}
        (telemetry / "summary.json").write_text(json.dumps(summary))
    results = build(tmp_path)
    html = (results / "report.html").read_text()
    assert "Timeline per cell and phase: nothing was sampled" in html
    assert (results / "report" / "figures" / "timeline.png").read_bytes()[:8] == PNG_MAGIC


def test_page_has_every_table_and_figure(built):
    html = (built / "report.html").read_text()
    for heading in ("Run summary", "Table 1", "Table 2", "Figure 1.", "Figure 2.", "Figure 3.", "Figure 4.",
                    "ECDF", "Timeline per cell and phase", "Energy per follow-up", "measured ceiling", "Caveats",
                    "Where a follow-up's TTFT goes", "Document length: where the pool starts paying",
                    "A production trace replayed", "| lmcache-fs / off / chunk 256 / disk | prefix-affinity | valid |"):
        assert heading in html, heading
    assert "No request carried its replica's own times" in html  # said, not an empty table
    assert "replica CPU seconds per follow-up" in html  # no GPU in the fixture: labelled, not called watts


def test_every_image_the_page_references_is_a_real_png(built):
    html = (built / "report.html").read_text()
    sources = re.findall(r'<img src="([^"]+)"', html)
    assert len(sources) >= 8
    for src in sources:
        assert src.startswith("data:image/png;base64,")  # embedded: the page opens offline on its own
        assert base64.b64decode(src.split(",", 1)[1])[:8] == PNG_MAGIC
    assert not re.findall(r'href="(?!#)', html)  # no link that could break offline


def test_figure_files_are_valid_png_and_svg(built):
    figures = built / "report" / "figures"
    for stem in ("fig1_ttft_p50", "fig2_ttft_p99", "fig3_wall_clock", "fig4_power", "ttft_ecdf", "timeline",
                 "energy_per_followup", "reload_efficiency"):
        assert (figures / f"{stem}.png").read_bytes()[:8] == PNG_MAGIC
        assert ET.parse(figures / f"{stem}.svg").getroot().tag.endswith("svg")


def test_invalid_cell_is_flagged_and_kept_out_of_aggregates(built):
    html = (built / "report.html").read_text()
    assert INVALID in html and "INVALID" in html
    table1 = pd.read_csv(built / "report" / "tables" / "table1.csv")
    assert len(table1) == 3 and not table1.set_index("backend").loc["lmcache-local-disk", "valid"]
    headline = pd.read_csv(built / "report" / "tables" / "headline.csv")
    assert list(headline["backend"]) == ["lmcache-fs"]
    assert headline["ttft_p50_s_ratio"].iloc[0] > 1


def test_tables_carry_bootstrap_intervals(built):
    table1 = pd.read_csv(built / "report" / "tables" / "table1.csv")
    assert (table1["ttft_p50_ci_low_s"] <= table1["ttft_p50_s"] + 1e-12).all()
    assert (table1["ttft_p50_s"] <= table1["ttft_p50_ci_high_s"] + 1e-12).all()
    # the fixture's cells have 4 follow-ups each: too few for a p95 or a p99, so those are the largest one, no
    # interval, named so
    for q in (95, 99):
        assert (table1[f"ttft_p{q}_basis"] == "max of 4").all() and table1[f"ttft_p{q}_ci_low_s"].isna().all()
    table2 = pd.read_csv(built / "report" / "tables" / "table2.csv")
    assert {"r_await_p95_ms_ci_low", "ttft_p50_s_ci_high", "reload_efficiency"} <= set(table2.columns)
    assert (built / "report" / "tables" / "table1.md").read_text().startswith("|")


def test_bar_labels_sit_on_top_of_the_interval(built):
    from kvpool.report.figures import ttft_p50

    table1 = pd.read_csv(built / "report" / "tables" / "table1.csv")
    data = ttft_p50(table1).data
    assert (data["label_y"] >= data["ttft_p50_ci_high_s"]).all() and (data["label_y"] >= data["ttft_p50_s"]).all()
    assert (data["label_y"] > data["ttft_p50_s"]).any()  # the fixture's intervals reach above their bars


def test_the_headline_reads_as_ratios_with_two_digits(built):
    from kvpool.report.reading import headline_for_reading

    head = pd.read_csv(built / "report" / "tables" / "headline.csv")
    shown = headline_for_reading(head)
    assert list(shown.columns) == ["setting", "TTFT p50", "follow-ups (isolated / shared)", "TTFT p99", "wall clock"]
    ratio, low, high = head.loc[0, ["ttft_p50_s_ratio", "ttft_p50_s_ratio_ci_low", "ttft_p50_s_ratio_ci_high"]]
    # four follow-ups an arm are too few for the ratio's own interval (five or more): the ratio stands alone,
    # with the follow-ups it rests on beside it
    assert pd.isna(low) and pd.isna(high)
    assert shown["TTFT p50"].iloc[0] == f"{ratio:.2g}x" and len(shown["TTFT p50"].iloc[0]) <= 5
    assert shown["follow-ups (isolated / shared)"].iloc[0] == "4 / 4"
    assert shown["TTFT p99"].iloc[0].endswith("(max of 4 / max of 4)")
    html = (built / "report.html").read_text()
    assert f"{ratio:.2g}x" in html and "ttft_p50_s_ratio" not in html


def test_kv_bytes_read_as_chunks_equal_of_keys():
    from kvpool.report.reading import kv_bytes_for_reading

    table = pd.DataFrame([
        {"backend": "lmcache-fs", "chunk": 256, "tier": "disk", "comparison": "store_across_arms", "keys": 184,
         "equal": 184, "differ": 0, "bit_exact_expected": True, "example_key": "", "meaning": "m"},
        {"backend": "lmcache-fs", "chunk": 256, "tier": "disk", "comparison": "recompute_against_store",
         "keys": 184, "equal": 176, "differ": 8, "bit_exact_expected": False, "example_key": "k@1", "meaning": "m"}])
    shown = kv_bytes_for_reading(table)
    assert list(shown["chunks equal"]) == ["184 of 184", "176 of 184"]
    assert list(shown["must agree bit for bit"]) == ["yes", "no"]
    assert list(shown["example of a differing chunk"]) == ["", "k@1"]


def test_the_timeline_draws_a_full_study_a_matrix(tmp_path):
    """Study A's matrix (3 chunk sizes x 2 tiers x 2 arms) and twice that: one column per cell, the figure at
    most 24 inches wide (plotnine refuses anything over 25: six cells' phases as columns once did)."""
    from kvpool.report import figures

    for backends in (["lmcache-fs"], ["lmcache-fs", "lmcache-mp"]):
        names = [Cell(backend, arm, chunk, tier).name for backend in backends for arm in ("isolated", "shared")
                 for chunk in (256, 1024, 2048) for tier in ("tlc", "qlc")]
        phases = {"populate": (0.0, 10.0), "reuse": (20.0, 30.0)}
        cells = pd.DataFrame({"cell": names, "phases": [phases] * len(names)})
        ticks = [(cell, phase, start + second) for cell in names for phase, (start, _) in phases.items()
                 for second in range(10)]
        drive = pd.DataFrame(ticks, columns=["cell", "phase", "since_start_s"]).assign(r_mb_per_s=500.0, aqu_sz=2.0)
        power = pd.DataFrame(ticks, columns=["cell", "phase", "since_start_s"]).assign(source="gpu0", power_w=300.0)
        plot = figures.timeline(drive, power, cells)
        assert plot.data["column"].nunique() == len(names) and set(plot.data["phase"]) == set(phases)
        # the cells' own order (chunk 256 before 1,024), not the labels' alphabetical one
        assert [label.replace("/\n", "/") for label in plot.data["column"].cat.categories] == [
            name.replace("backend~", "").replace("arm~", "").replace("chunk~", "c").replace("tier~", "")
            for name in names]
    # drawn once, at the widest (drawing is most of this test's time): 24 columns
    png = figures.save(plot, tmp_path, "timeline")["png"].read_bytes()
    width_px = int.from_bytes(png[16:20], "big")
    assert png[:8] == PNG_MAGIC and 8 * 110 <= width_px <= 24 * 110 + 1


def test_the_page_opens_on_the_verdict_and_the_headline_figure_then_the_details(built):
    html = (built / "report.html").read_text()
    verdict = re.search(r'<p class="verdict invalid"><b><span class="flag">INVALID</span></b>: ([^<]*)</p>', html)
    assert verdict and verdict.group(1).startswith(
        f"2 of 3 cells valid; 10 length units judged; 4 trace units judged. Failed: {INVALID}: ")
    order = [html.index(marker) for marker in ('class="verdict', "Figure 1. Cross-replica TTFT, p50",
                                               "Isolated / shared", 'id="summary"', 'id="table1"', 'id="figures"')]
    assert order == sorted(order)
    assert html.count("Figure 1. Cross-replica TTFT, p50") == 2  # its alt text and caption, once: not again below


def test_study_b_and_the_other_sections_read_like_table_1():
    from kvpool.report import reading as report

    locality = pd.DataFrame([{"context": 1024, "step": "cross", "off_ttft_median_s": 0.41, "on_ttft_median_s": 0.052,
                              "on_local_hit_tokens": 0.0, "on_external_hit_tokens": 1024.0,
                              "mean_paired_change_pct": -87.3, "change_ci_low_pct": -90.1, "change_ci_high_pct": -84.0,
                              "pairs_matched": 4, "outputs_equal": 3}])
    row = report.locality_for_reading(locality).iloc[0]
    # the change as Study B's own page shows it: the mean, then the interval with what it lets the page say
    assert row["TTFT OFF (median)"] == "0.41 s" and row["ON against OFF (mean paired)"] == "-87.3%"
    assert row["95% CI"] == "[-90.1, -84]: lower"
    assert row["answers equal"] == "3 of 4" and row["ON tokens: own cache / pool"] == "0 / 1024"
    locality[["change_ci_low_pct", "change_ci_high_pct"]] = float("nan")  # two block pairs: no interval
    assert report.locality_for_reading(locality).iloc[0]["95% CI"] == "no interval (too few samples)"
    crossover = pd.DataFrame([{"context": c, "prefill_s": p, "reload_s": 0.05, "speedup": p / 0.05,
                               "prefill_fit_s": p, "reload_fit_s": 0.05, "break_even_read_gbps": 0.2,
                               "fit_read_gbps": 1.5, "fit_overhead_s": 0.04, "crossover_tokens": 700.0}
                              for c, p in ((1024, 0.24), (2048, 0.6))])
    shown, fit = report.crossover_for_reading(crossover)
    assert list(shown["speedup"]) == ["4.8x", "12x"]
    assert fit == "Reload fit: 0.04 s + bytes / 1.5 GB/s; the reload beats the prefill from 700 tokens."
    servers = pd.DataFrame([{"cell": CELLS[0].name, "phase": "reuse", "server": 0, "pending_l2_stores": 0.0,
                             "l1_read_total": 12.0, "redis_pool_chunks": float("nan")}])
    row = report.pool_servers_for_reading(servers).iloc[0]
    assert row["counters over the phase"] == "pending_l2_stores 0, l1_read_total 12"
    assert row["cell"] == "lmcache-fs / shared / chunk 256 / disk"
    # no raw column name reaches the page
    for frame in (report.locality_for_reading(locality), shown, report.pool_servers_for_reading(servers)):
        assert not [c for c in frame.columns if "_" in c], frame.columns


def test_the_page_verdict_is_the_gates_so_an_invalid_load_level_is_not_called_valid(tmp_path):
    """Every cell valid, one load level beyond c1 invalid: the gate fails the run, and so does the page's
    first line, from the same judgement (kvpool.report.gate.judge)."""
    from kvpool.report.gate import judge
    from kvpool.report.page import verdict

    cells = pd.DataFrame([{"cell": CELLS[0].name, "valid": True, "reasons": ""}])
    load_csv = tmp_path / "load.csv"
    pd.DataFrame([{"cell": CELLS[0].name, "level": level, "valid": level == "c1", "outputs_checked": "passed"}
                  for level in ("c1", "c2")]).to_csv(load_csv, index=False)
    failed, counted, *_ = judge(cells, None, str(load_csv))
    shown = verdict(cells, failed, counted)
    assert not shown["valid"] and shown["word"] == "INVALID"
    assert shown["text"] == (f"1 of 1 cells valid; 1 load levels (0 with answers not verified) judged. Failed: "
                             f"{CELLS[0].name} load~c2: its level.json names the failed checks")
    assert verdict(cells, *judge(cells, None)[:2])["valid"]


def test_the_page_reads_the_files_its_rule_declares_and_refuses_a_list_short_of_a_cell(tmp_path):
    from kvpool.report.page import CELL_FILES, collect

    files = {name: [str(tmp_path / f"{name}-{i}") for i in range(len(CELLS))] for name in CELL_FILES}
    files["telemetry"] = files["telemetry"][:-1]
    with pytest.raises(ValueError, match=rf"one telemetry file per cell \({len(CELLS)} cells\)"):
        collect(CELLS, files, [], {})


def test_the_page_opens_on_one_sentence_with_the_headline_its_scope_and_the_gate(built):
    """Under the title, before the verdict: the fixture's valid pair (4 follow-ups an arm: a ratio with no
    interval, said so), the engine, model and machine of its manifests, and the gate that failed."""
    html = (built / "report.html").read_text()
    lede = re.search(r'</h1>\n<p class="lede">([^<]*)</p>\n<p class="verdict', html)
    assert lede, html[:2000]
    sentence = lede.group(1)
    assert sentence.startswith("Shared pool (lmcache-fs, chunk 256, tier disk): TTFT p50 ")
    assert "x, no interval (fewer than 5 samples an arm), n = 4 per arm; " in sentence
    assert "-parameter random Llama, on " in sentence and f"gate: INVALID ({INVALID}: " in sentence


def test_percentiles_that_are_only_maxima_are_folded_away_on_the_page(built):
    """4 follow-ups an arm: the headline's p99 and Table 1's p95 and p99 are the largest of 4 in every row, so
    they sit collapsed under their tables, named so, not in the columns a reader compares."""
    html = (built / "report.html").read_text()
    head = html[html.index("<h3>Isolated / shared"):html.index('id="summary"')]
    assert "<th>TTFT p50</th>" in head and "<details><summary>TTFT p99: max of 4 each" in head
    assert head.index("<th>TTFT p99</th>") > head.index("<details>")
    table1 = html[html.index('id="table1"'):html.index('id="table2"')]
    assert "<details><summary>TTFT p95, p99: max of 4 each" in table1
    assert table1.index("<th>TTFT p95</th>") > table1.index("<details>")


def test_a_figure_the_page_captions_is_drawn_without_its_title(built):
    """The report's own figures carry their title once, in the caption (the plot keeps it as a label);
    figures another rule draws keep it in the plot, and the page gives them no caption."""
    from kvpool.report.figures import ttft_p50, untitled

    plot = ttft_p50(pd.read_csv(built / "report" / "tables" / "table1.csv"))
    drawn = untitled(plot)
    assert drawn.theme.themeables["plot_title"].is_blank() and not plot.theme.themeables["plot_title"].is_blank()
    assert drawn.labels.get("title", None) == plot.labels.get("title", None)
    html = (built / "report.html").read_text()
    assert html.count("<figcaption>") == len(re.findall(r'<img src="data:image/png;base64,[^"]*" alt="(?:Figure|TTFT|'
                                                        r'Timeline|Energy|Reload)', html))
    section = html[html.index('id="breakdown"'):html.index('id="figures"')]
    assert "<img" in section and "<figcaption>" not in section

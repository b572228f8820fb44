rule report:
    """The page (results/report.html), its figures as PNG and SVG, and its tables as CSV and Markdown."""
    input:
        validity=cell_files("validity.json"),
        reuse=cell_files("reuse.csv"),
        reuse_meta=cell_files("reuse.json"),
        populate_meta=cell_files("populate.json"),  # an lmcache-mp cell's server counters
        manifest=cell_files("manifest.json"),
        telemetry=cell_files("telemetry/summary.json"),
        drive=cell_files("telemetry/drive.csv"),
        power=cell_files("telemetry/power.csv"),
        ceilings=expand("results/tiers/{tier}/ceiling.json", tier=CEILING_TIERS),
        kv_bytes="results/kv_bytes.csv",
        load="results/load.csv",
        cell_table="results/cell_table.csv",
        table1="results/table1.csv",
        tier_table=TIER_TABLE,
        # vllm bench serve's replay beside kvpool's client, when cells were replayed
        peer=PEER_TARGETS.get("csv", []),
        # the routers compared, when the run has router units (the figures beside the table)
        routers=ROUTER_TARGETS.get("csv", []),
        # document length as a dimension, when the run has length units (the figure beside the table)
        contexts=CONTEXT_TARGETS.get("csv", []),
        # pool capacity as a dimension, when the run has capacity units (the figure beside the table)
        capacity=CAPACITY_TARGETS.get("csv", []),
        # a production trace replayed, when the run has trace units (the figures beside the table)
        trace=TRACE_TARGETS.get("csv", []),
        # where each follow-up's TTFT goes, and its figure (read from beside the table: an input, so a tree
        # that lacks the figure has it drawn again)
        breakdown="results/breakdown.csv" if CELLS else [],
        breakdown_figure="results/figures/breakdown.png" if CELLS else [],
        # Study B's section, when the run has one
        studyb=list(STUDYB_REPORT.values()),
    output:
        html="results/report.html",
        figures=report(
            directory("results/report/figures"),
            patterns=["{name}.png"],
            caption="../report/figures.rst",
            category="Figures",
        ),
        tables=directory("results/report/tables"),
    log:
        "logs/report/report.log",
    conda:
        CONDA_ENV
    params:
        cells=cell_names(),
        # the page states the run's settings and caveats: every key of the resolved config
        config=config,
        studyb=STUDYB_REPORT,
    script:
        "../scripts/build_report.py"

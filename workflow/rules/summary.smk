rule table1:
    """Every cell's figures with their intervals (cell_table.csv), and Study A's Table 1 (isolated
    against shared) drawn from them, as CSV and Markdown; the Markdown sets Study A's published figures
    beside them, with both setups (the cells' manifests give this run's hardware and versions)."""
    input:
        reuse=cell_files("reuse.csv"),
        reuse_meta=cell_files("reuse.json"),
        validity=cell_files("validity.json"),
        telemetry=cell_files("telemetry/summary.json"),
        manifest=cell_files("manifest.json"),
    output:
        cells="results/cell_table.csv",
        csv="results/table1.csv",
        md="results/table1.md",
    log:
        "logs/summary/table1.log",
    conda:
        CONDA_ENV
    params:
        cells=cell_names(),
        settings=settings(tables.run_table1),
    script:
        "../scripts/table1.py"


rule tier_compare:
    """Each compared (shared) cell's drive figures with their intervals (tier_table.csv), and Study A's Table 2
    drawn from them: one column per tier, from the shared arm's reuse phase."""
    input:
        summaries=compared_cell_files("telemetry/summary.json"),
        reuse=compared_cell_files("reuse.csv"),
        drive=compared_cell_files("telemetry/drive.csv"),
        ceilings=expand("results/tiers/{tier}/ceiling.json", tier=CEILING_TIERS),
    output:
        tiers="results/tier_table.csv",
        csv="results/tier_compare.csv",
        md="results/tier_compare.md",
    log:
        "logs/summary/tier_compare.log",
    conda:
        CONDA_ENV
    params:
        cells=cell_names(COMPARED),
        settings=settings(tables.run_tier_compare),
    script:
        "../scripts/tier_compare.py"


rule load_table:
    """results/load.csv: every cell at every load level (c1 is its reuse phase), with intervals."""
    input:
        reuse=cell_files("reuse.csv"),
        reuse_meta=cell_files("reuse.json"),
        validity=cell_files("validity.json"),
        telemetry=cell_files("telemetry/summary.json"),
        levels=[f"results/cells/{cell.name}/load~{level}/requests.csv" for cell, level in LOAD_DONE],
        level_meta=[f"results/cells/{cell.name}/load~{level}/level.json" for cell, level in LOAD_DONE],
        ceilings=expand("results/tiers/{tier}/ceiling.json", tier=CEILING_TIERS),
    output:
        csv="results/load.csv",
        md="results/load.md",
    log:
        "logs/summary/load.log",
    conda:
        CONDA_ENV
    params:
        cells=cell_names(),
        levels=[[cell.name, level] for cell, level in LOAD_DONE],
        settings=settings(load_report.run_load_table),
    script:
        "../scripts/load_table.py"


rule router_table:
    """results/routers.csv: TTFT and where the prompt tokens came from, per cell, router and phase."""
    input:
        csvs=[f"results/cells/{cell.name}/router~{router}/requests.csv" for cell, router in ROUTER_UNITS],
        metas=[f"results/cells/{cell.name}/router~{router}/run.json" for cell, router in ROUTER_UNITS],
    output:
        csv="results/routers.csv",
        md="results/routers.md",
        figures=directory("results/routers"),
    log:
        "logs/summary/routers.log",
    conda:
        CONDA_ENV
    params:
        units=[[cell.name, router] for cell, router in ROUTER_UNITS],
    script:
        "../scripts/router_table.py"


rule trace_table:
    """results/trace.csv: per trace unit, the reuse it recovered against the trace's bounds, TTFT, SLO goodput,
    energy and pool (kvpool.studies.trace_replay), and its figures."""
    input:
        csvs=[f"results/cells/{cell.name}/trace~{router}/requests.csv" for cell, router in TRACE_UNITS],
        metas=[f"results/cells/{cell.name}/trace~{router}/run.json" for cell, router in TRACE_UNITS],
    output:
        csv="results/trace.csv",
        md="results/trace.md",
        figures=directory("results/trace"),
    log:
        "logs/summary/trace.log",
    conda:
        CONDA_ENV
    params:
        units=[[cell.name, router] for cell, router in TRACE_UNITS],
        slo_s=config["slo_s"],
    script:
        "../scripts/trace_table.py"


rule contexts_table:
    """results/contexts.csv: per shared cell, cold, own-cache and pool TTFT against the document's
    length, with the prefill and reload models fitted (kvpool.studies.contexts)."""
    input:
        csvs=[f"results/cells/{cell.name}/doc~{tokens}/requests.csv" for cell, tokens in CONTEXT_UNITS],
        metas=[f"results/cells/{cell.name}/doc~{tokens}/unit.json" for cell, tokens in CONTEXT_UNITS],
    output:
        csv="results/contexts.csv",
        md="results/contexts.md",
        figures=directory("results/contexts"),
    log:
        "logs/summary/contexts.log",
    conda:
        CONDA_ENV
    params:
        units=[[cell.name, tokens] for cell, tokens in CONTEXT_UNITS],
        settings=settings(contexts_report.run_contexts_table),
    script:
        "../scripts/contexts_table.py"


rule peer_table:
    """results/peer.csv: kvpool's TTFT beside vllm bench serve's replay of the same follow-ups, per cell."""
    input:
        reuse=[f"results/cells/{cell.name}/reuse.csv" for cell, _ in PEER_DONE],
        validity=[f"results/cells/{cell.name}/validity.json" for cell, _ in PEER_DONE],
        replays=[f"results/cells/{cell.name}/load~{unit}/requests.csv" for cell, unit in PEER_DONE],
        meta=[f"results/cells/{cell.name}/load~{unit}/level.json" for cell, unit in PEER_DONE],
    output:
        csv="results/peer.csv",
        md="results/peer.md",
    log:
        "logs/summary/peer.log",
    conda:
        CONDA_ENV
    params:
        cells=[cell.name for cell, _ in PEER_DONE],
        units=[unit for _, unit in PEER_DONE],
    script:
        "../scripts/peer_table.py"


rule studyb_tables:
    """Study B's Tables 3 and 4 from every block, its gate (each block's checks, the ON/OFF pairing) and page."""
    input:
        csvs=[f"{STUDYB_DIR}/block~{block}/requests.csv" for block in STUDYB_BLOCKS],
        metas=[f"{STUDYB_DIR}/block~{block}/block.json" for block in STUDYB_BLOCKS],
    output:
        locality="results/locality.csv",
        sessions="results/sessions.csv",
        summary="results/studyb/sessions_summary.csv",
        windows="results/studyb/windows.csv",
        validity="results/studyb/validity.json",
        md="results/studyb.md",
        figures=directory("results/studyb/figures"),
    log:
        "logs/studyb/tables.log",
    conda:
        CONDA_ENV
    params:
        blocks=STUDYB_BLOCKS,
        settings=settings(studyb_report.run_studyb_tables),
        study=STUDYB_MEASURED,
        # why there is no block, where there is none
        missing=STUDYB_MISSING,
    script:
        "../scripts/studyb_tables.py"


rule crossover:
    """Where the pool pays: a prefill and a reload model fitted to Study B's chains, the crossover
    context and the read rate below which a reload stops paying (kvpool.studies.crossover)."""
    input:
        locality="results/locality.csv",
    output:
        csv="results/crossover.csv",
        md="results/crossover.md",
        figures=directory("results/crossover"),
    log:
        "logs/studyb/crossover.log",
    conda:
        CONDA_ENV
    params:
        settings=settings(crossover_report.run_crossover),
        study=STUDYB_MEASURED,
    script:
        "../scripts/crossover.py"


rule breakdown:
    """Where each follow-up's TTFT goes (queue, pool lookup, KV transfer, the rest of the prefill, the
    server's and the client's rest), from each request's serving-replica histograms: the cells' reuse
    phases and the length units' chains."""
    input:
        csvs=BREAKDOWN_CSVS,
    output:
        csv="results/breakdown.csv",
        md="results/breakdown.md",
        png="results/figures/breakdown.png",
    log:
        "logs/summary/breakdown.log",
    conda:
        CONDA_ENV
    params:
        units=[unit for unit, _ in BREAKDOWN_UNITS],
        settings=settings(breakdown.run_breakdown),
    script:
        "../scripts/breakdown.py"


rule capacity_table:
    """results/capacity.csv: per shared cell and capacity, hit rate, recomputes, silent misses, evictions,
    bytes held, TTFT and energy (kvpool.studies.capacity)."""
    input:
        csvs=[f"results/cells/{cell.name}/capacity~{capacity.unit_label(f)}/requests.csv" for cell, f in CAPACITY_UNITS],
        metas=[f"results/cells/{cell.name}/capacity~{capacity.unit_label(f)}/unit.json" for cell, f in CAPACITY_UNITS],
    output:
        csv="results/capacity.csv",
        md="results/capacity.md",
        figures=directory("results/capacity"),
    log:
        "logs/summary/capacity.log",
    conda:
        CONDA_ENV
    params:
        units=[[cell.name, f] for cell, f in CAPACITY_UNITS],
    script:
        "../scripts/capacity_table.py"

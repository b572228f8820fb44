rule table1:
    """Every cell's figures with their intervals (cell_table.csv), and Study A's Table 1 (isolated
    against shared) drawn from them, as CSV and Markdown."""
    input:
        reuse=cell_files("reuse.csv"),
        reuse_meta=cell_files("reuse.json"),
        validity=cell_files("validity.json"),
        telemetry=cell_files("telemetry/summary.json"),
    params:
        thresholds={k: config[k] for k in ("warm_s", "slo_s")},
    output:
        cells="results/cell_table.csv",
        csv="results/table1.csv",
        md="results/table1.md",
    conda:
        CONDA_ENV
    log:
        "logs/summary/table1.log",
    script:
        "../scripts/table1.py"

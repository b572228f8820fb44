rule table1:
    """Study A's Table 1 (isolated against shared) as CSV and Markdown."""
    input:
        reuse=cell_files("reuse.csv"),
        reuse_meta=cell_files("reuse.json"),
        validity=cell_files("validity.json"),
        telemetry=cell_files("telemetry/summary.json"),
    params:
        thresholds={k: config[k] for k in ("warm_s", "slo_s")},
    output:
        csv="results/table1.csv",
        md="results/table1.md",
    conda:
        CONDA_ENV
    log:
        "logs/summary/table1.log",
    script:
        "../scripts/table1.py"

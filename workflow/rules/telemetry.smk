rule telemetry:
    """A cell's drive and power samples across populate and reuse, and each phase's summary."""
    input:
        populate_meta=cell_path("populate.json"),
        populate_drive=cell_path("telemetry/populate-drive.csv"),
        populate_power=cell_path("telemetry/populate-power.csv"),
        populate=cell_path("populate.csv"),
        reuse_meta=cell_path("reuse.json"),
        reuse_drive=cell_path("telemetry/reuse-drive.csv"),
        reuse_power=cell_path("telemetry/reuse-power.csv"),
        reuse=cell_path("reuse.csv"),
    output:
        drive=cell_path("telemetry/drive.csv"),
        power=cell_path("telemetry/power.csv"),
        summary=cell_path("telemetry/summary.json"),
    conda:
        CONDA_ENV
    log:
        cell_log("telemetry"),
    script:
        "../scripts/run_telemetry.py"


rule ceiling:
    """The tier's sequential-read ceiling, measured on a scratch file in the same run."""
    output:
        "results/tiers/{tier}/ceiling.json",
    params:
        bytes=config["drive_ceiling_bytes"],
        path=lambda wc: config["tiers"][wc.tier],
    resources:
        fleet=1,
    conda:
        CONDA_ENV
    log:
        "logs/ceiling/{tier}.log",
    script:
        "../scripts/run_ceiling.py"


rule tier_compare:
    """Each shared cell's drive figures with their intervals (tier_table.csv), and Study A's Table 2
    drawn from them: one column per tier, from the shared arm's reuse phase."""
    input:
        summaries=shared_cell_files("telemetry/summary.json"),
        reuse=shared_cell_files("reuse.csv"),
        drive=shared_cell_files("telemetry/drive.csv"),
        ceilings=expand("results/tiers/{tier}/ceiling.json", tier=config["tiers"]),
    output:
        tiers="results/tier_table.csv",
        csv="results/tier_compare.csv",
        md="results/tier_compare.md",
    conda:
        CONDA_ENV
    log:
        "logs/summary/tier_compare.log",
    script:
        "../scripts/tier_compare.py"

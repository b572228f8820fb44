rule telemetry:
    """A cell's drive and power samples across populate and reuse, and each phase's summary."""
    input:
        plan=cell_path("plan.yaml"),
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
    log:
        cell_log("telemetry"),
    conda:
        CONDA_ENV
    script:
        "../scripts/run_telemetry.py"

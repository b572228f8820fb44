rule launch_check:
    """Every launch read by its own program (vLLM's parser, LMCache's config loader and server parser), with
    kvpool's settings alone and with the config's extra_args and env: a setting kvpool owns that comes out
    changed stops the run here, before any fleet starts."""
    output:
        LAUNCH_CHECK,
    log:
        "logs/launch_check/launch_check.log",
    benchmark:
        "benchmarks/launch_check.tsv"
    conda:
        CONDA_ENV
    params:
        model=model_path(),
        cells=[cell.name for cell in CELLS],
        settings=settings(study_a.check_launches),
    script:
        "../scripts/check_launches.py"


rule plan:
    """The resolved launch plan of one cell's fleet, and the provenance of the cell."""
    input:
        launch_input,
    output:
        plan=cell_path("plan.yaml"),
        manifest=cell_path("manifest.json"),
    log:
        cell_log("plan"),
    conda:
        CONDA_ENV
    params:
        model=model_path(),
        # a change to any of them re-plans (and so re-measures) the cell
        settings=settings(study_a.make_plan),
    script:
        "../scripts/make_plan.py"

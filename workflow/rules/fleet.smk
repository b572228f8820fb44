rule plan:
    """The resolved launch plan of one cell's fleet, and the provenance of the cell."""
    input:
        model_input,
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

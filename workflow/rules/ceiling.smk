rule ceiling:
    """The tier's sequential-read ceiling, measured on a scratch file in the same run."""
    output:
        update("results/tiers/{tier}/ceiling.json"),
    log:
        "logs/ceiling/{tier}.log",
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        settings=settings(study_a.run_ceiling),
    script:
        "../scripts/run_ceiling.py"

# Document length (kvpool.studies.contexts): per shared cell and length in contexts.doc_tokens, one fleet on a
# fresh pool of the cell's kind sends each document's locality chain, the pool dropped from the page
# cache before every cross-replica step. A new length builds only its units; --forcerun on a unit's
# unit.json re-measures it.


rule context_unit:
    """One shared cell at one document length: its own plan and pool, one fleet, the chains, the unit's gate."""
    input:
        launch_input,
    output:
        plan=update(cell_path("doc~{doc}/plan.yaml")),
        manifest=update(cell_path("doc~{doc}/manifest.json")),
        csv=update(cell_path("doc~{doc}/requests.csv")),
        meta=update(cell_path("doc~{doc}/unit.json")),
        reference=update(cell_path("doc~{doc}/reference.csv")),
        drive=update(cell_path("doc~{doc}/drive-samples.csv")),
        power=update(cell_path("doc~{doc}/power-samples.csv")),
    log:
        f"logs/contexts/{CELL_PATTERN}/doc~{{doc}}.log",
    benchmark:
        cell_path("benchmarks/doc~{doc}.tsv")
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        model=model_path(),
        settings=settings(contexts.run_context_unit),
        log_dir=lambda wc: f"logs/contexts/{Cell.from_wildcards(wc).name}/doc~{wc.doc}",
    script:
        "../scripts/run_context_unit.py"

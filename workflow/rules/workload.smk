rule prompts:
    """Seeded documents of exactly doc_tokens tokens and one follow-up per document."""
    input:
        model_input,
    output:
        "results/workload/prompts.jsonl",
    log:
        "logs/prompts/prompts.log",
    conda:
        CONDA_ENV
    params:
        model=model_path(),
        workload=config["workload"],
    script:
        "../scripts/make_prompts.py"


rule reference:
    """Every follow-up's greedy answer from one replica with no pool, in each split the workload's arithmetic
    predicts (cold, the document's whole chunks per chunk size, the document, the whole prompt again): the
    split-matched recompute each cell, level and router unit must match."""
    input:
        launch_input,
        prompts="results/workload/prompts.jsonl",
    output:
        update("results/reference/outputs.csv"),
    log:
        "logs/reference/reference.log",
    benchmark:
        "benchmarks/reference.tsv"
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        model=model_path(),
        settings=settings(study_a.run_reference),
        log_dir="logs/reference/replicas",
    script:
        "../scripts/run_reference.py"

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
    """Greedy outputs of every follow-up from one plain replica: the recompute each cell must match."""
    input:
        model_input,
        prompts="results/workload/prompts.jsonl",
    output:
        "results/reference/outputs.csv",
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
        settings=settings("engine", "workload", "hash_keys"),
        log_dir="logs/reference/replicas",
    script:
        "../scripts/run_reference.py"

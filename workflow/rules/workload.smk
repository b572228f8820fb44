rule prompts:
    """Seeded documents of exactly doc_tokens tokens and one follow-up per document."""
    input:
        model_input,
    output:
        "results/workload/prompts.jsonl",
    params:
        model=model_path(),
        workload=config["workload"],
    conda:
        CONDA_ENV
    log:
        "logs/prompts/prompts.log",
    script:
        "../scripts/make_prompts.py"


rule reference:
    """Greedy outputs of every follow-up from one plain replica: the recompute each cell must match."""
    input:
        model_input,
        prompts="results/workload/prompts.jsonl",
    output:
        "results/reference/outputs.csv",
    params:
        model=model_path(),
        engine=config["engine"],
        log_dir="logs/reference/replicas",
    resources:
        fleet=1,
    conda:
        CONDA_ENV
    log:
        "logs/reference/reference.log",
    benchmark:
        "benchmarks/reference.tsv"
    script:
        "../scripts/run_reference.py"

rule model:
    """A random-weights causal LM and tokenizer, built locally and deterministically (no hub)."""
    output:
        directory(RANDOM_MODEL_DIR),
    log:
        "logs/model/model.log",
    benchmark:
        "benchmarks/model.tsv"
    conda:
        CONDA_ENV
    params:
        spec=config["random_model"],
        device="cuda" if config["engine"]["kind"] == "vllm" else "cpu",
    script:
        "../scripts/build_model.py"


rule model_check:
    """A model whose weights vLLM draws at each start (random_model.weights: drawn): two replicas of one launch
    answer three cold prompts alike, and the answers depend on the prompts' heads, or the run stops here."""
    input:
        model_input,
    output:
        update(MODEL_CHECK),
    log:
        "logs/model/model_check.log",
    benchmark:
        "benchmarks/model_check.tsv"
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        model=model_path(),
        settings=settings(model_check.run_model_check),
        log_dir="logs/model/model_check",
    script:
        "../scripts/check_model.py"

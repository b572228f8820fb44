rule model:
    """A random-weights causal LM and tokenizer, built locally and deterministically (no hub)."""
    output:
        directory(RANDOM_MODEL_DIR),
    params:
        spec=config["random_model"],
        device="cuda" if config["engine"]["kind"] == "vllm" else "cpu",
    conda:
        CONDA_ENV
    log:
        "logs/model/model.log",
    benchmark:
        "benchmarks/model.tsv"
    script:
        "../scripts/build_model.py"

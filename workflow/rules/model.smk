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

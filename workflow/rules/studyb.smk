# Study B's design (kvpool.studies.studyb): blocks OFF, ON, ON, OFF (repeated per study_b.repeats), each a
# fresh fleet of two replicas, ON on the study's shared pool (emptied first), OFF with no connector.
# Re-measure one block with --forcerun on its block.json; a block waits for the one before it.


rule studyb_workload:
    """Study B's payloads (chains, sessions, warm-ups), the same in every block."""
    input:
        model_input,
    output:
        STUDYB_WORKLOAD,
    log:
        "logs/studyb/workload.log",
    conda:
        CONDA_ENV
    params:
        model=model_path(),
        settings=settings(studyb.run_studyb_workload),
        study=STUDYB_MEASURED,
    script:
        "../scripts/run_studyb_workload.py"


rule studyb_block:
    """One block: its plan, a fresh fleet (and pool servers), the chains and sessions, its checks."""
    input:
        launch_input,
        workload=STUDYB_WORKLOAD,
        after=studyb_after,
        # the earlier blocks' pool-less answers (an OFF block's) and reference rows, for an ON block's reference
        known=studyb_known,
    output:
        plan=update(f"{STUDYB_DIR}/block~{{block}}/plan.yaml"),
        manifest=update(f"{STUDYB_DIR}/block~{{block}}/manifest.json"),
        csv=update(f"{STUDYB_DIR}/block~{{block}}/requests.csv"),
        meta=update(f"{STUDYB_DIR}/block~{{block}}/block.json"),
        reference=update(f"{STUDYB_DIR}/block~{{block}}/reference.csv"),
    log:
        # under the block's results path: another config's blocks (another backend, chunk or tier) log apart
        f"logs/{STUDYB_LOGS}/block~{{block}}.log",
    benchmark:
        f"{STUDYB_DIR}/benchmarks/block~{{block}}.tsv"
    conda:
        CONDA_ENV
    resources:
        fleet=1,
    params:
        model=model_path(),
        settings=settings(studyb.run_studyb_block),
        study=STUDYB_MEASURED,
        log_dir=lambda wc: f"logs/{STUDYB_LOGS}/block~{wc.block}/replicas",
    script:
        "../scripts/run_studyb_block.py"

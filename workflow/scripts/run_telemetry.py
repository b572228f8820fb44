from kvpool.measure import logs
from kvpool.studies import study_a

logs.to_log(snakemake.log[0])
files = {
    phase: {"meta": snakemake.input[f"{phase}_meta"], "drive": snakemake.input[f"{phase}_drive"],
            "power": snakemake.input[f"{phase}_power"], "records": snakemake.input[phase]}
    for phase in ("populate", "reuse")
}
study_a.run_telemetry(files, snakemake.output.drive, snakemake.output.power, snakemake.output.summary,
                      plan_path=snakemake.input.plan)

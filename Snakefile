# kvpool: does a shared KV-cache pool let vLLM replicas reuse each other's prefill?
# The rules live in workflow/rules/, the logic in the kvpool package (src/kvpool).
from pathlib import Path

from snakemake.utils import min_version

from kvpool.config import resolve_extends, validated

min_version("9.0")


# --configfile files replace the embedded default (merged with each other, left to right); without
# them it is config/config.yaml. --config key=value overrides either. One rule, wherever it runs.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# An overlay (extends: another config file) is merged over its base before anything reads it; then the
# schema (workflow/schemas/config.schema.yaml) fills the defaults and refuses in one line naming the key.
resolve_extends(config, Path(workflow.basedir), workflow.overwrite_configfiles or [])
validated(config, Path(workflow.basedir))


include: "workflow/rules/common.smk"


# The rules that measure (and build what measuring needs). With measured_only the workflow has none of
# them: whatever a cell recorded is a source file, never re-measured.
if not MEASURED_ONLY:

    include: "workflow/rules/model.smk"
    include: "workflow/rules/workload.smk"
    include: "workflow/rules/fleet.smk"
    include: "workflow/rules/populate.smk"
    include: "workflow/rules/drop.smk"
    include: "workflow/rules/reuse.smk"
    include: "workflow/rules/cell.smk"
    include: "workflow/rules/ceiling.smk"
    include: "workflow/rules/load.smk"
    include: "workflow/rules/routers.smk"
    include: "workflow/rules/trace.smk"
    include: "workflow/rules/contexts.smk"
    include: "workflow/rules/capacity.smk"
    include: "workflow/rules/studyb.smk"


include: "workflow/rules/telemetry.smk"
include: "workflow/rules/validity.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        final_outputs(),

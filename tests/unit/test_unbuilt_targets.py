"""A run Snakemake calls done must have built what it was asked for. Snakemake 9 skips the jobs below one
that reruns for changed params when their link to it is ancient (snakemake/snakemake#4166), as every
fleet job's link to kvpool's launch check is; kvpool's onsuccess turns that silent success into a failure
that says what to do."""

import subprocess
import sys
from types import SimpleNamespace

from kvpool.config import unbuilt_message, unbuilt_targets

# The bug's shape, with kvpool's guard as the workflow has it (workflow/rules/common.smk's onsuccess).
SNAKEFILE = '''
import sys
from kvpool import config as kvpool_config

rule all:
    input: f"cell{config.get('cell', 1)}.json"

rule launch_check:
    output: "launch-check.json"
    params: settings=config.get("settings", 1)
    shell: "echo {params.settings} > {output}"

rule cell:
    input: ancient("launch-check.json")
    output: "cell{n}.json"
    shell: "cat {input} > {output}"

onsuccess:
    _missing = kvpool_config.unbuilt_targets(workflow.dag)
    if _missing:
        print(kvpool_config.unbuilt_message(_missing), file=sys.stderr)
        sys.exit(1)
'''


def snakemake(folder, *args):
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "-s", str(folder / "Snakefile"),
                           "--directory", str(folder), *args], capture_output=True, text=True, timeout=120)


def test_a_run_that_reran_only_the_launch_check_fails_naming_what_it_did_not_build(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    assert snakemake(tmp_path).returncode == 0 and (tmp_path / "cell1.json").exists()
    (tmp_path / "changed.yaml").write_text("settings: 2\ncell: 8\n")  # the check's params and a new cell
    cut_short = snakemake(tmp_path, "--configfile", str(tmp_path / "changed.yaml"))
    assert not (tmp_path / "cell8.json").exists()  # Snakemake's own bug: only the launch check ran
    assert cut_short.returncode == 1, cut_short.stderr[-2000:]
    assert "without building 1 of the targets it was asked for (cell8.json)" in cut_short.stderr
    assert "Run the same command again" in cut_short.stderr and "Traceback" not in cut_short.stderr
    again = snakemake(tmp_path, "--configfile", str(tmp_path / "changed.yaml"))
    assert again.returncode == 0 and (tmp_path / "cell8.json").exists(), again.stderr[-2000:]


def test_a_run_cut_short_on_purpose_is_not_judged(tmp_path):
    dag = SimpleNamespace(untilrules={"populate"}, untilfiles=set(), omitrules=set(), omitfiles=set(),
                          derived_targetfiles={str(tmp_path / "missing.json")})
    assert unbuilt_targets(dag) == []
    dag.untilrules = set()
    assert unbuilt_targets(dag) == [str(tmp_path / "missing.json")]
    assert "(a, b, c, ...)" in unbuilt_message(["a", "b", "c", "d"])

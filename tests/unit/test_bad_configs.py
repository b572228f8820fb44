"""The bad-config corpus (tests/configs/bad): each file layers one mistake on config/config.yaml, as
`--configfile config/config.yaml BAD.yaml` would, and says on its first line what refuses it.

`# refused: TEXT` means refused while the workflow is parsed (a dry run too), by the schema or by
kvpool's own checks; `# refused at start: TEXT` means refused on the machine that runs the jobs,
before the first job (tier space, local paths, cores). TEXT must appear in the message.
"""

import re
import subprocess
import sys

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import update_config
from support import REPO

from kvpool.config import problems, resolve_extends, validated

CORPUS = sorted((REPO / "tests" / "configs" / "bad").glob("*.yaml"))


def expectation(path):
    match = re.match(r"# refused( at start)?: (.+)", path.read_text().splitlines()[0])
    assert match, f"{path.name} must start with '# refused: ...' or '# refused at start: ...'"
    return bool(match.group(1)), match.group(2)


def merged(path):
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(config, yaml.safe_load(path.read_text()))
    return config


def refusals(config, workdir, at_start):
    """What refuses ``config``: the schema's message, else kvpool's problems (parse time, or at start)."""
    try:
        resolve_extends(config, REPO)  # an overlay over its base, then the schema's defaults, as the Snakefile does
        validated(config, REPO)
    except (WorkflowError, ValueError) as error:
        return [str(error)]
    return problems(config, workdir, check_paths=at_start)


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_each_bad_config_is_refused_naming_what_is_wrong(path, tmp_path):
    at_start, text = expectation(path)
    found = refusals(merged(path), tmp_path, at_start)
    assert any(text in message for message in found), found
    if at_start:  # nothing of the machine is asked during parsing: a plan can be dry-run elsewhere
        assert not any(text in message for message in refusals(merged(path), tmp_path, False))


def test_the_default_config_is_not_refused(tmp_path, free_disk):
    free_disk(10**12)  # the corpus's tier-too-small.yaml is what a full drive gives
    assert refusals(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), tmp_path, True) == []


@pytest.mark.parametrize("name", ["unknown-key", "lmcache-chunk-size", "host-name", "extends-missing",
                                  "replicas-float"])
def test_a_dry_run_refuses_with_the_message_and_no_traceback(name, tmp_path):
    path = REPO / "tests" / "configs" / "bad" / f"{name}.yaml"
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--directory", str(tmp_path), "-s",
                          str(REPO / "Snakefile"), "--configfile", str(REPO / "config" / "config.yaml"), str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    said = out.stdout + out.stderr
    assert out.returncode != 0
    assert expectation(path)[1] in said and "Traceback" not in said, said[-3000:]


def test_the_guarantees_state_the_corpus_size():
    stated = re.search(r"(\d+) bad configs", (REPO / "docs" / "guarantees.md").read_text())
    assert stated and int(stated.group(1)) == len(CORPUS)

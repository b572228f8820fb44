"""A job's refusal of input only the running machine can judge (a configured port another process holds,
a launch the stack would read otherwise) ends the job in one line naming it; anything else that goes
wrong keeps its traceback for whoever debugs it."""

import subprocess
import sys

import pytest

JOB = """
import sys
from kvpool.engine import errors
from kvpool.measure import logs

logs.to_log(sys.argv[1])
raise {error}
"""


def job(tmp_path, error: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(JOB.format(error=error))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "job.log")], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("error", [
    'errors.PortsInUse("configured ports are in use on this machine: replica 0 port 18710 (held by pid 7)")',
    'errors.LaunchRefused("a launch would run otherwise than kvpool plans it: --max-model reads as ...")'])
def test_a_refusal_ends_the_job_in_one_line_in_its_log_and_on_the_terminal(tmp_path, error):
    ended = job(tmp_path, error)
    assert ended.returncode == 1
    for said in (ended.stderr, (tmp_path / "job.log").read_text()):
        assert "Traceback" not in said and said.strip().startswith("kvpool refused: ")
        assert len(said.strip().splitlines()) == 1


def test_anything_else_keeps_its_traceback(tmp_path):
    ended = job(tmp_path, 'KeyError("replicas")')
    assert ended.returncode == 1 and "Traceback" in ended.stderr and "KeyError: 'replicas'" in ended.stderr

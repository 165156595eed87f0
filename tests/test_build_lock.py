"""Two builds at once in one repository: the second waits for the first (or, with --no-wait, stops
with a message naming it), and nothing is corrupted: the waiting build then has nothing to do."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from flows.dvc import BUILD_LOCK
from tests.conftest import dvc, set_param

pytestmark = pytest.mark.e2e


def ortforge(project, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ortforge.cli", "--root", str(project), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until_locked(project, first: subprocess.Popen) -> None:
    lock = project / BUILD_LOCK
    for _ in range(600):
        if lock.is_file() and f"pid {first.pid}" in lock.read_text(encoding="utf-8"):
            return
        assert first.poll() is None, first.communicate()
        time.sleep(0.1)
    raise AssertionError("the first build never took the lock")


def test_second_build_waits_or_stops_and_nothing_is_corrupted(built_project):
    project = built_project
    set_param(project, ["quantize", "int4", "block_size"], 16)  # the first build has stages to run
    first = ortforge(project, "build")
    wait_until_locked(project, first)

    impatient = ortforge(project, "build", "--no-wait")
    out, err = impatient.communicate(timeout=60)
    assert impatient.returncode == 2
    assert err.strip().splitlines()[-1].startswith(f"error: another build (pid {first.pid}, started ")

    second = ortforge(project, "build")
    first_out, first_err = first.communicate(timeout=900)
    second_out, second_err = second.communicate(timeout=900)
    assert first.returncode == 0, first_err[-3000:]
    assert second.returncode == 0, second_err[-3000:]
    assert "stage(s) executed" in first_out
    assert f"waiting for another build (pid {first.pid}" in second_err
    assert "no stage executed" in second_out  # it waited, then found everything built
    # Every output matches what dvc.lock recorded: no file was written twice or half.
    assert "Data and pipelines are up to date" in dvc(project, "status").stdout

"""A Hugging Face token in the environment of a whole Prefect build appears nowhere afterwards: not
in the build's output, its logs and artifacts on the Prefect server, nor any file in the repository
(manifests, reports, dvc.lock, DVC's cache)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import keep_builds, prefect_records

pytestmark = pytest.mark.e2e

SECRET = "hf_SENTINELdoNotLeak0123456789abcdef"  # a fake token; a real one would look like it


def test_token_leaks_into_no_output_log_record_or_file(project, prefect_api):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    keep_builds(project)  # every kind of stage runs; a third variant would add only time

    env = {**os.environ, "HF_TOKEN": SECRET, "PREFECT_API_URL": prefect_api}
    build = subprocess.run(
        [sys.executable, "-m", "flows.build", "--root", str(project)], env=env, capture_output=True, text=True
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert "Running stage" in build.stdout + build.stderr  # the build really ran and said so
    assert SECRET not in build.stdout + build.stderr

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        records = prefect_records()
    assert any("Running stage" in record for record in records)  # the server's logs were read
    assert not [record for record in records if SECRET in record]

    leaked = [p for p in project.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []

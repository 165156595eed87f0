"""Never build the same artifact twice: a fresh clone reuses what a build pushed to a DVC remote (the
project's default local folder, or S3 on a real S3-compatible server), or what a CI cache restored
into .dvc/cache, and executes no stage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import dvc, dvc_repro, fresh_clone, use_s3

pytestmark = pytest.mark.e2e


def artifact_files(project: Path) -> dict[str, int]:
    return {
        p.relative_to(project).as_posix(): p.stat().st_size for p in (project / "artifacts").rglob("*") if p.is_file()
    }


def test_default_remote_is_a_folder_beside_the_repository(pushed):
    remote = pushed.parent / "ortforge-dvc-remote"
    assert remote.is_dir() and any(remote.rglob("*"))


def test_clone_pull_repro_executes_no_stage(pushed):
    clone = fresh_clone(pushed, "pulled")
    dvc(clone, "pull")
    assert dvc_repro(clone) == []
    assert artifact_files(clone) == artifact_files(pushed)


def test_clone_with_restored_cache_folder_executes_no_stage(pushed):
    clone = fresh_clone(pushed, "ci-cache")
    shutil.copytree(pushed / ".dvc" / "cache", clone / ".dvc" / "cache")  # what actions/cache restores
    assert dvc_repro(clone) == []
    assert artifact_files(clone) == artifact_files(pushed)


def test_s3_remote_push_clone_pull_executes_no_stage(pushed, s3_server):
    import boto3

    use_s3(pushed, s3_server)
    dvc(pushed, "push", "-r", "s3")
    bucket = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="test", aws_secret_access_key="test")
    assert bucket.list_objects_v2(Bucket="ortforge-cache", Prefix="dvc/")["KeyCount"] > 10
    clone = fresh_clone(pushed, "from-s3")
    use_s3(clone, s3_server)
    dvc(clone, "pull", "-r", "s3")
    assert dvc_repro(clone) == []
    assert artifact_files(clone) == artifact_files(pushed)

"""Never build the same artifact twice: a fresh clone reuses what a build pushed to a DVC remote (the
project's default local folder, or S3 on a real S3-compatible server), or what a CI cache restored
into .dvc/cache, and executes no stage."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import dvc, dvc_repro, git, make_project

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, tiny_hf) -> Path:
    """A tiny-model project built once, committed, and pushed to its default remote."""
    project = make_project(tmp_path_factory.mktemp("cache") / "origin", tiny_hf)
    assert dvc_repro(project)
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "build")
    dvc(project, "push")
    return project


def fresh_clone(origin: Path, name: str) -> Path:
    clone = origin.parent / name
    git(origin.parent, "clone", "-q", str(origin), str(clone))
    return clone


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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3-compatible server on 127.0.0.1, with the bucket the project's s3 remote names."""
    import boto3

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test")
        for _ in range(100):
            try:
                client.create_bucket(Bucket="ortforge-cache")
                break
            except Exception:  # not listening yet
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def use_s3(project: Path, endpoint: str) -> None:
    dvc(project, "remote", "modify", "--local", "s3", "endpointurl", endpoint)
    dvc(project, "remote", "modify", "--local", "s3", "access_key_id", "test")
    dvc(project, "remote", "modify", "--local", "s3", "secret_access_key", "test")


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

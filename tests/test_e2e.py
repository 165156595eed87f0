"""The whole DAG on the tiny model in a throwaway repository, driven by DVC and by Prefect."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import dvc, dvc_repro, set_param

pytestmark = pytest.mark.e2e

VARIANT_STAGES = ("quantize", "validate", "bench", "evaluate")
ALL_STAGES = {
    *(f"{stage}@tiny" for stage in ("download", "export", "optimize", "reference", "report")),
    *(f"{stage}@tiny-{variant}" for stage in VARIANT_STAGES for variant in ("fp32", "int8", "int4")),
}


def test_dvc_repro_builds_all_then_nothing_then_only_what_changed(first_build, built_project):
    assert set(first_build[1]) == ALL_STAGES  # from nothing: every stage ran
    project = built_project
    assert (project / "dvc.lock").is_file()
    table = (project / "reports" / "tiny" / "report.md").read_text()
    # Each variant has a row; whether it is on the Pareto front depends on this machine's timings.
    assert all(f"\n| {variant} | " in table for variant in ("fp32", "int8", "int4"))

    assert dvc_repro(project) == []

    set_param(project, ["quantize", "int4", "block_size"], 16)
    assert set(dvc_repro(project)) == {*(f"{stage}@tiny-int4" for stage in VARIANT_STAGES), "report@tiny"}

    # Same values in another layout, and files no stage reads: nothing to do.
    params = yaml.safe_load((project / "params.yaml").read_text())
    (project / "params.yaml").write_text("# reformatted\n" + yaml.safe_dump(params, default_flow_style=True, width=60))
    (project / "NOTES.md").write_text("unrelated\n")
    (project / "tasks" / "__init__.py").write_text('"""touched"""\n')
    assert dvc_repro(project) == []


def test_tool_upgrade_invalidates_exactly_the_stages_using_it(built_project):
    project = built_project
    set_param(project, ["onnxruntime"], "9.9.9", file="versions.yaml")
    status = json.loads(dvc(project, "status", "--json").stdout)
    # export checks its graph with onnxruntime and saves through its tools, so it reruns too;
    # reference runs PyTorch alone and stays cached.
    expected = {
        "export@tiny",
        "optimize@tiny",
        *(f"{s}@tiny-{v}" for s in VARIANT_STAGES for v in ("fp32", "int8", "int4")),
    }
    assert set(status) == expected
    # The stage refuses to build under a pin that is not what is installed.
    result = dvc(project, "repro", check=False)
    assert result.returncode != 0
    assert (
        "installed versions differ from versions.yaml: onnxruntime 1.32.0 (pinned 9.9.9)"
        in result.stderr + result.stdout
    )


def test_an_edit_in_tasks_core_makes_every_stage_stale(built_project):
    """tasks/core/files.py writes every stage's JSON: it is in every stage's key."""
    project = built_project
    files = project / "tasks" / "core" / "files.py"
    files.write_text(files.read_text() + "\n# edited\n")
    assert set(json.loads(dvc(project, "status", "--json").stdout)) == ALL_STAGES


def test_genai_builder_upgrade_makes_exactly_export_and_what_follows_it_stale(built_project):
    from flows.dvc import planned_stages

    project = built_project
    set_param(project, ["onnxruntime-genai"], "9.9.9", file="versions.yaml")
    assert set(json.loads(dvc(project, "status", "--json").stdout)) == {"export@tiny"}
    # What follows it: every stage a rerun export's new graph reaches, without running anything.
    downstream = ALL_STAGES - {"download@tiny", "reference@tiny"}
    assert set(planned_stages(project, None, "--force-downstream")) == downstream


def test_dvc_repro_stops_on_failed_gate_and_names_it(built_project):
    project = built_project
    bench_json = project / "reports" / "tiny" / "variants" / "int4" / "bench.json"
    benched = bench_json.read_bytes()
    set_param(project, ["validate", "thresholds", "int4", "kl_divergence"], 1e-9)
    result = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=project, capture_output=True, text=True)
    assert result.returncode != 0
    assert "error: variant int4 failed validation: kl_divergence[GPL-3.txt]" in result.stderr + result.stdout
    # Nothing after the failed gate ran: no bench of the variant, no report with it.
    assert re.findall(r"Running stage '([^']+)'", result.stdout) == ["validate@tiny-int4"]
    assert bench_json.read_bytes() == benched


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def test_flow_builds_publishes_table_and_then_runs_nothing(project, prefect_server):
    from prefect.artifacts import Artifact

    from flows import build as flows_build

    executed = flows_build.build(root=project)
    assert executed["download@tiny"] == ["download@tiny"]
    assert executed["variant@tiny-int4"] == ["quantize@tiny-int4", "validate@tiny-int4"]
    assert executed["bench@tiny"] == [f"bench@tiny-{variant}" for variant in ("fp32", "int8", "int4")]
    assert sorted(stage for stages in executed.values() for stage in stages) == sorted(ALL_STAGES)
    assert executed["check"] == []  # the fan-out left nothing for a plain `dvc repro`
    artifact = Artifact.get("report-tiny")
    assert (
        artifact is not None and "\n| int4 | " in artifact.data and "Metrics against the last commit" in artifact.data
    )

    again = flows_build.build(root=project)
    assert set(again) == set(executed) and not any(again.values())


def test_flow_download_retries_transient_errors(prefect_server, monkeypatch):
    from prefect import flow

    from flows import build as flows_build

    calls = []

    def flaky(root, targets=None, *options):
        calls.append(targets)
        if len(calls) == 1:
            raise ConnectionError("hub hiccup")
        return targets

    monkeypatch.setattr(flows_build, "reproduce", flaky)
    assert flows_build.download.retries >= 1
    quick = flows_build.download.with_options(retry_delay_seconds=0)

    @flow
    def one_download():
        return quick(Path("."), "tiny")

    assert one_download() == ["download@tiny"]
    assert calls == [["download@tiny"], ["download@tiny"]]

"""Several models in one repository: adding one touches only params.yaml, and the Prefect flow fans
the stages of two architectures out over a Dask cluster of process workers, reporting to a real
Prefect server, without DVC lock errors and with every artifact and metric in place."""

from __future__ import annotations

import json

import pytest

from tests.conftest import EVERY_STAGE_KIND, add_model, dvc, fresh_clone, keep_builds, make_project, prefect_records

pytestmark = pytest.mark.e2e

VARIANTS = ("fp32", "int8", "int4")
FANNED_OUT = EVERY_STAGE_KIND  # the Dask build's variants, per model: two models in parallel


def stages_of(model: str, variants: tuple[str, ...] = VARIANTS) -> set[str]:
    shared = {f"{stage}@{model}" for stage in ("download", "export", "optimize", "reference", "report")}
    return shared | {
        f"{stage}@{model}-{v}" for stage in ("quantize", "validate", "bench", "evaluate") for v in variants
    }


def test_adding_a_model_touches_only_params_and_only_its_stages_are_stale(pushed, tiny_qwen_hf):
    clone = fresh_clone(pushed, "two-models")
    dvc(clone, "pull")
    assert json.loads(dvc(clone, "status", "--json").stdout) == {}

    add_model(clone, "tiny-qwen", tiny_qwen_hf)
    stale = set(json.loads(dvc(clone, "status", "--json").stdout))
    # report@tiny reads the list of builds, which gained the new model's entries (DVC cannot track
    # one model's part of it); it reruns and writes the same table.
    assert stale == stages_of("tiny-qwen") | {"report@tiny"}


def test_flow_fans_out_two_architectures_on_dask(tmp_path, tiny_hf, tiny_qwen_hf, prefect_api, monkeypatch):
    from distributed import Client, LocalCluster
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_dask import DaskTaskRunner

    from flows.build import build

    project = make_project(tmp_path / "repo", tiny_hf)
    add_model(project, "tiny-qwen", tiny_qwen_hf)
    keep_builds(project, FANNED_OUT)
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # the workers report their task runs here too
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
            runner = DaskTaskRunner(address=cluster.scheduler_address)
            executed = build.with_options(task_runner=runner)(project)
            records = prefect_records()
        with Client(cluster) as client:  # how many tasks each worker process ran
            tasks_per_worker = client.run(lambda dask_worker: dask_worker.state.executed_count)

    everything = stages_of("tiny", FANNED_OUT) | stages_of("tiny-qwen", FANNED_OUT)
    ran = [stage for stages in executed.values() for stage in stages]
    assert sorted(ran) == sorted(everything)  # each stage exactly once
    assert executed["check"] == []
    assert not [record for record in records if "is busy" in record or "Unable to acquire lock" in record]
    assert len(tasks_per_worker) == 2 and sum(tasks_per_worker.values()) >= len(executed) - 1

    for model in ("tiny", "tiny-qwen"):
        for variant in FANNED_OUT:
            folder = project / "reports" / model / "variants" / variant
            assert json.loads((folder / "validate.json").read_text())["passed"] is True
            assert json.loads((folder / "bench.json").read_text())["decode_tokens_per_second"] > 0
        assert (project / "reports" / model / "report.html").is_file()
    assert "Data and pipelines are up to date" in dvc(project, "status").stdout

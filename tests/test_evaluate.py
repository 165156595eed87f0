"""evaluate: each validated variant's answers to the task sets, with the settings bench chose; a
variant validate did not pass is refused, and a bad task row stops a build before any stage."""

from __future__ import annotations

import json
import shutil

import pytest

from flows.preflight import check_task_sets
from tasks import evaluate
from tasks.core.params import Params
from tasks.core.stage import StageError
from tests.conftest import VARIANTS, tiny_params


def test_a_variant_validate_did_not_pass_is_never_evaluated(built, params, tmp_path):
    unvalidated = shutil.copytree(built["int4"], tmp_path / "int4")  # no validation stamp beside it
    with pytest.raises(StageError, match="only validated variants are evaluated"):
        evaluate.run(params.tasks, unvalidated)


def test_a_bad_task_row_stops_the_build_before_any_stage(tmp_path, tiny_hf):
    rows = tmp_path / "data" / "tasks" / "mine.jsonl"
    rows.parent.mkdir(parents=True)
    good = {"id": "q1", "question": "Capital of France?", "answers": ["Paris"]}
    rows.write_text(json.dumps(good) + "\n" + json.dumps(good | {"id": "q2", "answers": []}) + "\n")
    params = Params.model_validate(
        tiny_params(tiny_hf, tasks={"sets": {"mine": {"kind": "qa", "file": "data/tasks/mine.jsonl"}}})
    )
    with pytest.raises(StageError, match=r"mine.jsonl:2: answers: List should have at least 1 item") as error:
        check_task_sets(tmp_path, params)
    assert "\n" not in str(error.value)


@pytest.mark.e2e
def test_the_build_answers_every_set_with_the_settings_bench_chose(first_build):
    project = first_build[0]
    for variant in VARIANTS:
        found = json.loads((project / "reports" / "tiny" / "variants" / variant / "tasks.json").read_text())
        assert {name: entry["kind"] for name, entry in found["sets"].items()} == {
            "chat_qa": "qa",
            "classify": "choice",
            "summarize": "instruct",
        }
        for entry in found["sets"].values():  # tasks.limit 3: each set's first three rows
            assert entry["items"] == len(entry["answers"]) == 3
        assert all(isinstance(choice, int) for choice in found["sets"]["classify"]["answers"].values())
        assert found["sets"]["chat_qa"]["score"]["count"] == 3 and not found["chat_template"]
        tuned = json.loads((project / "artifacts" / "tiny" / "variants" / f"{variant}.runtime.json").read_text())
        assert found["session"] == tuned["session"]
    summary = json.loads((project / "reports" / "tiny" / "report.json").read_text())
    assert summary["tasks"]["reference"] == "fp32"
    assert summary["tasks"]["variants"]["fp32"]["task_gate_failures"] == []
    assert "## Task A/B" in (project / "reports" / "tiny" / "report.md").read_text()

"""Task set files: the shipped sets load, and every bad row is refused in one line naming the file,
the line and what to fix, before any model runs."""

from __future__ import annotations

import json

import pytest

from tasks.core.errors import StageError
from tasks.core.params import load_params
from tasks.evaluation import task_eval
from tasks.evaluation.task_sets import load
from tests.conftest import REPO

GOOD = {
    "qa": {"id": "a", "question": "What is the capital of France?", "answers": ["Paris"]},
    "choice": {"id": "a", "prompt": "Review: great.\nSentiment:", "choices": [" positive", " negative"], "label": 0},
    "instruct": {"id": "a", "instruction": "Summarize: the bridge reopens."},
}


def write(tmp_path, lines: list[str]):
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_shipped_sets_load_with_at_least_200_items(monkeypatch):
    monkeypatch.chdir(REPO)  # params.yaml's paths are the repository's
    sets = task_eval.sets_of(load_params(REPO / "params.yaml").tasks)
    assert {task.kind for task in sets} == {"qa", "choice", "instruct"}
    assert sum(len(task.rows) for task in sets) >= 200
    for task in sets:
        assert len({row.id for row in task.rows}) == len(task.rows)


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_a_good_row_loads(tmp_path, kind):
    task = load("mine", kind, write(tmp_path, [json.dumps(GOOD[kind]), ""]))  # blank lines are skipped
    assert len(task.rows) == 1 and task.rows[0].id == "a"


@pytest.mark.parametrize(
    ("kind", "line", "said"),
    [
        ("qa", "{not json", "not JSON"),
        ("qa", "[1, 2]", "a JSON list, not an object"),
        ("qa", json.dumps({"id": "a", "question": "Q?"}), "answers: Field required"),
        ("qa", json.dumps({**GOOD["qa"], "answer": "x"}), "answer: Extra inputs are not permitted"),
        ("qa", json.dumps({**GOOD["qa"], "answers": [" "]}), "an empty answer matches every reply"),
        ("qa", json.dumps({**GOOD["qa"], "answers": "Paris"}), "answers: Input should be a valid list"),
        ("choice", json.dumps({**GOOD["choice"], "label": 2}), "label 2 is not an index of its 2 choices"),
        ("choice", json.dumps({**GOOD["choice"], "choices": [" a", " a"]}), "two choices are the same text"),
        (
            "choice",
            json.dumps({**GOOD["choice"], "choices": [" a"], "label": 0}),
            "choices: List should have at least 2",
        ),
        ("choice", json.dumps({**GOOD["choice"], "label": "0"}), "label: Input should be a valid integer"),
        ("instruct", json.dumps({"id": "", "instruction": "x"}), "id: String should have at least 1 character"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_line_and_fix(tmp_path, kind, line, said):
    path = write(tmp_path, [json.dumps({**GOOD[kind], "id": "first"}), line])
    with pytest.raises(StageError) as error:
        load("mine", kind, path)
    message = str(error.value)
    assert message.startswith(f"{path}:2: ") and said in message and "\n" not in message


def test_a_repeated_id_is_refused(tmp_path):
    path = write(tmp_path, [json.dumps(GOOD["qa"])] * 2)
    with pytest.raises(StageError, match=r"set.jsonl:2: id 'a' appears twice"):
        load("mine", "qa", path)


@pytest.mark.parametrize(
    ("kind", "path", "said"),
    [
        ("essay", "set.jsonl", "kind 'essay' is not one of qa, choice, instruct"),
        ("qa", "absent.jsonl", "does not exist"),
    ],
)
def test_a_wrong_kind_or_missing_file_is_refused(tmp_path, kind, path, said):
    write(tmp_path, [json.dumps(GOOD["qa"])])
    with pytest.raises(StageError, match=said):
        load("mine", kind, tmp_path / path)


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(StageError, match="has no rows"):
        load("mine", "qa", write(tmp_path, [""]))


def test_lm_eval_configs_ask_for_what_each_kind_scores(tmp_path):
    choice = load("cls", "choice", write(tmp_path, [json.dumps(GOOD["choice"])])).lm_eval_config(chat=False)
    assert choice["output_type"] == "multiple_choice" and choice["target_delimiter"] == ""
    qa = load("qa", "qa", write(tmp_path, [json.dumps(GOOD["qa"])]))
    assert qa.lm_eval_config(chat=True)["doc_to_text"] == "{{question}}"  # the template frames it
    plain = qa.lm_eval_config(chat=False)
    assert (
        plain["doc_to_text"] == "Question: {{question}}\nAnswer:" and plain["generation_kwargs"]["do_sample"] is False
    )

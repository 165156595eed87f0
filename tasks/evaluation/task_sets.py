"""Task sets: JSON Lines files of questions a variant answers, read and checked before any model runs,
and each set as an lm-eval task (so lm-eval runs it like any of its own).

Three kinds, one row per line (every key required, no others):
- qa: {"id": "qa-001", "question": "...", "answers": ["Paris"]}. Generated (through the model's chat
  template when it has one); right when the reply contains one of the answers, ignoring case.
- choice: {"id": "cls-001", "prompt": "...", "choices": [" positive", " negative"], "label": 1}.
  lm-eval's multiple choice: the choice whose text (continuing the prompt as written; begin it with
  a space where one belongs) is most likely under the model. Works for base models too.
- instruct: {"id": "sum-01", "instruction": "Summarize ..."}. Generated; scored against the
  reference model's own reply (ROUGE-L), as there is no single right text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.core.errors import StageError

KINDS = ("qa", "choice", "instruct")
Kind = Literal["qa", "choice", "instruct"]


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    id: str = Field(min_length=1)


class QaRow(_Row):
    question: str = Field(min_length=1)
    answers: list[str] = Field(min_length=1)

    @field_validator("answers")
    @classmethod
    def _answers_have_text(cls, answers: list[str]) -> list[str]:
        if any(not answer.strip() for answer in answers):
            raise ValueError("an empty answer matches every reply; give each answer some text")
        return answers


class ChoiceRow(_Row):
    prompt: str = Field(min_length=1)
    choices: list[str] = Field(min_length=2)
    label: int

    @model_validator(mode="after")
    def _label_is_a_choice(self) -> ChoiceRow:
        if not 0 <= self.label < len(self.choices):
            raise ValueError(f"label {self.label} is not an index of its {len(self.choices)} choices (0-based)")
        if len(set(self.choices)) != len(self.choices):
            raise ValueError("two choices are the same text; the model could not tell them apart")
        return self


class InstructRow(_Row):
    instruction: str = Field(min_length=1)


ROWS: dict[str, type[_Row]] = {"qa": QaRow, "choice": ChoiceRow, "instruct": InstructRow}
# What a generated reply may run to, per kind: a one-line answer, a sentence or a short paragraph.
MAX_NEW_TOKENS = {"qa": 32, "instruct": 96}


@dataclass(frozen=True)
class TaskSet:
    name: str
    kind: Kind
    path: Path
    rows: tuple[_Row, ...]

    @property
    def lm_eval_name(self) -> str:
        """The set's task name in lm-eval (its results and samples are keyed by it)."""
        return f"ortforge_{self.name}"

    @property
    def generated(self) -> bool:
        return self.kind != "choice"

    def lm_eval_config(self, chat: bool) -> dict:
        """This set as an lm-eval task config (the file read through datasets' json loader).

        chat: the prompt goes through the model's chat template (simple_evaluate's
        apply_chat_template), so it is the bare question; without one a plain prompt asks for it."""
        config = {
            "task": self.lm_eval_name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(self.path.resolve())}},
            "test_split": "test",
            "metadata": {"version": 1},
        }
        if self.kind == "choice":
            return config | {
                "output_type": "multiple_choice",
                "doc_to_text": "{{prompt}}",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{label}}",
                "target_delimiter": "",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            }
        field = "question" if self.kind == "qa" else "instruction"
        text = f"{{{{{field}}}}}" if chat else f"Question: {{{{{field}}}}}\nAnswer:"
        return config | {
            "output_type": "generate_until",
            "doc_to_text": text,
            "doc_to_target": "{{answers[0]}}" if self.kind == "qa" else "",
            "generation_kwargs": {
                "until": ["\n\n"] if chat else ["\n\n", "\nQuestion:"],
                "max_gen_toks": MAX_NEW_TOKENS[self.kind],
                "do_sample": False,
            },
            "metric_list": [
                {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True, "ignore_case": True}
            ],
        }


def load(name: str, kind: str, path: Path) -> TaskSet:
    """The set's rows, every one checked; StageError naming the file, line and fix on the first bad one."""
    if kind not in KINDS:
        raise StageError(f"task set {name}: kind {kind!r} is not one of {', '.join(KINDS)}")
    path = Path(path)
    if not path.is_file():
        raise StageError(f"task set {name}: {path} does not exist; point its path at a JSON Lines file")
    rows, seen = [], set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = _row(ROWS[kind], line, f"{path}:{number}")
        if row.id in seen:
            raise StageError(f"{path}:{number}: id {row.id!r} appears twice; give each row its own id")
        seen.add(row.id)
        rows.append(row)
    if not rows:
        raise StageError(f"task set {name}: {path} has no rows")
    return TaskSet(name, kind, path, tuple(rows))


def _row(model: type[_Row], line: str, where: str) -> _Row:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise StageError(f"{where}: not JSON ({error.msg}); write one JSON object per line") from None
    if not isinstance(data, dict):
        raise StageError(f"{where}: a JSON {type(data).__name__}, not an object; write one object per line")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "row"
        fields = ", ".join(model.model_fields)
        raise StageError(
            f"{where}: {field}: {first['msg']} (a {model.__name__[:-3].lower()} row has {fields})"
        ) from None

"""Task A/B: a variant's answers on the task sets, scored and set beside the reference model's.

answers() runs the sets on one artifact through lm-eval (tasks/evaluation/lm_eval_model.py);
compare() scores a variant's answers against the rows' right answers and against the reference's
own answers, with intervals (tasks/evaluation/task_scores.py); gate() says which task gates fail.
The reference is the model's fp32 variant, which validate holds to PyTorch's logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tasks.evaluation import task_scores as scores
from tasks.evaluation.task_sets import TaskSet, load

log = logging.getLogger(__name__)

TASK_DIR = Path("data/tasks")
# The sets the project ships (name, kind, file): 100 trivia questions, 100 multiple-choice items of
# four kinds, 40 instructions (mostly one-sentence summaries).
SHIPPED = (
    ("chat_qa", "qa", "chat_qa.jsonl"),
    ("classify", "choice", "classify.jsonl"),
    ("summarize", "instruct", "summarize.jsonl"),
)


@dataclass(frozen=True)
class TaskGates:
    """A goal variant keeps this share of the reference's score on every scored set (qa, choice) and
    picks the reference's own choice this often; set before any variant was measured."""

    min_score_retention: float = 0.95
    min_choice_agreement: float = 0.90


def shipped_sets(root: Path = Path(".")) -> list[TaskSet]:
    return [load(name, kind, root / TASK_DIR / file) for name, kind, file in SHIPPED]


def has_chat_template(folder: Path) -> bool:
    from ortforge.chat import chat_template

    try:
        chat_template(folder)
    except ValueError:
        return False
    return True


def answers(folder: Path, sets: list[TaskSet]) -> dict[str, dict[str, object]]:
    """Each set's answers by row id: the reply (generated sets), or the index of the most likely
    choice (choice sets). Generated sets go through the chat template when the model has one."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tasks.evaluation.lm_eval_model import ArtifactLM

    model = ArtifactLM(folder)
    chat = has_chat_template(folder)
    # The sets are given as configs: indexing lm-eval's thousands of bundled tasks would take seconds.
    manager = TaskManager(include_defaults=False)
    found: dict[str, dict[str, object]] = {}
    for through_chat, group in (
        (chat, [s for s in sets if s.generated]),
        (False, [s for s in sets if not s.generated]),
    ):
        if not group:
            continue
        results = lm_eval.simple_evaluate(
            model=model,
            tasks=[task.lm_eval_config(through_chat) for task in group],
            apply_chat_template=through_chat,
            task_manager=manager,
            log_samples=True,
            bootstrap_iters=0,
            verbosity="WARNING",
        )
        for task in group:
            samples = sorted(results["samples"][task.lm_eval_name], key=lambda sample: sample["doc_id"])
            found[task.name] = {sample["doc"]["id"]: _answer(task, sample) for sample in samples}
    return found


def _answer(task: TaskSet, sample: dict) -> object:
    if task.generated:
        return sample["filtered_resps"][0]
    likelihoods = [float(response[0]) for response in sample["filtered_resps"]]
    return max(range(len(likelihoods)), key=likelihoods.__getitem__)


def compare(task: TaskSet, variant: dict[str, object], reference: dict[str, object]) -> dict:
    """The variant's scores on one set, the reference's beside them, and how often they agree."""
    ids = [row.id for row in task.rows]
    missing = [row_id for row_id in ids if row_id not in variant or row_id not in reference]
    if missing:
        raise ValueError(f"task set {task.name}: no answer for {', '.join(missing[:3])}; run both on the same set")
    if task.kind == "instruct":
        similarity = [scores.rouge_l(str(variant[i]), str(reference[i])) for i in ids]
        return {
            "kind": task.kind,
            "rouge_l_to_reference": scores.bootstrap_mean(similarity).record(),
            "identical_to_reference": _identical(variant, reference, ids).record(),
        }
    right_variant, right_reference = _right(task, variant), _right(task, reference)
    found = {
        "kind": task.kind,
        "score": scores.share(right_variant).record(),
        "reference_score": scores.share(right_reference).record(),
        "difference": scores.paired_difference(right_variant, right_reference).record(),
        "retention": _retention(right_variant, right_reference),
    }
    if task.kind == "choice":
        return found | {"agreement": scores.share([variant[i] == reference[i] for i in ids]).record()}
    return found | {"identical_to_reference": _identical(variant, reference, ids).record()}


def _right(task: TaskSet, answered: dict[str, object]) -> list[bool]:
    if task.kind == "choice":
        return [answered[row.id] == row.label for row in task.rows]
    return [scores.contains_answer(str(answered[row.id]), row.answers) for row in task.rows]


def _retention(variant: list[bool], reference: list[bool]) -> float | None:
    """The variant's score as a share of the reference's (None when the reference scored nothing)."""
    return sum(variant) / sum(reference) if sum(reference) else None


def _identical(variant: dict, reference: dict, ids: list[str]) -> scores.Score:
    return scores.share([scores.normalize(str(variant[i])) == scores.normalize(str(reference[i])) for i in ids])


def gate(compared: dict[str, dict], gates: TaskGates) -> list[str]:
    """Each failed task gate as "<set> <measure> <value> < <limit>"; empty when all pass."""
    failed = []
    for name, found in compared.items():
        retention = found.get("retention")
        if retention is not None and retention < gates.min_score_retention:
            failed.append(f"{name} score retention {retention:.3f} < {gates.min_score_retention}")
        agreement = found.get("agreement")
        if agreement is not None and agreement["value"] < gates.min_choice_agreement:
            failed.append(f"{name} agreement {agreement['value']:.3f} < {gates.min_choice_agreement}")
    return failed

"""Task A/B: a variant's answers on the task sets, scored and set beside the reference model's.

answers() runs the sets on one artifact through lm-eval (tasks/evaluation/lm_eval_model.py);
record() scores them against the rows' right answers, with intervals (tasks/evaluation/task_scores.py):
what the evaluate stage writes. tasks/reporting/task_ab.py compares the records with the reference's.
The reference is the variant params.yaml `tasks.reference` names (fp32, which validate holds to
PyTorch's logits).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from tasks.core.params import TasksConfig
from tasks.evaluation import task_scores as scores
from tasks.evaluation.task_sets import TaskSet, load

log = logging.getLogger(__name__)


def sets_of(cfg: TasksConfig, root: Path = Path(".")) -> list[TaskSet]:
    """The sets params.yaml `tasks` names (paths relative to root, the repository), each row
    checked (a bad one stops here, naming its line), cut to `tasks.limit` rows when set."""
    found = [load(name, spec.kind, Path(root) / spec.file) for name, spec in cfg.sets.items()]
    return [replace(task, rows=task.rows[: cfg.limit]) for task in found] if cfg.limit else found


def has_chat_template(folder: Path) -> bool:
    from ortforge.chat import chat_template

    try:
        chat_template(folder)
    except ValueError:
        return False
    return True


def answers(folder: Path, sets: list[TaskSet]) -> dict[str, dict[str, object]]:
    """Each set's answers by row id: the reply (generated sets), or the index of the most likely
    choice (choice sets). Generated sets go through the chat template when the model has one. Every
    set runs whole, or its first rows when sets_of cut it."""
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
            limit=max(len(task.rows) for task in group),
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


def record(task: TaskSet, answered: dict[str, object]) -> dict:
    """One set's answers as evaluate writes them: by row id in the set's order, whether each is
    right (scored kinds), and the score with its count and interval."""
    missing = [row.id for row in task.rows if row.id not in answered]
    if missing:
        raise ValueError(f"task set {task.name}: no answer for {', '.join(missing[:3])}")
    found = {
        "kind": task.kind,
        "file": task.path.as_posix(),
        "items": len(task.rows),
        "answers": {row.id: answered[row.id] for row in task.rows},
    }
    if task.kind == "instruct":  # no single right text: scored against the reference's reply
        return found
    right = {row.id: _is_right(task, row, answered[row.id]) for row in task.rows}
    return found | {"right": right, "score": scores.share(list(right.values())).record()}


def _is_right(task: TaskSet, row, answer: object) -> bool:
    if task.kind == "choice":
        return answer == row.label
    return scores.contains_answer(str(answer), row.answers)

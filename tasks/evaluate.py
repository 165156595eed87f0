"""Task A/B, one variant: its answers to the task sets params.yaml `tasks` names, run by lm-eval
over the runtime with the settings bench chose for it (what `ortforge generate` and `serve` deploy).

Reads artifacts/<model>/variants/<variant> (validated: a failed variant is never evaluated) and its
runtime.json, and the sets under data/tasks (tasks/evaluation/task_sets.py has their schema; every
row is checked before the model loads); writes reports/<model>/variants/<variant>/tasks.json: every
answer by set and row id, each scored set's score with its count and 95% interval, and what ran
(the chat template or a plain prompt, the session settings). The report compares each variant's
answers with those of `tasks.reference` and applies the task gates (tasks/report.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ortforge.manifest import check_validated
from ortforge.session import SessionSettings
from tasks.core import paths, resources
from tasks.core.files import atomic_write_json
from tasks.core.params import TasksConfig
from tasks.core.stage import StageError, stage_cli
from tasks.evaluation import task_eval

log = logging.getLogger(__name__)

# What a task's longest prompt may hold in logits at once: lm-eval's loglikelihood keeps one
# continuation's rows, generation the last position's.
LOGITS_ROWS = 64


def run(cfg: TasksConfig, variant_dir: Path) -> dict:
    try:
        check_validated(variant_dir)
    except ValueError as error:
        raise StageError(f"{error}; only validated variants are evaluated (dvc repro validate@...)") from None
    sets = task_eval.sets_of(cfg)
    started = time.perf_counter()
    answered = task_eval.answers(variant_dir, sets)
    seconds = time.perf_counter() - started
    log.info("answered %d items in %.0f s", sum(len(a) for a in answered.values()), seconds)
    return {
        "sets": {task.name: task_eval.record(task, answered[task.name]) for task in sets},
        "chat_template": task_eval.has_chat_template(variant_dir),
        "session": SessionSettings.for_artifact(variant_dir).to_dict(),
        "seconds": round(seconds, 1),
    }


def needs(a) -> resources.Needs:
    return resources.runtime_needs(a.paths["variant-dir"], LOGITS_ROWS, "task answers")


def main(argv: list[str] | None = None) -> int:
    flags = {"variant-dir": paths.variant_dir, "report": paths.tasks_json}

    def body(a):
        atomic_write_json(a.paths["report"], run(a.params.tasks, a.paths["variant-dir"]))

    return stage_cli("evaluate", __doc__, flags, body, argv, variant=True, needs=needs)


if __name__ == "__main__":
    raise SystemExit(main())

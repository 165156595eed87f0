"""The task A/B in the report: each variant's answers (evaluate's tasks.json) set beside those of
`tasks.reference`, per set its score with a 95% interval, the paired difference ("noise" when its
interval holds 0), agreement with the reference's answers, and the task gate (goal variants gated,
comparison points shown against the same limits)."""

from __future__ import annotations

from pathlib import Path

from tasks.core.errors import StageError
from tasks.core.files import read_json
from tasks.core.params import TaskGatesConfig, TasksConfig
from tasks.evaluation import task_scores as scores

TASKS_FILE = "tasks.json"


def read_answers(reports_dir: Path, variants: list[str]) -> dict[str, dict]:
    """Each variant's tasks.json; a missing one names the stage that writes it."""
    found = {}
    for variant in variants:
        try:
            found[variant] = read_json(reports_dir / variant / TASKS_FILE)
        except FileNotFoundError:
            raise StageError(
                f"{reports_dir / variant / TASKS_FILE} is missing; run `dvc repro` to evaluate {variant} on the tasks"
            ) from None
    return found


def compare(answers: dict[str, dict], validations: dict[str, dict], cfg: TasksConfig) -> dict:
    """report.json's `tasks`: the sets, the gates, and per variant its comparison with the
    reference and the task gates it fails. No reference answers (it failed validation or is not
    built): every variant's scores, and `reference` None."""
    reference = answers.get(cfg.reference)
    shown = reference or next(iter(answers.values()))
    sets = {name: {key: found[key] for key in ("kind", "file", "items")} for name, found in shown["sets"].items()}
    variants = {}
    for variant, found in answers.items():
        role = "reference" if variant == cfg.reference else validations[variant]["role"]
        entry = {"role": role, "ppl_ratio": validations[variant]["ppl_ratio"], "chat_template": found["chat_template"]}
        if reference is not None:
            entry["tasks"] = {name: compare_set(found["sets"][name], reference["sets"][name]) for name in sets}
            entry["task_gate_failures"] = [] if role == "reference" else gate(entry["tasks"], cfg.gates)
        else:
            entry["scores"] = {name: found["sets"][name].get("score") for name in sets}
        variants[variant] = entry
    return {
        "reference": cfg.reference if reference is not None else None,
        "gates": cfg.gates.model_dump(),
        "sets": sets,
        "variants": variants,
    }


def compare_set(variant: dict, reference: dict) -> dict:
    """A variant's set record (record()) beside the reference's on the same set: the scores, the
    paired difference, the share kept, and how often the answers agree."""
    ids = list(reference["answers"])
    missing = [row_id for row_id in ids if row_id not in variant["answers"]]
    if missing or variant["kind"] != reference["kind"]:
        raise ValueError(f"no answer for {', '.join(missing[:3]) or 'its kind'}; run both on the same set")
    ours, theirs = variant["answers"], reference["answers"]
    if variant["kind"] == "instruct":
        similarity = [scores.rouge_l(str(ours[i]), str(theirs[i])) for i in ids]
        return {
            "kind": variant["kind"],
            "rouge_l_to_reference": scores.bootstrap_mean(similarity).record(),
            "identical_to_reference": _identical(ours, theirs, ids).record(),
        }
    right_variant = [variant["right"][i] for i in ids]
    right_reference = [reference["right"][i] for i in ids]
    found = {
        "kind": variant["kind"],
        "score": scores.share(right_variant).record(),
        "reference_score": scores.share(right_reference).record(),
        "difference": scores.paired_difference(right_variant, right_reference).record(),
        "retention": _retention(right_variant, right_reference),
    }
    if variant["kind"] == "choice":
        return found | {"agreement": scores.share([ours[i] == theirs[i] for i in ids]).record()}
    return found | {"identical_to_reference": _identical(ours, theirs, ids).record()}


def _retention(variant: list[bool], reference: list[bool]) -> float | None:
    """The variant's score as a share of the reference's (None when the reference scored nothing)."""
    return sum(variant) / sum(reference) if sum(reference) else None


def _identical(variant: dict, reference: dict, ids: list[str]) -> scores.Score:
    return scores.share([scores.normalize(str(variant[i])) == scores.normalize(str(reference[i])) for i in ids])


def gate(compared: dict[str, dict], gates: TaskGatesConfig) -> list[str]:
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


def passes(comparison: dict, variant: str) -> bool:
    """Whether the variant passes the task gate (the reference passes its own)."""
    return comparison["reference"] is not None and not comparison["variants"][variant]["task_gate_failures"]


def _share(score: dict) -> str:
    return f"{100 * score['value']:.0f}% [{100 * score['low']:.0f}, {100 * score['high']:.0f}]"


def _difference(found: dict) -> str:
    difference = found["difference"]
    sign = "+" if difference["value"] >= 0 else ""
    return f"{sign}{100 * difference['value']:.0f}{' (noise)' if difference['within_noise'] else ''}"


def _gate(entry: dict) -> str:
    if entry["role"] == "reference":
        return "reference"
    failures = entry["task_gate_failures"]
    verdict = ("fails: " + "; ".join(failures)) if failures else "passes"
    return verdict + (" (comparison)" if entry["role"] == "comparison" else "")


def table(comparison: dict, order: list[str] | None = None) -> str:
    """One row per variant (in `order` when given: report.json's keys are sorted): perplexity beside
    each set's score, its interval, its difference from the reference (points) and agreement, and
    the task gate. The shipped kinds' columns: one set of each kind (qa, choice, instruct), the
    first of its kind."""
    names = {}
    for name, entry in comparison["sets"].items():
        names.setdefault(entry["kind"], name)
    qa, choice, instruct = (names.get(kind) for kind in ("qa", "choice", "instruct"))
    header = ["variant", "ppl ratio"]
    if qa:
        header += [f"{qa}: right [95% CI]", "vs reference", "same reply"]
    if choice:
        header += [f"{choice}: accuracy [95% CI]", "vs reference", "same choice"]
    if instruct:
        header += [f"{instruct}: ROUGE-L to reference"]
    header += ["task gate"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    shown = [variant for variant in order or comparison["variants"] if variant in comparison["variants"]]
    for variant in shown:
        entry = comparison["variants"][variant]
        tasks = entry["tasks"]
        cells = [variant, f"x{entry['ppl_ratio']:.3f}"]
        if qa:
            cells += [_share(tasks[qa]["score"]), _difference(tasks[qa]), _share(tasks[qa]["identical_to_reference"])]
        if choice:
            found = tasks[choice]
            cells += [_share(found["score"]), _difference(found), _share(found["agreement"])]
        if instruct:
            rouge = tasks[instruct]["rouge_l_to_reference"]
            cells += [f"{rouge['value']:.2f} [{rouge['low']:.2f}, {rouge['high']:.2f}]"]
        cells.append(_gate(entry))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(comparison: dict) -> list[str]:
    """The report's task section: what was asked, the table (or why there is none), the gates."""
    sets = ", ".join(f"{name} ({entry['items']} {entry['kind']} items)" for name, entry in comparison["sets"].items())
    lines = ["", "## Task A/B", "", f"Every passing variant answered the task sets {sets} (lm-eval over the runtime)."]
    if comparison["reference"] is None:
        scored = {v: e["scores"] for v, e in comparison["variants"].items()}
        lines += [
            "",
            "No reference answers to compare with (its variant did not pass validation or is not built), so no "
            "task gate applies. Scores (share right):",
            "",
        ]
        lines += [
            f"- {variant}: "
            + ", ".join(f"{name} {_share(score)}" for name, score in found.items() if score is not None)
            for variant, found in scored.items()
        ]
        return lines
    gates = comparison["gates"]
    lines += [
        f"Each score has its count's 95% interval (Wilson for shares, bootstrap for ROUGE-L); vs reference: the "
        f'difference from {comparison["reference"]} in points, "noise" where its paired bootstrap interval holds 0; '
        f"same: the share of answers equal to {comparison['reference']}'s. Task gate: a goal variant keeps "
        f"{gates['min_score_retention']:.0%} of the reference's score on each scored set and picks its choice "
        f"{gates['min_choice_agreement']:.0%} of the time (comparison points are shown against the same limits).",
        "",
        table(comparison),
    ]
    return lines

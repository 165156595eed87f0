"""Task A/B: every built variant of a model against its fp32 reference on the shipped task sets
(data/tasks: chat QA, multiple-choice classification, instructions), through lm-eval over the
runtime, with each score's count and 95% interval, agreement with the reference's own answers, and
the task gates (tasks/evaluation/task_eval.py), beside validate's perplexity ratio.

    python benchmarks/task_ab.py [--model smollm2-135m] [--variants int8 int4]

Needs `dvc repro` first. Writes benchmarks/results/task_ab-<model>.json (every answer, so a score
can be checked by reading them) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from benchmarks.continuations import built_variants  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.core.params import load_params  # noqa: E402
from tasks.evaluation import task_eval  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
REFERENCE = "fp32"


def result_file(model: str) -> Path:
    return RESULTS / f"task_ab-{model}.json"


def ppl_ratio(model: str, variant: str) -> float | None:
    report = REPO / paths.validate_json(model, variant)
    return json.loads(report.read_text(encoding="utf-8")).get("ppl_ratio") if report.is_file() else None


def measure(model: str, variants: list[str]) -> dict:
    sets = task_eval.shipped_sets(REPO)
    gates = task_eval.TaskGates()
    params = load_params(REPO / "params.yaml")
    found = {}
    for variant in [REFERENCE, *[v for v in variants if v != REFERENCE]]:
        started = time.perf_counter()
        answered = task_eval.answers(REPO / paths.variant_dir(model, variant), sets)
        found[variant] = {"answers": answered, "seconds": round(time.perf_counter() - started, 1)}
        print(f"  {variant}: answered {sum(len(a) for a in answered.values())} items in {found[variant]['seconds']} s")
    reference = found[REFERENCE]["answers"]
    for variant, entry in found.items():
        compared = {
            task.name: task_eval.compare(task, entry["answers"][task.name], reference[task.name]) for task in sets
        }
        comparison = variant == REFERENCE or params.is_comparison(variant)
        entry |= {
            "ppl_ratio": ppl_ratio(model, variant),
            "role": "reference" if variant == REFERENCE else "comparison" if comparison else "goal",
            "tasks": compared,
            "task_gate_failures": task_eval.gate(compared, gates),
        }
    return {
        "sets": {
            task.name: {"kind": task.kind, "file": task.path.relative_to(REPO).as_posix(), "items": len(task.rows)}
            for task in sets
        },
        "gates": vars(gates),
        "reference": REFERENCE,
        "variants": found,
    }


def _share(score: dict) -> str:
    return f"{100 * score['value']:.0f}% [{100 * score['low']:.0f}, {100 * score['high']:.0f}]"


def _difference(found: dict) -> str:
    difference = found["difference"]
    sign = "+" if difference["value"] >= 0 else ""
    return f"{sign}{100 * difference['value']:.0f}{' (noise)' if difference['within_noise'] else ''}"


def shown_order(report: dict) -> list[str]:
    """The reference, then the variants in params.yaml's order (the result file's keys are sorted)."""
    measured = report["variants"]
    # params.yaml's order, not what is built here: the README renders the same on a fresh clone
    in_params = load_params(REPO / "params.yaml").variants_of(report["model"])
    listed = [v for v in in_params if v in measured and v != report["reference"]]
    return [report["reference"], *listed, *sorted(set(measured) - set(listed) - {report["reference"]})]


def table(report: dict) -> str:
    """One row per variant: perplexity beside each set's score, its interval, its difference from
    the reference (points; "noise" when the interval holds 0) and agreement, and the task gate."""
    names = {kind: name for name, entry in report["sets"].items() for kind in [entry["kind"]]}
    qa, choice, instruct = names["qa"], names["choice"], names["instruct"]
    lines = [
        f"| variant | ppl ratio | {qa}: right [95% CI] | vs reference | same reply | {choice}: accuracy [95% CI] "
        f"| vs reference | same choice | {instruct}: ROUGE-L to reference | task gate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in shown_order(report):
        entry = report["variants"][variant]
        tasks = entry["tasks"]
        ratio = "" if entry["ppl_ratio"] is None else f"x{entry['ppl_ratio']:.3f}"
        rouge = tasks[instruct]["rouge_l_to_reference"]
        if entry["role"] == "reference":
            gate = "reference"
        else:
            failures = entry["task_gate_failures"]
            gate = ("fails: " + "; ".join(failures)) if failures else "passes"
            gate += " (comparison)" if entry["role"] == "comparison" else ""
        lines.append(
            f"| {variant} | {ratio} | {_share(tasks[qa]['score'])} | {_difference(tasks[qa])} "
            f"| {_share(tasks[qa]['identical_to_reference'])} | {_share(tasks[choice]['score'])} "
            f"| {_difference(tasks[choice])} | {_share(tasks[choice]['agreement'])} "
            f"| {rouge['value']:.2f} [{rouge['low']:.2f}, {rouge['high']:.2f}] | {gate} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", nargs="*", help="default: every validated variant the model builds")
    args = parser.parse_args(argv)
    variants = args.variants or built_variants(args.model)
    if REFERENCE not in built_variants(args.model):
        raise SystemExit(f"error: {args.model} has no validated {REFERENCE} variant to compare against; build it first")
    measured = provenance.model_outputs(args.model, sorted({REFERENCE, *variants}))
    provenance.require_current(measured)
    report = {"provenance": provenance.record(provenance.command("task_ab.py", argv), measured), "model": args.model}
    report |= measure(args.model, variants)
    out = result_file(args.model)
    atomic_write_json(out, report)
    print(table(report))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

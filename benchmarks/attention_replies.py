"""Does ortforge's attention kernel change what a model says? Greedy replies to the chat QA
questions from each variant and its twin on the kernel (the same recipe with `attention:
ortforge`), compared token for token, beside each variant's chat QA score from the evaluate stage.

fp32 shows the kernel itself: nothing between it and the logits rounds, so a reply may part only
where the kernel's ~1e-6 difference from onnxruntime's tips a near tie. w8a8 shows what rounding
makes of that difference: a per-token activation code moves now and then, and a reply that parts
goes right or wrong as a coin would. The fp32 twin is built here into a scratch folder with the
quantize stage's own code (fp32 has no twin in params.yaml); w8a8's is the built w8a8_attn.

    python benchmarks/attention_replies.py [--model smollm2-135m] [--new-tokens 24]

Writes benchmarks/results/attention_replies[-<model>].json. It times nothing, but run it alone all
the same: it would slow a benchmark beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import load_peers, provenance  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json, read_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
QUESTIONS = REPO / "data" / "tasks" / "chat_qa.jsonl"
PAIRS = (("fp32", None), ("w8a8", "w8a8_attn"))  # None: the twin is built here


def replies(folder: Path, questions: list[str], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of each question (its plain tokens, no template: the kernel's effect
    is on the model, not on the prompt)."""
    from ortforge.generate import TextGenerator

    generator = TextGenerator(folder)
    return [generator.generate_ids(generator.tokenizer.encode(q).ids, new_tokens) for q in questions]


def fp32_twin(model: str, out: Path) -> Path:
    from tasks import quantize
    from tasks.quantization.configs import quantize_config

    base = paths.variant_dir(model, "fp32").parents[1]
    quantize.run(quantize_config(method="fp32", attention="ortforge"), base / "optimized", base / "hf", out, {})
    return out


def chat_qa_score(model: str, variant: str) -> float | None:
    report = paths.tasks_json(model, variant)
    return read_json(report)["sets"]["chat_qa"]["score"]["value"] if report.is_file() else None


def parting(ours: list[int], theirs: list[int]) -> int | None:
    """The first new token where two replies differ (one ending sooner counts); None when equal."""
    if ours == theirs:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    parted = [i for i in map(parting, ours, theirs) if i is not None]
    return {"questions": len(ours), "identical": len(ours) - len(parted), "first_parting_tokens": parted}


def result_name(model: str) -> str:
    return "attention_replies" if model == load_peers.DEFAULT_MODEL else f"attention_replies-{model}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=load_peers.DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    variants = [v for pair in PAIRS for v in pair if v]
    measured = [*provenance.model_outputs(args.model, variants), f"artifacts/{args.model}/optimized"]
    provenance.require_current(measured)
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line]
    pairs = {}
    with tempfile.TemporaryDirectory(prefix="ortforge-replies-") as scratch:
        for variant, twin in PAIRS:
            twin_folder = paths.variant_dir(args.model, twin) if twin else fp32_twin(args.model, Path(scratch) / "twin")
            found = compare(
                replies(twin_folder, questions, args.new_tokens),
                replies(paths.variant_dir(args.model, variant), questions, args.new_tokens),
            )
            scores = {name: chat_qa_score(args.model, name) for name in (variant, twin) if name}
            pairs[variant] = {"twin": twin or f"{variant} with attention: ortforge (built here)", **found}
            pairs[variant]["chat_qa_scores"] = scores
            print(f"  {variant}: {found['identical']} of {found['questions']} replies identical", flush=True)
    report = {
        "provenance": provenance.record(provenance.command("attention_replies.py", argv), measured),
        "model": args.model,
        "new_tokens": args.new_tokens,
        "questions_file": str(QUESTIONS.relative_to(REPO)),
        "pairs": pairs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / f"{result_name(args.model)}.json", report)
    print(table(report))
    return 0


def table(report: dict) -> str:
    lines = [
        "| variant | twin on ortforge's kernel | replies identical | first parting token, median | chat QA score |",
        "|---|---|---|---|---|",
    ]
    for variant, found in report["pairs"].items():
        parted = sorted(found["first_parting_tokens"])
        median = f"{parted[len(parted) // 2]}" if parted else "-"
        scores = " / ".join(f"{s:.0%}" if s is not None else "-" for s in found["chat_qa_scores"].values())
        lines.append(
            f"| {variant} | {found['twin']} | {found['identical']} of {found['questions']} | {median} | {scores} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

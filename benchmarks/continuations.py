"""Greedy continuations of one prompt by every built variant of a model, as `ortforge generate`
prints them (each variant with the settings bench tuned for it): a variant's quality in words,
beside the report's figures.

    python benchmarks/continuations.py [--model gemma3-270m] [--prompt "The capital of France is"]
                                       [--max-new-tokens 24]

Needs `dvc repro` first. Writes benchmarks/results/continuations-<model>.json (with its provenance)
and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.core.params import load_params  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def built_variants(model: str) -> list[str]:
    """The variants params.yaml builds for model that passed validation, in params.yaml's order."""
    builds = load_params(REPO / "params.yaml").builds.values()
    names = [build.variant for build in builds if build.model == model]
    return [name for name in names if paths.validation_stamp(model, name).is_file()]


def continuation(folder: Path, prompt: str, max_new_tokens: int) -> str:
    """What `ortforge generate <folder> <prompt> --max-new-tokens N` prints (greedy)."""
    from ortforge.generate import TextGenerator

    return TextGenerator(folder).generate(prompt, max_new_tokens)


def table(report: dict) -> str:
    lines = ["| variant | continuation |", "|---|---|"]
    for variant, text in report["continuations"].items():
        shown = " ".join(text.split()).replace("|", "\\|")
        lines.append(f"| {variant} | {shown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    variants = built_variants(args.model)
    if not variants:
        raise SystemExit(f"error: no validated variant of {args.model}; run `ortforge build --model {args.model}`")
    measured = provenance.model_outputs(args.model, variants)
    provenance.require_current(measured)
    report = {
        "provenance": provenance.record(provenance.command("continuations.py", argv), measured),
        "model": args.model,
        "prompt": args.prompt,
        "max_new_tokens": args.max_new_tokens,
        "continuations": {},
    }
    for variant in variants:
        print(f"  {variant}", flush=True)
        folder = paths.variant_dir(args.model, variant)
        report["continuations"][variant] = continuation(folder, args.prompt, args.max_new_tokens)
    out = RESULTS / f"continuations-{args.model}.json"
    atomic_write_json(out, report)
    print(table(report))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The custom-op route of issue 23, end to end: a variant whose GroupQueryAttention nodes run
ortforge's kernel (benchmarks/csrc: gqa.c as the onnxruntime custom op ai.ortforge
GroupQueryAttention) against the same variant as built, under issue 23's load, in one run.

The copy differs from the artifact in one thing: its attention nodes' domain (ai.ortforge, same
inputs, outputs and attributes), so their kernel is the only change. Before timing, the copy goes
through the validate stage's gates against the original model, with the variant's own limits; the
result holds its figures beside those the variant as built recorded. (Compared with each other
directly, the two differ more than their kernels do: w8a8 quantizes activations per token, so a
difference of 1e-7 in an attention output can move a code across a rounding boundary; the fp32
variant's logits differ by 4e-5.) The build does not make such variants yet, and the
runtime does not load custom ops: this script adds the compiled library to the session options in
its own measuring processes. Each engine runs with the settings the runtime gives the artifact on
this CPU.

    python benchmarks/attention_op.py [--model smollm2-135m] [--variant w8a8] [--streams 1,8]
                                      [--rounds 2]

Writes benchmarks/results/attention_op[-<model>].json. Needs a C compiler and the built variant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import attention_kernel, load_peers, provenance  # noqa: E402
from ortforge import names  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json, read_json  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DOMAIN = "ai.ortforge"  # ort_op.c's
STOCK, OURS = "onnxruntime's attention", "ortforge's attention"


def rewrite(folder: Path, out: Path) -> int:
    """A copy of the artifact in `out` whose com.microsoft GroupQueryAttention nodes are ai.ortforge's;
    how many it moved. Weights are hard-linked where the file system allows (onnxruntime refuses
    weights behind a symbolic link)."""
    import onnx

    model = onnx.load(str(folder / names.MODEL_FILE), load_external_data=False)
    moved = 0
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            if len([name for name in node.input if name]) != 9 or any(node.input[9:]):
                raise SystemExit(f"error: {node.name} has inputs beyond the nine ai.ortforge's kernel takes")
            del node.input[9:]
            node.domain = DOMAIN
            moved += 1
    if not moved:
        raise SystemExit(f"error: {folder} has no GroupQueryAttention node to move (an optimum export?)")
    model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    out.mkdir(parents=True)
    for path in folder.iterdir():
        if path.is_file() and path.name != names.MODEL_FILE:
            try:
                os.link(path, out / path.name)
            except OSError:
                shutil.copyfile(path, out / path.name)
    onnx.save(model, str(out / names.MODEL_FILE))
    return moved


def _load_library(library: str) -> None:
    """In a measuring process: every session the runtime makes also loads the library."""
    from ortforge.session import SessionSettings

    plain = SessionSettings.session_options

    def session_options(self):
        options = plain(self)
        options.register_custom_ops_library(library)
        return options

    SessionSettings.session_options = session_options


def measure_load(library: str, folder: str, prompts: list, new_tokens: int) -> dict:
    from tasks.measurement import concurrency

    _load_library(library)
    found = concurrency.measure_load(folder, prompts, new_tokens, None, 0)
    return {name: found[name] for name in load_peers.FIGURES}


def first_token(library: str, folder: str, prompt: list[int], repeats: int) -> list[float]:
    from benchmarks import engines

    _load_library(library)
    return engines.measure({"kind": "ort", "path": folder, "tuned": True}, prompt, 2, 1, repeats)["first_token_s"]


def validation(library: str, model: str, variant: str, folder: str) -> dict:
    """The validate stage's gates on the copy (its figures against the original model's reference,
    the variant's own limits): whether it passes, and each gated figure."""
    from tasks.core.params import load_params
    from tasks.validate import Asked, Reference, checks, measure, measure_coverage

    _load_library(library)
    params = load_params(REPO / paths.PARAMS)
    asked = Asked.from_params(params, model, variant)
    figures = measure(Path(folder), Reference.load(paths.reference_dir(model)), params.validation.eval)
    figures["coverage"] = measure_coverage(Path(folder), asked.recipe)
    found = checks(figures, asked)
    return {"passed": all(c.passed for c in found), "checks": {c.name: c.value for c in found}}


def gated(report: dict) -> dict:
    """The same gates as validate.json recorded them for the variant as built."""
    return {name: check["value"] for name, check in report["checks"].items()}


def measure(library: Path, engines: dict[str, str], ids: list[int], args) -> dict:
    """Each engine's load figures per stream count and batch-1 first tokens, the engines
    alternating within each round."""
    from benchmarks import attention_op as here  # by module name: the measuring processes import it

    counts = args.streams.split(",")
    load = {name: {s: [] for s in counts} for name in engines}
    first = {name: {str(t): [] for t in (args.prompt_tokens, args.long_prompt)} for name in engines}
    for round_index in range(args.rounds):
        for streams in counts:
            prompts = load_peers.stream_prompts(ids, int(streams), args.requests, args.prompt_tokens)
            for name, folder in engines.items():
                found = in_fresh_process(here.measure_load, str(library), folder, prompts, args.new_tokens)
                load[name][streams].append(found)
                print(
                    f"  round {round_index + 1}, {streams} stream(s), {name}: "
                    f"{found['aggregate_tokens_per_second']:.1f} tok/s",
                    flush=True,
                )
        for tokens in first[next(iter(engines))]:
            for name, folder in engines.items():
                times = in_fresh_process(here.first_token, str(library), folder, ids[: int(tokens)], 3)
                first[name][tokens].append(float(np.median(times)))
    return {
        name: {
            "load": {s: load_peers.medians(runs) for s, runs in load[name].items()},
            "first_token_seconds": {t: float(np.median(v)) for t, v in first[name].items()},
        }
        for name in engines
    }


def table(report: dict) -> str:
    engines = report["engines"]
    lines = [
        "| attention kernel | streams | aggregate tok/s | first token ms p50 / p95 | inter-token ms p50 / p95 |",
        "|---|---|---|---|---|",
    ]
    for streams in report["streams"]:
        for name in (STOCK, OURS):
            f = engines[name]["load"][streams]
            lines.append(
                f"| {name} | {streams} | {f['aggregate_tokens_per_second']:.1f} | "
                f"{f['seconds_to_first_token_p50'] * 1e3:.0f} / {f['seconds_to_first_token_p95'] * 1e3:.0f} | "
                f"{f['inter_token_ms_p50']:.1f} / {f['inter_token_ms_p95']:.1f} |"
            )
    return "\n".join(lines)


def summary(report: dict) -> list[str]:
    engines, most = report["engines"], report["streams"][-1]

    def ratio(figure: str, streams: str) -> float:
        return engines[OURS]["load"][streams][figure] / engines[STOCK]["load"][streams][figure]

    validated = report["validation"]
    lines = [
        f"{most} streams: x{ratio('aggregate_tokens_per_second', most):.2f} the throughput, first token p95 "
        f"x{ratio('seconds_to_first_token_p95', most):.2f}, inter-token p95 x{ratio('inter_token_ms_p95', most):.2f}",
        f"1 stream: x{ratio('aggregate_tokens_per_second', '1'):.2f} the throughput",
    ]
    for tokens in engines[STOCK]["first_token_seconds"]:
        ours, stock = (engines[n]["first_token_seconds"][tokens] for n in (OURS, STOCK))
        lines.append(f"batch-1 first token of {int(tokens):,} tokens: {ours * 1e3:.0f} against {stock * 1e3:.0f} ms")
    checks = validated[OURS]["checks"]
    shown = ", ".join(
        f"{name} {checks[name]:.4g} (as built {validated[STOCK]['checks'][name]:.4g})"
        for name in sorted(checks)
        if "[" in name
    )
    lines.append(f"validate's gates on the copy: {'passed' if validated[OURS]['passed'] else 'FAILED'}; {shown}")
    return lines


def result_name(model: str) -> str:
    return "attention_op" if model == load_peers.DEFAULT_MODEL else f"attention_op-{model}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=load_peers.DEFAULT_MODEL)
    parser.add_argument("--variant", default="w8a8")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests each stream sends in turn")
    parser.add_argument("--long-prompt", type=int, default=2048, help="a long prompt's batch-1 first token")
    args = parser.parse_args(argv)
    if args.streams.split(",")[0] != "1":
        raise SystemExit("error: --streams must start with 1 (scaling is against one stream)")
    measured = provenance.model_outputs(args.model, [args.variant])
    provenance.require_current(measured)
    folder = paths.variant_dir(args.model, args.variant)
    ids = load_peers.token_ids(args.model)
    with tempfile.TemporaryDirectory(prefix="ortforge-attention-op-") as scratch:
        library = attention_kernel.compile_kernel(Path(scratch))
        copy = Path(scratch) / args.variant
        moved = rewrite(folder, copy)
        from benchmarks import attention_op as here  # by module name: the measuring process imports it

        validated = in_fresh_process(here.validation, str(library), args.model, args.variant, str(copy))
        print(f"  validate's gates on the copy: {validated}", flush=True)
        engines = {STOCK: str(folder), OURS: str(copy)}
        figures = measure(library, engines, ids, args)
    report = {
        "provenance": provenance.record(provenance.command("attention_op.py", argv), measured),
        "model": args.model,
        "variant": args.variant,
        "settings": provenance.settings_used(folder),
        "attention_nodes": moved,
        "compiler": attention_kernel.compiler_version(),
        "flags": list(attention_kernel.FLAGS),
        "cpus": os.cpu_count(),
        "streams": args.streams.split(","),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "requests_per_stream": args.requests,
        "rounds": args.rounds,
        "validation": {
            OURS: validated,
            STOCK: {"passed": True, "checks": gated(read_json(paths.validate_json(args.model, args.variant)))},
        },
        "engines": figures,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / f"{result_name(args.model)}.json", report)
    print(table(report), "\n".join(f"- {line}" for line in summary(report)), sep="\n\n")
    print(f"wrote {RESULTS / result_name(args.model)}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

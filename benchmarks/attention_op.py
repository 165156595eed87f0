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
                                      [--rounds 2] [--no-openvino]

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
from benchmarks.peers import openvino_peer  # noqa: E402
from benchmarks.side_by_side import quality  # noqa: E402
from ortforge import names  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json, read_json  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DOMAIN = "ai.ortforge"  # ort_op.c's
STOCK, OURS = "onnxruntime's attention", "ortforge's attention"


def rewrite(folder: Path, out: Path) -> int:
    """A copy of the artifact in `out` whose com.microsoft GroupQueryAttention nodes are ai.ortforge's,
    with the session settings and validation stamp that sit beside the artifact (so the runtime
    treats both alike); how many nodes it moved. Weights are hard-linked where the file system
    allows (onnxruntime refuses weights behind a symbolic link)."""
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
    for suffix in (names.RUNTIME_SUFFIX, names.VALIDATION_SUFFIX):  # its settings and its proof, beside it
        beside = folder.parent / f"{folder.name}{suffix}"
        if beside.is_file():
            shutil.copyfile(beside, out.parent / f"{out.name}{suffix}")
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


def under_load(library: Path, spec: dict, prompts: list, new_tokens: int, scratch: Path) -> dict:
    from benchmarks import attention_op as here  # by module name: the measuring processes import it

    if spec["kind"] == "openvino":
        return load_peers.under_load(spec, prompts, new_tokens, scratch)
    return in_fresh_process(here.measure_load, str(library), spec["path"], prompts, new_tokens)


def first_token_seconds(library: Path, spec: dict, prompt: list[int], scratch: Path) -> float:
    from benchmarks import attention_op as here

    if spec["kind"] == "openvino":
        return load_peers.first_token(spec, prompt, scratch)
    return float(np.median(in_fresh_process(here.first_token, str(library), spec["path"], prompt, 3)))


def openvino_int8(model: str) -> tuple[str, dict]:
    """OpenVINO GenAI's int8 export of the model at its CPU defaults: issue 23's yardstick for w8a8."""
    specs = load_peers.engines(model)
    for name, spec in specs.items():
        if spec["kind"] == "openvino" and spec["variant"] == "int8" and spec["precision"] == "default":
            return name, spec
    raise SystemExit("error: load_peers names no OpenVINO GenAI int8 engine")


def measure(library: Path, engines: dict[str, dict], ids: list[int], args, scratch: Path) -> dict:
    """Each engine's load figures per stream count and batch-1 first tokens, the engines
    alternating within each round."""
    counts = args.streams.split(",")
    load = {name: {s: [] for s in counts} for name in engines}
    first = {name: {str(t): [] for t in (args.prompt_tokens, args.long_prompt)} for name in engines}
    for round_index in range(args.rounds):
        for streams in counts:
            prompts = load_peers.stream_prompts(ids, int(streams), args.requests, args.prompt_tokens)
            for name, spec in engines.items():
                found = under_load(library, spec, prompts, args.new_tokens, scratch)
                load[name][streams].append(found)
                print(
                    f"  round {round_index + 1}, {streams} stream(s), {name}: "
                    f"{found['aggregate_tokens_per_second']:.1f} tok/s",
                    flush=True,
                )
        for tokens in first[next(iter(engines))]:
            for name, spec in engines.items():
                first[name][tokens].append(first_token_seconds(library, spec, ids[: int(tokens)], scratch))
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
        "| engine | perplexity x fp32 | streams | aggregate tok/s | first token ms p50 / p95 "
        "| inter-token ms p50 / p95 |",
        "|---|---|---|---|---|---|",
    ]
    ordered = [STOCK, OURS, *(name for name in engines if name not in (STOCK, OURS))]
    for streams in report["streams"]:
        for name in ordered:
            found = engines[name]
            f = found["load"][streams]
            ppl = quality_ratio(report, name)
            label = f"ortforge {report['variant']}, {name}" if name in (STOCK, OURS) else name
            lines.append(
                f"| {label} | {'-' if ppl is None else f'{ppl:.3f}'} | {streams} | "
                f"{f['aggregate_tokens_per_second']:.1f} | "
                f"{f['seconds_to_first_token_p50'] * 1e3:.0f} / {f['seconds_to_first_token_p95'] * 1e3:.0f} | "
                f"{f['inter_token_ms_p50']:.1f} / {f['inter_token_ms_p95']:.1f} |"
            )
    return "\n".join(lines)


def quality_ratio(report: dict, name: str) -> float | None:
    """The worst validate text's perplexity ratio: the copy's from its gates, the variant's from
    validate.json's, a peer's as side_by_side measures it."""
    if name in report["validation"]:
        ratios = [v for k, v in report["validation"][name]["checks"].items() if k.startswith("ppl_ratio[")]
        return max(ratios) if ratios else None
    return report["engines"][name].get("quality", {}).get("ppl_ratio")


def summary(report: dict) -> list[str]:
    engines, most = report["engines"], report["streams"][-1]
    peer = next((name for name in engines if name not in (STOCK, OURS)), None)
    ordered = [STOCK, OURS, *([peer] if peer else [])]

    def ratio(figure: str, streams: str, against: str = STOCK, name: str = OURS) -> float:
        return engines[name]["load"][streams][figure] / engines[against]["load"][streams][figure]

    def scaling(name: str) -> float:
        load = engines[name]["load"]
        return load[most]["aggregate_tokens_per_second"] / load["1"]["aggregate_tokens_per_second"]

    lines = [
        f"{most} streams: x{ratio('aggregate_tokens_per_second', most):.2f} the throughput, first token p95 "
        f"x{ratio('seconds_to_first_token_p95', most):.2f}, inter-token p95 x{ratio('inter_token_ms_p95', most):.2f}",
        f"1 stream: x{ratio('aggregate_tokens_per_second', '1'):.2f} the throughput; {most} streams against 1: "
        f"x{scaling(OURS):.2f} (as built x{scaling(STOCK):.2f})",
    ]
    if peer:
        lines.append(
            f"against {peer} at {most} streams: throughput x{ratio('aggregate_tokens_per_second', most, peer):.2f} "
            f"(as built x{ratio('aggregate_tokens_per_second', most, peer, STOCK):.2f}), first token p95 "
            f"x{ratio('seconds_to_first_token_p95', most, peer):.2f} (as built "
            f"x{ratio('seconds_to_first_token_p95', most, peer, STOCK):.2f})"
        )
    for tokens in engines[STOCK]["first_token_seconds"]:
        cells = ", ".join(f"{name} {engines[name]['first_token_seconds'][tokens] * 1e3:.0f}" for name in ordered)
        lines.append(f"batch-1 first token of {int(tokens):,} tokens, ms: {cells}")
    validated = report["validation"]
    checks = validated[OURS]["checks"]
    shown = ", ".join(
        f"{name} {checks[name]:.4g} (as built {validated[STOCK]['checks'][name]:.4g})"
        for name in sorted(checks)
        if name.startswith(("kl_divergence[", "ppl_ratio[", "top1_agreement["))
    )
    lines.append(f"validate's gates on the copy: {'passed' if validated[OURS]['passed'] else 'FAILED'}; {shown}")
    return lines


def result_name(model: str) -> str:
    return "attention_op" if model == load_peers.DEFAULT_MODEL else f"attention_op-{model}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=load_peers.DEFAULT_MODEL)
    parser.add_argument("--variant", default="w8a8")
    load_peers.add_workload_arguments(parser, streams="1,8")
    parser.add_argument("--no-openvino", dest="openvino", action="store_false", help="leave OpenVINO GenAI out")
    args = parser.parse_args(argv)
    if args.openvino and not openvino_peer.installed():
        raise SystemExit(
            f"error: OpenVINO GenAI's venv is missing; run bash {openvino_peer.SETUP} or pass --no-openvino"
        )
    if args.streams.split(",")[0] != "1":
        raise SystemExit("error: --streams must start with 1 (scaling is against one stream)")
    from tasks.core.params import load_params

    built = load_params(REPO / paths.PARAMS).builds
    if f"{args.model}-{args.variant}" not in built:
        raise SystemExit(
            f"error: params.yaml builds no {args.model}-{args.variant}; pick --model and --variant from: "
            f"{', '.join(sorted(built))}"
        )
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
        engines = {STOCK: {"kind": "ort", "path": str(folder)}, OURS: {"kind": "ort", "path": str(copy)}}
        peers = {}
        if args.openvino:
            name, spec = openvino_int8(args.model)
            engines[name], peers["openvino-genai"] = spec, openvino_peer.version(openvino_peer.PYTHON)
        figures = measure(library, engines, ids, args, Path(scratch))
        if args.openvino:
            figures[name]["quality"] = quality(args.model, {name: spec})[name]
    report = {
        "provenance": provenance.record(provenance.command("attention_op.py", argv), measured, peers or None),
        "model": args.model,
        "variant": args.variant,
        "settings": provenance.settings_used(folder),
        "attention_nodes": moved,
        "compiler": attention_kernel.compiler_version(),
        "flags": list(attention_kernel.FLAGS),
        **load_peers.workload_record(args),
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

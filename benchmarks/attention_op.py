"""ortforge's attention kernel end to end (issue 23's custom-op route): a variant built with
`attention: ortforge` (its GroupQueryAttention nodes run ortforge/custom_ops.py's kernel) against
its twin with onnxruntime's kernel, the same recipe otherwise, and OpenVINO GenAI's int8, under
issue 23's load, in one run.

Both variants passed the validate stage against the original model with the same limits; the
result holds each one's gated figures as validate.json records them. (Compared with each other
directly, the two differ more than their kernels do: w8a8 quantizes activations per token, so a
difference of 1e-7 in an attention output can move a code across a rounding boundary; the fp32
graphs' logits differ by 4e-5.) Each engine runs with the settings the runtime gives it on this CPU.

    python benchmarks/attention_op.py [--model smollm2-135m] [--variant w8a8] [--streams 1,8]
                                      [--rounds 2] [--no-openvino]

--variant names the onnxruntime-kernel variant; its twin is the build whose recipe is the same with
`attention: ortforge`. Writes benchmarks/results/attention_op[-<model>].json. Needs both built.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import attention_kernel, load_peers, provenance  # noqa: E402
from benchmarks.peers import openvino_peer  # noqa: E402
from benchmarks.side_by_side import quality  # noqa: E402
from ortforge import custom_ops  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json, read_json  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
STOCK, OURS = "onnxruntime's attention", "ortforge's attention"


def measure_load(folder: str, prompts: list, new_tokens: int) -> dict:
    from tasks.measurement import concurrency

    found = concurrency.measure_load(folder, prompts, new_tokens, None, 0)
    return {name: found[name] for name in load_peers.FIGURES}


def first_token(folder: str, prompt: list[int], repeats: int) -> list[float]:
    from benchmarks import engines

    return engines.measure({"kind": "ort", "path": folder, "tuned": True}, prompt, 2, 1, repeats)["first_token_s"]


def gated(model: str, variant: str) -> dict:
    """The validate stage's verdict on the variant and each gated figure, as validate.json records them."""
    report = read_json(paths.validate_json(model, variant))
    return {"passed": report["passed"], "checks": {name: check["value"] for name, check in report["checks"].items()}}


def kernel_twin(builds: dict, recipes: dict, model: str, variant: str) -> str:
    """The variant the model builds with variant's recipe and ortforge's attention kernel."""
    if recipes[variant].attention == "ortforge":
        raise SystemExit(f"error: {variant} runs ortforge's kernel already; pass --variant its twin on onnxruntime's")
    wanted = {**recipes[variant].model_dump(), "attention": "ortforge"}
    for build in builds.values():
        if build.model == model and recipes[build.variant].model_dump() == wanted:
            return build.variant
    raise SystemExit(
        f"error: params.yaml builds no {model} variant with {variant}'s recipe and attention: ortforge; "
        f"add one (like w8a8_attn) and run dvc repro"
    )


def under_load(spec: dict, prompts: list, new_tokens: int, scratch: Path) -> dict:
    from benchmarks import attention_op as here  # by module name: the measuring processes import it

    if spec["kind"] == "openvino":
        return load_peers.under_load(spec, prompts, new_tokens, scratch)
    return in_fresh_process(here.measure_load, spec["path"], prompts, new_tokens)


def first_token_seconds(spec: dict, prompt: list[int], scratch: Path) -> float:
    from benchmarks import attention_op as here

    if spec["kind"] == "openvino":
        return load_peers.first_token(spec, prompt, scratch)
    return float(np.median(in_fresh_process(here.first_token, spec["path"], prompt, 3)))


def openvino_int8(model: str) -> tuple[str, dict]:
    """OpenVINO GenAI's int8 export of the model at its CPU defaults: issue 23's yardstick for w8a8."""
    specs = load_peers.engines(model)
    for name, spec in specs.items():
        if spec["kind"] == "openvino" and spec["variant"] == "int8" and spec["precision"] == "default":
            return name, spec
    raise SystemExit("error: load_peers names no OpenVINO GenAI int8 engine")


def measure(engines: dict[str, dict], ids: list[int], args, scratch: Path) -> dict:
    """Each engine's load figures per stream count and batch-1 first tokens, the engines
    alternating within each round."""
    counts = args.streams.split(",")
    load = {name: {s: [] for s in counts} for name in engines}
    first = {name: {str(t): [] for t in (args.prompt_tokens, args.long_prompt)} for name in engines}
    for round_index in range(args.rounds):
        for streams in counts:
            prompts = load_peers.stream_prompts(ids, int(streams), args.requests, args.prompt_tokens)
            for name, spec in engines.items():
                found = under_load(spec, prompts, args.new_tokens, scratch)
                load[name][streams].append(found)
                print(
                    f"  round {round_index + 1}, {streams} stream(s), {name}: "
                    f"{found['aggregate_tokens_per_second']:.1f} tok/s",
                    flush=True,
                )
        for tokens in first[next(iter(engines))]:
            for name, spec in engines.items():
                first[name][tokens].append(first_token_seconds(spec, ids[: int(tokens)], scratch))
    return {
        name: {
            "load": {s: load_peers.medians(runs) for s, runs in load[name].items()},
            # each round's figure beside the median: on a noisy machine the spread is the finding
            "throughput_by_round": {
                s: [run["aggregate_tokens_per_second"] for run in runs] for s, runs in load[name].items()
            },
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
            label = f"ortforge {report['variants'][name]}" if name in (STOCK, OURS) else name
            lines.append(
                f"| {label} | {'-' if ppl is None else f'{ppl:.3f}'} | {streams} | "
                f"{f['aggregate_tokens_per_second']:.1f} | "
                f"{f['seconds_to_first_token_p50'] * 1e3:.0f} / {f['seconds_to_first_token_p95'] * 1e3:.0f} | "
                f"{f['inter_token_ms_p50']:.1f} / {f['inter_token_ms_p95']:.1f} |"
            )
    return "\n".join(lines)


def quality_ratio(report: dict, name: str) -> float | None:
    """The worst validate text's perplexity ratio: a variant's from validate.json, a peer's as
    side_by_side measures it."""
    if name in report["validation"]:
        ratios = [v for k, v in report["validation"][name]["checks"].items() if k.startswith("ppl_ratio[")]
        return max(ratios) if ratios else None
    return report["engines"][name].get("quality", {}).get("ppl_ratio")


def by_round(engines: dict, streams: str, against: str, label: str) -> str:
    """The kernel's variant's throughput against another engine's round by round (runs of one round
    ran back to back), and in how many rounds it was ahead."""
    ours, theirs = (engines[name]["throughput_by_round"][streams] for name in (OURS, against))
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    ahead = sum(ratio > 1 for ratio in ratios)
    cells = ", ".join(f"x{ratio:.2f}" for ratio in ratios)
    return f"round by round at {streams} streams against {label}: {cells} (ahead in {ahead} of {len(ratios)})"


def summary(report: dict) -> list[str]:
    """The kernel's variant against its twin (named) and the peer, in the figures issue 23 sets goals on."""
    engines, most, variants = report["engines"], report["streams"][-1], report["variants"]
    peer = next((name for name in engines if name not in (STOCK, OURS)), None)
    ours, stock = variants[OURS], variants[STOCK]
    ordered = [STOCK, OURS, *([peer] if peer else [])]

    def ratio(figure: str, streams: str, against: str = STOCK, name: str = OURS) -> float:
        return engines[name]["load"][streams][figure] / engines[against]["load"][streams][figure]

    def scaling(name: str) -> float:
        load = engines[name]["load"]
        return load[most]["aggregate_tokens_per_second"] / load["1"]["aggregate_tokens_per_second"]

    lines = [
        f"{ours} against {stock}, {most} streams: x{ratio('aggregate_tokens_per_second', most):.2f} the throughput, "
        f"first token p95 x{ratio('seconds_to_first_token_p95', most):.2f}, inter-token p95 "
        f"x{ratio('inter_token_ms_p95', most):.2f}",
        f"{ours} against {stock}, 1 stream: x{ratio('aggregate_tokens_per_second', '1'):.2f} the throughput; "
        f"{most} streams against 1: x{scaling(OURS):.2f} ({stock} x{scaling(STOCK):.2f})",
    ]
    lines.append(by_round(engines, most, STOCK, stock))
    if peer:
        lines.append(by_round(engines, most, peer, peer))
        lines.append(
            f"{ours} against {peer} at {most} streams: throughput "
            f"x{ratio('aggregate_tokens_per_second', most, peer):.2f} "
            f"({stock} x{ratio('aggregate_tokens_per_second', most, peer, STOCK):.2f}), first token p95 "
            f"x{ratio('seconds_to_first_token_p95', most, peer):.2f} ({stock} "
            f"x{ratio('seconds_to_first_token_p95', most, peer, STOCK):.2f})"
        )
    for tokens in engines[STOCK]["first_token_seconds"]:
        cells = ", ".join(
            f"{variants.get(name, name)} {engines[name]['first_token_seconds'][tokens] * 1e3:.0f}" for name in ordered
        )
        lines.append(f"batch-1 first token of {int(tokens):,} tokens, ms: {cells}")
    validated = report["validation"]
    checks = validated[OURS]["checks"]
    shown = ", ".join(
        f"{name} {checks[name]:.4g} ({stock} {validated[STOCK]['checks'][name]:.4g})"
        for name in sorted(checks)
        if name.startswith(("kl_divergence[", "ppl_ratio[", "top1_agreement["))
    )
    verdict = "passed" if validated[OURS]["passed"] else "FAILED"
    lines.append(f"validate's gates on {ours}: {verdict}; {shown}")
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

    params = load_params(REPO / paths.PARAMS)
    if f"{args.model}-{args.variant}" not in params.builds:
        raise SystemExit(
            f"error: params.yaml builds no {args.model}-{args.variant}; pick --model and --variant from: "
            f"{', '.join(sorted(params.builds))}"
        )
    twin = kernel_twin(params.builds, params.quantize, args.model, args.variant)
    variants = {STOCK: args.variant, OURS: twin}
    measured = provenance.model_outputs(args.model, list(variants.values()))
    provenance.require_current(measured)
    ids = load_peers.token_ids(args.model)
    engines = {role: {"kind": "ort", "path": str(paths.variant_dir(args.model, v))} for role, v in variants.items()}
    peers = {}
    if args.openvino:
        name, spec = openvino_int8(args.model)
        engines[name], peers["openvino-genai"] = spec, openvino_peer.version(openvino_peer.PYTHON)
    with tempfile.TemporaryDirectory(prefix="ortforge-attention-op-") as scratch:
        figures = measure(engines, ids, args, Path(scratch))
        if args.openvino:
            figures[name]["quality"] = quality(args.model, {name: spec})[name]
    report = {
        "provenance": provenance.record(provenance.command("attention_op.py", argv), measured, peers or None),
        "model": args.model,
        "variants": variants,
        "settings": {role: provenance.settings_used(paths.variant_dir(args.model, v)) for role, v in variants.items()},
        "compiler": attention_kernel.compiler_version(),
        "flags": list(custom_ops.FLAGS),
        **load_peers.workload_record(args),
        "validation": {role: gated(args.model, v) for role, v in variants.items()},
        "engines": figures,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / f"{result_name(args.model)}.json", report)
    print(table(report), "\n".join(f"- {line}" for line in summary(report)), sep="\n\n")
    print(f"wrote {RESULTS / result_name(args.model)}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fast together, side by side: ortforge's continuous-batching scheduler against OpenVINO GenAI's
ContinuousBatchingPipeline on the same CPU with the same token ids, both in-process (no HTTP:
benchmarks/serving.py measures the server), each engine and concurrency level in a fresh process,
interleaved over rounds. ortforge's int4, int8 and w8a8 run with the session settings the runtime
gives them here, as `ortforge serve` does: bench's where it tuned them on this CPU, onnxruntime's
defaults where it tuned them on another (each engine records which); OpenVINO GenAI's
exports of the same HF folder (int4 group 32, int8) at its CPU defaults (bf16 activations, u8 KV
cache and dynamic int8 activations where the CPU has them) and in f32 mode.

The workload (issue 23): per stream, --requests requests one after another, each --prompt-tokens
of the bench text from its own offset (no shared prefix), --new-tokens greedy tokens; plus each
engine's batch-1 first token for a --prompt-tokens and a --long-prompt prompt. Quality beside
speed: ortforge's from its validate.json, OpenVINO's scored here on validate's texts against the
same PyTorch reference (its CPU defaults; f32 mode not scored).

    python benchmarks/load_peers.py [--model smollm2-135m] [--variants int4 int8 w8a8 ...]
                                    [--streams 1,4,8] [--rounds 2]

Needs `dvc repro` first and OpenVINO GenAI's venv (benchmarks/peers/setup_openvino.sh). Writes
benchmarks/results/load_peers.json and load_peers.png, and prints the table and the goals.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from benchmarks.peers import openvino_peer  # noqa: E402
from benchmarks.side_by_side import CACHE, quality  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.reporting.load import figure_cells, levels  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
VARIANTS = ("int4", "int8", "w8a8")  # ortforge's, unless --variants names others
PEER_FORMATS = ("int4", "int8")  # OpenVINO GenAI's weight formats of the same HF folder
PRECISIONS = {"CPU defaults": "default", "f32": "f32"}
FIGURES = (
    "aggregate_tokens_per_second",
    "seconds_to_first_token_p50",
    "seconds_to_first_token_p95",
    "inter_token_ms_p50",
    "inter_token_ms_p95",
    "peak_rss_mb",
)


def engines(model: str, variants: tuple[str, ...] = VARIANTS) -> dict[str, dict]:
    """ortforge's variants and OpenVINO GenAI's exports of the same HF folder, in both modes."""
    found = {}
    for variant in variants:
        folder = paths.variant_dir(model, variant)
        settings = provenance.settings_used(folder)
        found[f"ortforge {variant}"] = {"kind": "ort", "path": str(folder), "settings": settings, "variant": variant}
    for variant in PEER_FORMATS:
        built = openvino_peer.build(
            openvino_peer.PYTHON, paths.hf_dir(model), CACHE / model / f"openvino-{variant}", variant
        )
        for mode, precision in PRECISIONS.items():
            found[f"OpenVINO GenAI {openvino_peer.recipe(variant)} ({mode})"] = {
                "kind": "openvino",
                "path": str(built),
                "python": str(openvino_peer.PYTHON),
                "precision": precision,
                "variant": variant,
            }
    return found


def token_ids(model: str) -> list[int]:
    from tokenizers import Tokenizer

    from tasks.core.params import load_params

    text = REPO / load_params(REPO / paths.PARAMS).bench.text
    tokenizer = Tokenizer.from_file(str(paths.variant_dir(model, VARIANTS[0]) / "tokenizer.json"))
    return tokenizer.encode(text.read_text(encoding="utf-8")).ids


def stream_prompts(ids: list[int], streams: int, requests: int, tokens: int) -> list[list[list[int]]]:
    """Per stream, its requests' prompts: consecutive slices of the text, so no two share a prefix."""
    count = streams * requests
    if len(ids) < tokens * (count + 1):
        raise SystemExit(f"error: the bench text has {len(ids)} tokens; {count} prompts of {tokens} need more")
    slices = [ids[(i + 1) * tokens : (i + 2) * tokens] for i in range(count)]
    return [slices[s * requests : (s + 1) * requests] for s in range(streams)]


def under_load(spec: dict, prompts: list[list[list[int]]], new_tokens: int, scratch: Path) -> dict:
    """One engine's figures for these streams, in fresh processes, in one vocabulary."""
    if spec["kind"] == "ort":
        from tasks.measurement import concurrency
        from tasks.measurement.timing import in_fresh_process

        # no settings of its own: the runtime's for this CPU (SessionSettings.for_artifact), as its first token's
        found = in_fresh_process(concurrency.measure_load, spec["path"], prompts, new_tokens, None, 0)
        return {name: found[name] for name in FIGURES}
    options = ["--new-tokens", str(new_tokens), "--precision", spec["precision"]]
    found = openvino_peer.run(Path(spec["python"]), Path(spec["path"]), "load", prompts, scratch, options)
    first = found["first_token_s"]
    return {
        "aggregate_tokens_per_second": found["tokens_per_s"],
        "seconds_to_first_token_p50": float(np.percentile(first, 50)),
        "seconds_to_first_token_p95": float(np.percentile(first, 95)),
        "inter_token_ms_p50": found["inter_token_ms_p50"],
        "inter_token_ms_p95": found["inter_token_ms_p95"],
        "peak_rss_mb": found["peak_rss_mb"],
    }


def first_token(spec: dict, prompt: list[int], scratch: Path, repeats: int = 3) -> float:
    """Batch-1 seconds to the first token of prompt (median of repeats after a warm-up)."""
    if spec["kind"] == "ort":
        from benchmarks import engines as measured
        from tasks.measurement.timing import in_fresh_process

        found = in_fresh_process(
            measured.measure, {"kind": "ort", "path": spec["path"], "tuned": True}, prompt, 2, 1, repeats
        )
    else:
        options = ["--new-tokens", "2", "--warmup", "1", "--repeats", str(repeats), "--precision", spec["precision"]]
        found = openvino_peer.run(Path(spec["python"]), Path(spec["path"]), "generate", prompt, scratch, options)
    return float(np.median(found["first_token_s"]))


def medians(runs: list[dict]) -> dict:
    return {name: float(np.median([run[name] for run in runs])) for name in FIGURES} | {"rounds": len(runs)}


def measure(specs: dict[str, dict], ids: list[int], args) -> dict:
    stream_counts = [int(s) for s in args.streams.split(",")]
    load: dict[str, dict[str, list]] = {name: {str(s): [] for s in stream_counts} for name in specs}
    prefill: dict[str, dict[str, list]] = {
        name: {str(args.prompt_tokens): [], str(args.long_prompt): []} for name in specs
    }
    with tempfile.TemporaryDirectory(prefix="ortforge-load-peers-") as scratch:
        for round_index in range(args.rounds):
            for streams in stream_counts:
                prompts = stream_prompts(ids, streams, args.requests, args.prompt_tokens)
                for name, spec in specs.items():
                    figures = under_load(spec, prompts, args.new_tokens, Path(scratch))
                    load[name][str(streams)].append(figures)
                    print(
                        f"  round {round_index + 1}, {streams} stream(s), {name}: "
                        f"{figures['aggregate_tokens_per_second']:.1f} tok/s, first token p95 "
                        f"{figures['seconds_to_first_token_p95'] * 1e3:.0f} ms",
                        flush=True,
                    )
            for tokens in prefill[next(iter(specs))]:
                for name, spec in specs.items():
                    prefill[name][tokens].append(first_token(spec, ids[: int(tokens)], Path(scratch)))
    return {
        name: {
            "load": {s: medians(runs) for s, runs in load[name].items()},
            "first_token_seconds": {t: float(np.median(v)) for t, v in prefill[name].items()},
        }
        for name in specs
    }


# ---- what the results say (scripts/readme_figures.py fills the README from these)


def ordered(report: dict) -> list[tuple[str, dict]]:
    """ortforge's rows first (the file's keys are sorted, and "O" sorts before "o")."""
    return sorted(report["engines"].items(), key=lambda item: (not item[0].startswith("ortforge"), item[0]))


def table(report: dict) -> str:
    lines = [
        "| engine | ppl ratio | streams | aggregate tok/s | x its 1 stream | first token ms p50 / p95 "
        "| inter-token ms p50 / p95 | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, found in ordered(report):
        ppl = found.get("quality", {}).get("ppl_ratio")
        one = found["load"].get("1", {}).get("aggregate_tokens_per_second")
        quality_cell = "-" if ppl is None else f"{ppl:.3f}"
        for streams in levels(found["load"]):
            lines.append(f"| {name} | {quality_cell} | {streams} | {figure_cells(found['load'][streams], one)} |")
    return "\n".join(lines)


def settings_line(report: dict) -> str:
    """Which session settings each ortforge engine ran with (a file from before they were recorded
    says so)."""
    ours = [(name, found) for name, found in ordered(report) if name.startswith("ortforge")]
    return "ortforge's session settings: " + "; ".join(f"{n}, {f.get('settings', 'not recorded')}" for n, f in ours)


def prefill_table(report: dict) -> str:
    lengths = sorted(next(iter(report["engines"].values()))["first_token_seconds"], key=int)
    lines = ["| engine | " + " | ".join(f"first token ms, {t} tokens" for t in lengths) + " |"]
    lines.append("|---|" + "---|" * len(lengths))
    for name, found in ordered(report):
        cells = " | ".join(f"{found['first_token_seconds'][t] * 1e3:.0f}" for t in lengths)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def goals(report: dict) -> list[str]:
    """Issue 23's goals, each met or not, from this run."""
    engines_found, most = dict(ordered(report)), str(max(int(s) for s in report["streams"]))
    budget = report["int4_ppl_budget"]

    def at(name: str, streams: str = most) -> dict:
        return engines_found[name]["load"][streams]

    def within(names) -> list[str]:
        return [n for n in names if engines_found[n].get("quality", {}).get("ppl_ratio", np.inf) <= budget]

    def fastest(names) -> str | None:
        return max(names, key=lambda n: at(n)["aggregate_tokens_per_second"], default=None)

    ours = [n for n in engines_found if n.startswith("ortforge")]
    peers = [n for n in engines_found if n.startswith("OpenVINO") and "(CPU defaults)" in n]
    said = []
    pairs = (
        (fastest(within(ours)), fastest(within(peers)), f"within our int4 budget (ppl ratio <= {budget})"),
        (
            "ortforge int8" if "ortforge int8" in engines_found else None,
            fastest([n for n in peers if "int8" in n]),
            "int8",
        ),
    )
    for mine, theirs, label in pairs:
        if mine is None or theirs is None:
            said.append(f"{label}: no such pair in this run")
            continue
        ratio = at(mine)["aggregate_tokens_per_second"] / at(theirs)["aggregate_tokens_per_second"]
        p95, their_p95 = at(mine)["seconds_to_first_token_p95"], at(theirs)["seconds_to_first_token_p95"]
        said.append(
            f"{label}, {most} streams: {mine} x{ratio:.2f} the throughput of {theirs} (goal x1.2: "
            f"{'met' if ratio >= 1.2 else 'not met'}), first token p95 {p95 * 1e3:.0f} ms against "
            f"{their_p95 * 1e3:.0f} ms (goal no worse: {'met' if p95 <= their_p95 else 'not met'})"
        )
    for mine in ours:
        gain = at(mine)["aggregate_tokens_per_second"] / at(mine, "1")["aggregate_tokens_per_second"]
        spread = at(mine)["inter_token_ms_p95"] / at(mine, "1")["inter_token_ms_p95"]
        said.append(
            f"{mine}, {most} streams against 1: throughput x{gain:.2f} (goal x4: {'met' if gain >= 4 else 'not met'}), "
            f"p95 inter-token x{spread:.2f} (goal at most x3: {'met' if spread <= 3 else 'not met'})"
        )
    short = str(report["prompt_tokens"])

    def first(name: str) -> float:
        return engines_found[name]["first_token_seconds"][short]

    mine, theirs = min(within(ours), key=first, default=None), min(within(peers), key=first, default=None)
    if mine and theirs:
        verdict = "met" if first(mine) <= first(theirs) else "not met"
        said.append(
            f"first token, {short} tokens, batch 1, within our int4 budget: {mine} {first(mine) * 1e3:.0f} ms "
            f"against {theirs} {first(theirs) * 1e3:.0f} ms (goal no slower: {verdict})"
        )
    return said


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, first) = plt.subplots(1, 2, figsize=(11, 4))
    for name, found in ordered(report):
        streams = levels(found["load"])
        x, runs = [int(s) for s in streams], [found["load"][s] for s in streams]
        style = "o-" if name.startswith("ortforge") else "s--"
        throughput.plot(x, [f["aggregate_tokens_per_second"] for f in runs], style, label=name)
        first.plot(x, [f["seconds_to_first_token_p95"] * 1e3 for f in runs], style, label=name)
    throughput.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="throughput")
    first.set(xlabel="concurrent streams", ylabel="first token p95, ms", title="first token under load")
    throughput.legend(fontsize=7)
    figure.suptitle(f"{report['model']}: ortforge against OpenVINO GenAI, in-process, {report['cpus']} cores")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


DEFAULT_MODEL = "smollm2-135m"


def result_name(model: str) -> str:
    """load_peers for the default model, load_peers-<model> for another (the README shows both)."""
    return "load_peers" if model == DEFAULT_MODEL else f"load_peers-{model}"


def add_workload_arguments(parser: argparse.ArgumentParser, streams: str) -> None:
    """Issue 23's workload, as this script and attention_op.py run it."""
    parser.add_argument("--streams", default=streams)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests each stream sends in turn")
    parser.add_argument("--long-prompt", type=int, default=2048, help="a long prompt's batch-1 first token")


def workload_record(args: argparse.Namespace) -> dict:
    """What a result file says of the workload add_workload_arguments set."""
    return {
        "cpus": os.cpu_count(),
        "streams": args.streams.split(","),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "requests_per_stream": args.requests,
        "rounds": args.rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="ortforge's variants to run")
    add_workload_arguments(parser, streams="1,4,8")
    args = parser.parse_args(argv)
    if not openvino_peer.installed():
        raise SystemExit(f"error: OpenVINO GenAI's venv is missing; run bash {openvino_peer.SETUP} (about 5 minutes)")
    if "1" not in args.streams.split(","):
        raise SystemExit("error: --streams must include 1 (scaling is against one stream)")
    measured = provenance.model_outputs(args.model, args.variants)
    provenance.require_current(measured)
    from tasks.core.params import load_params

    specs = engines(args.model, tuple(args.variants))
    peers = {"openvino-genai": openvino_peer.version(openvino_peer.PYTHON)}
    report = {
        "provenance": provenance.record(provenance.command("load_peers.py", argv), measured, peers),
        "model": args.model,
        **workload_record(args),
        "int4_ppl_budget": load_params(REPO / paths.PARAMS).validation.thresholds["int4"].ppl_ratio,
        "engines": measure(specs, token_ids(args.model), args),
    }
    for name, spec in specs.items():
        if spec["kind"] == "ort":
            report["engines"][name]["settings"] = spec["settings"]
    defaults = {n: s for n, s in specs.items() if s["kind"] == "ort" or s["precision"] == "default"}
    for name, found in quality(args.model, defaults).items():
        report["engines"][name]["quality"] = found
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = result_name(args.model)
    atomic_write_json(RESULTS / f"{name}.json", report)
    plot(report, RESULTS / f"{name}.png")
    print(table(report), prefill_table(report), "\n".join(f"- {line}" for line in goals(report)), sep="\n\n")
    print(f"wrote {RESULTS / name}.json and {name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

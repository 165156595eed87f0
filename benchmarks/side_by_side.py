"""Side-by-side CPU generation benchmark: PyTorch with and without its KV cache, onnxruntime on
optimum's export with default settings, ortforge's built variants (int4 also with prompt lookup
decoding, a different kind of speed-up, on its own row), and, when installed,
onnxruntime-genai's int4 build with its own runtime, llama.cpp (llama-cpp-python) on the
original GGUF and OpenVINO GenAI's int4 (its own venv: benchmarks/peers/setup_openvino.sh).
Each engine runs in its own fresh process, engines interleave over rounds, and figures are
medians (p50) and p95 over every timed token. Each peer's quality is scored beside its speed on
validate's texts against the same PyTorch reference.

Two workloads: the short one the bench stage uses (128-token prompt, 64 new tokens) and the guide's
long one (2,048-token prompt, 200 new tokens), on which a chain of engines adds one technique at a
time to give the "x lighter" figure and each step's share. The memory-bandwidth roofline is
measured here (threads copying large arrays) and each engine's decode speed is reported against
the speed its weight bytes allow (read bandwidth / weight bytes per token).

    python benchmarks/side_by_side.py [--model smollm2-135m] [--rounds 3] [--skip-long]

Needs `dvc repro` first (it reads artifacts/). Writes benchmarks/results/side_by_side.json and
side_by_side.png and prints the tables. Takes about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import engines, provenance  # noqa: E402
from benchmarks.peers import openvino_peer  # noqa: E402
from ortforge.generate import LONG_PROMPT_PIECE  # noqa: E402
from tasks.bench import prompt_ids  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json, folder_bytes  # noqa: E402
from tasks.measurement import timing  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CACHE = REPO / "benchmarks" / ".cache"
WORKLOADS = {"short": (128, 64), "long": (2048, 200)}
SHOWN_VARIANTS = ("fp32", "int8", "int8_smooth", "w8a8", "int4", "int4_mixed")  # ortforge's rows, where built
LOOKUP_DRAFT = 3  # draft tokens per step for prompt lookup decoding (ortforge.lookup)


def memory_bandwidth_gb_s(size_mb: int = 512, seconds: float = 2.0) -> float:
    """Bytes read per second by one summing thread per core (numpy releases the GIL): decoding
    reads every weight once per token and writes little, so read bandwidth bounds it."""
    cores = os.cpu_count() or 1
    arrays = [np.ones(size_mb * 1024 * 1024 // 4, dtype=np.float32) for _ in range(cores)]
    read = [0] * cores

    def scan(i: int, until: float) -> None:
        while time.perf_counter() < until:
            arrays[i].sum()
            read[i] += arrays[i].nbytes

    until = time.perf_counter() + seconds
    workers = [threading.Thread(target=scan, args=(i, until)) for i in range(cores)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(read) / (time.perf_counter() - started) / 1e9


def optimum_fp32(model: str) -> Path:
    """optimum's export exactly as it ships (no fusions, logits for every position), built once."""
    from tasks import export
    from tasks.core.params import ExportConfig

    out = CACHE / model / "optimum-fp32"
    if not (out / "model.onnx").is_file():
        export.run(ExportConfig(), "optimum", paths.hf_dir(model), out)
    return out


def genai_int4(model: str) -> Path | None:
    """onnxruntime-genai's own int4 build (its quantizer and config), built once into the cache."""
    try:
        from onnxruntime_genai.models.builder import create_model, parse_extra_options
    except ImportError:
        return None
    out = CACHE / model / "genai-int4"
    if not (out / "genai_config.json").is_file():
        cache = str(CACHE / "genai-build")
        options = parse_extra_options(None, str(paths.hf_dir(model)), str(out), "int4", "cpu", cache, [])
        create_model(None, str(paths.hf_dir(model)), str(out), "int4", "cpu", cache, **options)
    return out


def openvino_int4(model: str) -> Path | None:
    """OpenVINO GenAI's int4 export of the same HF folder, built once into the cache."""
    if not openvino_peer.installed():
        return None
    return openvino_peer.build(openvino_peer.PYTHON, paths.hf_dir(model), CACHE / model / "openvino-int4", "int4")


def quality(model: str, specs: dict[str, dict]) -> dict[str, dict]:
    """Quality beside speed: ortforge's rows from their validate.json, each peer's measured here
    the same way (validate's texts, windows and PyTorch reference); engines that run the float
    model are the reference (ratio 1)."""
    found = {}
    reference, params = str(paths.reference_dir(model)), str(REPO / "params.yaml")
    for name, spec in specs.items():
        if spec["kind"] == "ort" and not spec.get("prompt_lookup"):
            variant = Path(spec["path"]).name
            validation = json.loads(paths.validate_json(model, variant).read_text(encoding="utf-8"))
            found[name] = engines.quality_summary(validation["texts"]) | {"measured_by": f"validate ({variant})"}
        elif spec["kind"] in ("genai", "llamacpp", "openvino"):
            print(f"  quality: {name}", flush=True)
            if spec["kind"] == "genai":
                found[name] = in_fresh_process(engines.genai_quality, spec["path"], reference, params)
            elif spec["kind"] == "llamacpp":
                found[name] = in_fresh_process(engines.llamacpp_quality, spec["path"], reference, params)
            else:
                found[name] = engines.openvino_quality(spec["python"], spec["path"], reference, params)
    return found


def gguf_file(model: str) -> Path | None:
    """The GGUF the model was built from, when a package ships it (llama.cpp's peers run it)."""
    source = json.loads((paths.hf_dir(model) / paths.SOURCE_FILE).read_text(encoding="utf-8"))
    if source.get("kind") == "gguf_package":
        import importlib.metadata

        return Path(importlib.metadata.distribution(source["package"]).locate_file(source["file"]))
    return None


def short_engines(model: str) -> dict[str, dict]:
    variant = lambda v: str(paths.variant_dir(model, v))  # noqa: E731
    hf = str(paths.hf_dir(model))
    specs = {
        "PyTorch fp32, no KV cache": {"kind": "torch-nokv", "path": hf, "sample_steps": 8, "float_weights": True},
        "PyTorch fp32, KV cache": {"kind": "torch-kv", "path": hf, "float_weights": True},
        "optimum export fp32, ORT defaults": {
            "kind": "ort-plain",
            "path": str(optimum_fp32(model)),
            "float_weights": True,
        },
    }
    for name in SHOWN_VARIANTS:
        if paths.variant_dir(model, name).is_dir():
            specs[f"ortforge {name}"] = {"kind": "ort", "path": variant(name), "tuned": True}
    if paths.variant_dir(model, "int4").is_dir():  # a different kind of speed-up, reported apart
        specs[f"ortforge int4 + prompt lookup ({LOOKUP_DRAFT} tokens)"] = {
            "kind": "ort",
            "path": variant("int4"),
            "tuned": True,
            "prompt_lookup": LOOKUP_DRAFT,
        }
    if (built := genai_int4(model)) is not None:
        specs["onnxruntime-genai int4 + its runtime"] = {"kind": "genai", "path": str(built)}
    if (gguf := gguf_file(model)) is not None and importlib.util.find_spec("llama_cpp") is not None:
        handicap = " (AMX and repacked weights off: they crash here)" if engines.llamacpp_without_amx() else ""
        specs[f"llama.cpp, {gguf.name.split('.')[-2]} GGUF{handicap}"] = {"kind": "llamacpp", "path": str(gguf)}
    if (built := openvino_int4(model)) is not None:
        specs["OpenVINO GenAI int4 (group 32)"] = {
            "kind": "openvino",
            "path": str(built),
            "python": str(openvino_peer.PYTHON),
        }
    return specs


def absent_peers(specs: dict[str, dict]) -> dict[str, str]:
    """The peers this run could not include, each with why: a table says what it leaves out."""
    kinds = {spec["kind"] for spec in specs.values()}
    absent = {}
    if "genai" not in kinds:
        absent["onnxruntime-genai"] = "onnxruntime-genai is not installed (pip install onnxruntime-genai)"
    if "llamacpp" not in kinds:
        absent["llama.cpp"] = (
            "llama-cpp-python is not installed (pip install llama-cpp-python compiles llama.cpp, about 6 "
            "minutes on 2 cores)"
            if importlib.util.find_spec("llama_cpp") is None
            else "the model was not built from a GGUF a package ships"
        )
    if "openvino" not in kinds:
        absent["OpenVINO GenAI"] = f"its venv is not installed ({openvino_peer.SETUP}, about 5 minutes)"
    return absent


def peer_versions(specs: dict[str, dict]) -> dict[str, str]:
    """The version of each peer engine the run includes, as its package says."""
    from importlib.metadata import version

    packages = {"genai": "onnxruntime-genai", "llamacpp": "llama-cpp-python"}
    kinds = {spec["kind"] for spec in specs.values()}
    found = {packages[kind]: version(packages[kind]) for kind in packages if kind in kinds}
    if "openvino" in kinds:
        found["openvino-genai"] = openvino_peer.version(openvino_peer.PYTHON)
    return found


def chain_engines(model: str) -> dict[str, dict]:
    """The long-prompt chain: each entry adds one technique to the one before."""
    hf, int4 = str(paths.hf_dir(model)), str(paths.variant_dir(model, "int4"))
    return {
        "PyTorch fp32, no KV cache": {"kind": "torch-nokv", "path": hf, "sample_steps": 6},
        "+ KV cache (PyTorch)": {"kind": "torch-kv", "path": hf},
        "+ ONNX Runtime (optimum export, defaults)": {"kind": "ort-plain", "path": str(optimum_fp32(model))},
        "+ fused graph, last-position logits (fp32)": {
            "kind": "ort-plain",
            "path": str(paths.variant_dir(model, "fp32")),
        },
        "+ int4 quantization": {"kind": "ort-plain", "path": int4},
        "+ tuned session settings": {"kind": "ort-plain", "path": int4, "tuned": True},
        "+ I/O binding, in-place KV cache": {"kind": "ort", "path": int4, "tuned": True, "whole_prompt": True},
        f"+ prompt in pieces of {LONG_PROMPT_PIECE}": {"kind": "ort", "path": int4, "tuned": True},
    }


def size_mb(spec: dict) -> float:
    path = Path(spec["path"])
    if path.is_file():
        return path.stat().st_size / 1e6
    patterns = {"torch-kv": "*.safetensors", "torch-nokv": "*.safetensors", "openvino": "openvino_model.*"}
    return folder_bytes(path, patterns.get(spec["kind"], "model.onnx*")) / 1e6


def summarize(runs: list[dict], spec: dict, prompt_tokens: int, bandwidth: float) -> dict:
    """The bench stage's metrics (tasks.measurement.timing.summarize), and what only a comparison
    of engines needs: the share of the memory-bandwidth roofline and, for prompt lookup, tokens
    per model run."""
    size = size_mb(spec)
    metrics = timing.summarize(runs, prompt_tokens, int(size * 1e6))
    roofline = bandwidth * 1e3 / size  # tokens/s if each token read every weight byte once
    decode_runs = [n for run in runs for n in run.get("decode_runs") or []]
    steps = sum(len(repeat) for run in runs for repeat in run["step_s"])
    return metrics | {
        # prompt lookup only: decode tokens per model run (1.0 means no draft was ever accepted)
        "tokens_per_run": steps / sum(decode_runs) if decode_runs else None,
        "roofline_tokens_per_second": roofline,
        "share_of_roofline": metrics["decode_tokens_per_second"] / roofline,
        "interpolated_steps": bool(spec.get("sample_steps")),
    }


def with_settings(spec: dict) -> dict:
    """The spec with the session settings its runs get here, when they are meant to be bench's:
    those run only on the CPU bench tuned them on (provenance.settings_used)."""
    return spec | {"settings": provenance.settings_used(Path(spec["path"]))} if spec.get("tuned") else spec


def run_workload(specs: dict[str, dict], prompt: list[int], new_tokens: int, rounds: int, bandwidth: float) -> dict:
    specs = {name: with_settings(spec) for name, spec in specs.items()}
    runs: dict[str, list] = {name: [] for name in specs}
    for round_index in range(rounds):
        for name, spec in specs.items():
            print(f"  round {round_index + 1}/{rounds}: {name}", flush=True)
            runs[name].append(in_fresh_process(engines.measure, spec, prompt, new_tokens, 1, 2))
    return {name: summarize(runs[name], specs[name], len(prompt), bandwidth) | {"spec": specs[name]} for name in specs}


def lighter(chain: dict) -> dict:
    """Each chain step's speed-up over the step before, and the whole chain's."""
    names = list(chain)
    times = [chain[n]["end_to_end_seconds"] for n in names]
    steps = {names[i]: times[i - 1] / times[i] for i in range(1, len(names))}
    return {"x_lighter": times[0] / times[-1], "x_lighter_than_kv_cache": times[1] / times[-1], "steps": steps}


def settings(spec: dict) -> str:
    """Which settings a row ran with: each engine at its best as a user gets it, said per row (bench's
    own only where it tuned them on this CPU, as recorded when the row was measured)."""
    return spec.get("settings", "the engine's defaults")


def quality_cell(name: str, spec: dict, quality_found: dict) -> str:
    """Quality beside speed: the worst text's perplexity ratio against PyTorch fp32, or why none."""
    if spec.get("prompt_lookup"):
        return "int4's (greedy tokens unchanged)"
    if name in quality_found:
        return f"{quality_found[name]['ppl_ratio']:.3f}"
    if spec.get("float_weights"):
        return "1 (float weights)"
    return "not scored"


def table(results: dict, quality_found: dict | None = None) -> str:
    quality_found = quality_found or {}
    lines = [
        "| engine | settings | ppl ratio | decode tok/s | decode ms p50 / p95 | first token ms p50 / p95 "
        "| peak RSS MB | size MB | roofline share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in sorted(results.items(), key=lambda item: item[1]["decode_tokens_per_second"]):
        lines.append(
            f"| {name} | {settings(r['spec'])} | {quality_cell(name, r['spec'], quality_found)} "
            f"| {r['decode_tokens_per_second']:.1f} | "
            f"{r['decode_ms_per_token_p50']:.2f} / "
            f"{r['decode_ms_per_token_p95']:.2f} | {r['seconds_to_first_token_p50'] * 1e3:.0f} / "
            f"{r['seconds_to_first_token_p95'] * 1e3:.0f} | {r['peak_rss_mb']:.0f} | {r['size_mb']:.0f} "
            f"| {r['share_of_roofline']:.0%} |"
        )
    return "\n".join(lines)


def quality_table(found: dict) -> str:
    """Each quantized engine's quality on validate's texts, worst text, against PyTorch fp32."""
    lines = ["| engine | ppl ratio | KL | top-1 | measured by |", "|---|---|---|---|---|"]
    for name, q in sorted(found.items(), key=lambda item: item[1]["ppl_ratio"]):
        figures = f"{q['ppl_ratio']:.3f} | {q['kl_divergence']:.4f} | {q['top1_agreement']:.3f}"
        lines.append(f"| {name} | {figures} | {q['measured_by']} |")
    return "\n".join(lines)


def chain_table(long: dict) -> str:
    """The x-lighter chain: each step's end-to-end time and its factor over the step before."""
    lines = [
        "| step (2,048-token prompt, 200 new tokens) | end to end s | step factor | decode tok/s | first token s "
        "| peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for name in long["order"]:
        r, factor = long["chain"][name], long["steps"].get(name)
        ran_with = r["spec"].get("settings", "")
        # a step named for bench's settings that did not get them here says so
        shown = f"{name} ({ran_with})" if ran_with.startswith(provenance.DEFAULT_SETTINGS) else name
        lines.append(
            f"| {shown} | {r['end_to_end_seconds']:.1f} | {f'x{factor:.2f}' if factor else '-'} "
            f"| {r['decode_tokens_per_second']:.1f} | {r['seconds_to_first_token_p50']:.2f} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Ordered by the figures, not by dict order: the JSON is written with sorted keys.
    short = report["short"]
    names = sorted(short, key=lambda n: short[n]["decode_tokens_per_second"])
    panels = 3 if "long" in report else 2
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 5.5))
    speeds = [short[n]["decode_tokens_per_second"] for n in names]
    roofs = [short[n]["roofline_tokens_per_second"] for n in names]
    y = np.arange(len(names))
    axes[0].barh(y, roofs, color="#dddddd", label="memory-bandwidth roofline for its weight bytes")
    axes[0].barh(
        y, speeds, color=["#3b75af" if n.startswith("ortforge") else "#999999" for n in names], label="measured"
    )
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("decode tokens/s (128-token prompt, 64 new tokens)")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[1].barh(y, [short[n]["seconds_to_first_token_p50"] * 1e3 for n in names], color="#3b75af")
    axes[1].set_yticks(y, [""] * len(names))
    axes[1].invert_yaxis()
    axes[1].set_xlabel("time to first token, ms (p50)")
    if "long" in report:
        chain = report["long"]["chain"]
        labels = report["long"]["order"]  # each step adds one technique to the one above
        axes[2].barh(np.arange(len(labels)), [chain[n]["end_to_end_seconds"] for n in labels], color="#3b75af")
        axes[2].set_xscale("log")
        axes[2].set_yticks(np.arange(len(labels)), labels, fontsize=8)
        axes[2].invert_yaxis()
        axes[2].set_xlabel(f"2,048 + 200 tokens, seconds (log): x{report['long']['x_lighter']:.0f} lighter")
    figure.suptitle(f"{report['model']}: CPU generation side by side ({report['cpus']} cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-long", action="store_true", help="only the short workload")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    if not paths.variant_dir(args.model, "int4").is_dir():
        raise SystemExit(f"error: {paths.variant_dir(args.model, 'int4')} is missing; run `dvc repro` first")
    shown = [v for v in SHOWN_VARIANTS if paths.variant_dir(args.model, v).is_dir()]
    measured = provenance.model_outputs(args.model, shown, hf=True)
    provenance.require_current(measured)
    bandwidth = memory_bandwidth_gb_s()
    print(f"memory read bandwidth ({os.cpu_count()} threads): {bandwidth:.1f} GB/s", flush=True)
    text = REPO / "data" / "eval" / "GPL-3.txt"
    engines_short = short_engines(args.model)
    peers = peer_versions(engines_short)
    for peer, why in absent_peers(engines_short).items():
        print(f"  not measured: {peer}: {why}", flush=True)
    report = {
        "provenance": provenance.record(provenance.command("side_by_side.py", argv), measured, peers),
        "model": args.model,
        "cpus": os.cpu_count(),
        "memory_bandwidth_gb_s": bandwidth,
        "rounds": args.rounds,
        "absent_peers": absent_peers(engines_short),
    }
    prompt_tokens, new_tokens = WORKLOADS["short"]
    print("short workload", flush=True)
    prompt = prompt_ids(paths.hf_dir(args.model), text, prompt_tokens)
    report["short"] = run_workload(engines_short, prompt, new_tokens, args.rounds, bandwidth)
    report["quality"] = quality(args.model, engines_short)
    print(table(report["short"], report["quality"]))
    print(quality_table(report["quality"]))
    for name, result in report["short"].items():
        if result["tokens_per_run"]:
            print(f"  {name}: {result['tokens_per_run']:.2f} decode tokens per model run")
    if not args.skip_long:
        prompt_tokens, new_tokens = WORKLOADS["long"]
        print("long workload (the x-lighter chain)", flush=True)
        prompt = prompt_ids(paths.hf_dir(args.model), text, prompt_tokens)
        chain = run_workload(chain_engines(args.model), prompt, new_tokens, max(1, args.rounds - 1), bandwidth)
        report["long"] = {"chain": chain, "order": list(chain), **lighter(chain)}
        print(chain_table(report["long"]))
        print(
            f"x lighter than PyTorch without KV cache: {report['long']['x_lighter']:.1f}; "
            f"than PyTorch with its KV cache: {report['long']['x_lighter_than_kv_cache']:.1f}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "side_by_side.json", report)
    plot(report, RESULTS / "side_by_side.png")
    print(f"wrote {RESULTS / 'side_by_side.json'} and side_by_side.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

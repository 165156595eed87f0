"""onnxruntime's OpenVINO execution provider against its CPU one, on ortforge's own artifacts:
which nodes each provider takes, prefill and decode speed, and whether the logits stay the CPU
provider's.

    python benchmarks/execution_providers.py [--model smollm2-135m] [--variants fp32 int4 int8 w8a8] [--rounds 2]

Issue 23 names OpenVINO's kernels through onnxruntime as a route to prefill speed, an execution
provider chosen per artifact by measurement. The plugin (PyPI onnxruntime-ep-openvino, which
bundles OpenVINO) registers with our onnxruntime (register_execution_provider_library) and is
never a dependency: benchmarks/peers/setup_ov_ep.sh installs it beside the repo. Each variant
runs with the CPU provider at the settings bench tuned (onnxruntime's defaults where bench tuned
them on another CPU, as the runtime does; the table says which), and with the OpenVINO provider at its
defaults (bf16 activations where the CPU has them) and with f32 inference precision; each
configuration in a fresh process, interleaved over rounds. Node placement comes from
onnxruntime's profiler (the provider of every node a prefill ran). Writes
benchmarks/results/execution_providers.json; scripts/readme_figures.py puts its table in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from tasks.bench import prompt_ids  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.measurement.timing import in_fresh_process, timed_generation  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PLUGIN_DIR = REPO.parent / "peers" / "ov-ep"  # where setup_ov_ep.sh installs the plugin
PLUGIN_LIBRARY = "onnxruntime_ep_openvino/libonnxruntime_providers_openvino_plugin.so"
OPENVINO = "OpenVINOExecutionProvider"
CPU = "CPU EP"  # its row says which settings it ran with (bench's only on the CPU bench tuned them on)
# OpenVINO's CPU properties per configuration (its load_config); None: the CPU provider.
CONFIGS = {
    CPU: None,
    "OpenVINO EP (its defaults)": {},
    "OpenVINO EP (f32)": {"INFERENCE_PRECISION_HINT": "f32"},
}
PROMPT_TOKENS = 128
NEW_TOKENS = 32
PREFILLS = 3  # timed, after one warm-up
NO_DEVICE = f"the plugin lists no {OPENVINO} device on this CPU (onnxruntime.get_ep_devices())"


def run_config(folder: str, plugin: str, properties: dict | None, prompt: list[int]) -> dict:
    """Run in a fresh process: one configuration on one variant. Where the nodes ran (a profiled
    prefill in a session of its own), the prefill's and each decode step's time, the prefill's
    last logits and the greedy tokens."""
    import onnxruntime as ort

    from ortforge.decoder import Decoder
    from ortforge.names import MODEL_FILE
    from ortforge.session import SessionSettings

    settings = SessionSettings.for_artifact(Path(folder))
    version = None
    if properties is not None:
        ort.register_execution_provider_library(OPENVINO, plugin)
        devices = [d for d in ort.get_ep_devices() if d.ep_name == OPENVINO]
        if not devices:  # seen on an AMD EPYC: the library registers and offers no device to run on
            return {"plugin_version": None, "refused": NO_DEVICE}
        version = devices[0].ep_metadata.get("version")

    scratch = Path(tempfile.mkdtemp(prefix="ortforge-ep-"))  # OpenVINO's config file and the profile

    def session(profile_prefix: str | None = None):
        options = settings.session_options()
        if properties is not None:
            provider_options = {}
            if properties:  # OpenVINO reads its device properties from a JSON file
                config = scratch / "config.json"
                config.write_text(json.dumps({"CPU": properties}), encoding="utf-8")
                provider_options["load_config"] = str(config)
            options.add_provider_for_devices(devices, provider_options)
        if profile_prefix:
            options.enable_profiling, options.profile_file_prefix = True, profile_prefix
        return ort.InferenceSession(str(Path(folder) / MODEL_FILE), options)

    try:
        profiled = Decoder(session(str(scratch / "ort")))
    except Exception as error:  # onnxruntime's pybind errors share no narrower base
        if properties is None:
            raise
        shutil.rmtree(scratch)
        return {"plugin_version": version, "refused": refusal(error)}
    profiled.forward(prompt, profiled.empty_cache(), last_only=True)
    placement = node_placement(json.loads(Path(profiled.session.end_profiling()).read_text(encoding="utf-8")))
    del profiled

    start = time.perf_counter()
    decoder = Decoder(session())
    load_seconds = time.perf_counter() - start
    timed = [timed_generation(decoder, prompt, NEW_TOKENS) for _ in range(PREFILLS + 1)]  # the first warms up
    logits, cache = decoder.forward(prompt, decoder.empty_cache(), last_only=True)  # untimed: what it computes
    first_logits, tokens = logits, [int(logits.argmax())]
    for _ in range(NEW_TOKENS - 1):
        logits, cache = decoder.forward([tokens[-1]], cache, last_only=True)
        tokens.append(int(logits.argmax()))
    shutil.rmtree(scratch)
    return {
        "plugin_version": version,
        "placement": placement,
        "load_seconds": load_seconds,
        "prefill_ms": [first * 1e3 for first, _ in timed[1:]],  # the prompt's run and its argmax
        "step_ms": [step * 1e3 for _, steps in timed[1:] for step in steps],
        "first_logits": first_logits.astype(float).tolist(),
        "greedy_tokens": tokens,
    }


def refusal(error: Exception) -> str:
    """Why a provider would not build a session for a graph: the line of its error that says so
    (its first line, or the error's type when it has no message)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return next((line for line in lines if "could not" in line.lower() or "cannot" in line.lower()), lines[0])


def node_placement(events: list[dict]) -> dict:
    """From a profiled run: how many graph nodes each provider ran, and the op types the CPU
    provider kept (a node OpenVINO took is one of its fused subgraphs)."""
    nodes = {}
    for event in events:
        args = event.get("args", {})
        if event.get("cat") == "Node" and "provider" in args:
            nodes[event["name"].removesuffix("_kernel_time")] = (args["provider"], args.get("op_name", ""))
    by_provider = Counter(provider for provider, _ in nodes.values())
    kept = Counter(op for provider, op in nodes.values() if provider == "CPUExecutionProvider")
    return {"nodes": dict(by_provider), "cpu_op_types": dict(sorted(kept.items()))}


def summarize(runs: list[dict], reference: list[dict] | None) -> dict:
    """The median over rounds of a configuration's figures, and how its logits and greedy tokens
    compare with the CPU provider's (reference; None for the CPU provider itself)."""
    first = runs[0]
    if "refused" in first:
        return {"plugin_version": first["plugin_version"], "refused": first["refused"]}
    found = {
        "plugin_version": first["plugin_version"],
        "placement": first["placement"],
        "load_seconds": float(np.median([r["load_seconds"] for r in runs])),
        "prefill_ms_p50": float(np.median([np.median(r["prefill_ms"]) for r in runs])),
        "step_ms_p50": float(np.median([np.median(r["step_ms"]) for r in runs])),
    }
    if reference is not None:
        ours, theirs = np.array(first["first_logits"]), np.array(reference[0]["first_logits"])
        same = first_difference(first["greedy_tokens"], reference[0]["greedy_tokens"])
        found |= {
            "logit_range": float(theirs.max() - theirs.min()),
            "largest_logit_change": float(np.abs(ours - theirs).max()),
            "greedy_tokens_equal": len(first["greedy_tokens"]) if same is None else same,
        }
    return found


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The index of the first token that differs from reference's, or None."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), None)


COLUMNS = (
    "variant", "provider", "nodes on OpenVINO / on CPU", "CPU kept", "first token ms, 128 tokens", "x CPU EP",
    "decode ms per token", "x CPU EP", "largest logit change (of range)", "greedy tokens equal",
)  # fmt: skip


def table(report: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for variant, configs in report["variants"].items():
        cpu = configs[CPU]
        for name, figures in configs.items():
            if "refused" in figures:  # the provider would not load this graph: say why, measure nothing
                lines.append(f"| {variant} | {name} | refused: {figures['refused']} |" + " - |" * (len(COLUMNS) - 3))
                continue
            nodes = figures["placement"]["nodes"]
            kept = ", ".join(f"{op} {count}" for op, count in figures["placement"]["cpu_op_types"].items())
            on_cpu = nodes.get("CPUExecutionProvider", 0)
            change = f"{figures['largest_logit_change']:.2g} ({figures['logit_range']:.1f})" if name != CPU else "-"
            equal = f"{figures['greedy_tokens_equal']}/{report['new_tokens']}" if name != CPU else "-"
            prefill, step = figures["prefill_ms_p50"], figures["step_ms_p50"]
            shown = f"{name} ({report['session_settings'][variant]})" if name == CPU else name
            lines.append(
                f"| {variant} | {shown} | {nodes.get(OPENVINO, 0)} / {on_cpu} | {kept if name != CPU else 'all'} "
                f"| {prefill:.1f} | x{prefill / cpu['prefill_ms_p50']:.2f} "
                f"| {step:.2f} | x{step / cpu['step_ms_p50']:.2f} | {change} | {equal} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", nargs="+", default=["fp32", "int4", "int8", "w8a8"])
    parser.add_argument("--rounds", type=int, default=2, help="each configuration once per round, interleaved")
    parser.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR)
    args = parser.parse_args(argv)
    plugin = args.plugin_dir / PLUGIN_LIBRARY
    if not plugin.is_file():
        raise SystemExit(f"error: no OpenVINO EP plugin at {plugin}; run benchmarks/peers/setup_ov_ep.sh first")
    os.chdir(REPO)
    measured = provenance.model_outputs(args.model, args.variants)
    provenance.require_current(measured)
    ids = prompt_ids(paths.hf_dir(args.model), REPO / "data" / "eval" / "GPL-3.txt", PROMPT_TOKENS)
    prompt = ids[:PROMPT_TOKENS]
    from benchmarks import execution_providers as here  # a fresh process imports this module by name

    runs: dict[str, dict[str, list[dict]]] = {v: {name: [] for name in CONFIGS} for v in args.variants}
    for round_ in range(args.rounds):
        for variant in args.variants:
            folder = str(paths.variant_dir(args.model, variant))
            for name, properties in CONFIGS.items():
                print(f"round {round_ + 1}/{args.rounds}: {variant}, {name}", flush=True)
                runs[variant][name].append(in_fresh_process(here.run_config, folder, str(plugin), properties, prompt))
    variants = {
        variant: {name: summarize(found, None if name == CPU else configs[CPU]) for name, found in configs.items()}
        for variant, configs in runs.items()
    }
    settings = {variant: provenance.settings_used(paths.variant_dir(args.model, variant)) for variant in args.variants}
    version = next(f["plugin_version"] for v in variants.values() for n, f in v.items() if n != CPU)
    report = {
        "provenance": provenance.record(
            provenance.command("execution_providers.py", argv), measured, peers={"onnxruntime-ep-openvino": version}
        ),
        "model": args.model,
        "cpus": os.cpu_count(),
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "rounds": args.rounds,
        "variants": variants,
        "session_settings": settings,  # every configuration's, the CPU provider's and OpenVINO's alike
    }
    print(table(report))
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "execution_providers.json", report)
    print(f"wrote {RESULTS / 'execution_providers.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

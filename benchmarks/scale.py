"""What building costs at the sizes people run: random-weight models of real configs
(benchmarks/random_models.py: Qwen2.5 0.5B, Llama 3.2 1B and 3B, Llama 3.1 8B) built by ortforge
as a user would (a `kind: local` source, int4, int8 and w8a8, `ortforge build`), each stage's wall time,
peak memory and preflight estimate recorded by the stage itself (ORTFORGE_STAGE_COSTS), and the
disk that the workspace and DVC's cache take against the artifacts plus the checkpoint. Beside
them, on the same checkpoint: onnxruntime-genai's builder to int4, and OpenVINO's optimum-cli to
int4 (group 32) and int8 where its venv exists (benchmarks/peers/setup_openvino.sh).

At the 1B class it also runs the built int4 and w8a8 (the serving variant) beside onnxruntime-genai's
int4 and OpenVINO GenAI's int4 and int8 (CPU defaults): batch-1 decode and first token, and 8
concurrent streams, interleaved over rounds, each engine in its own fresh process, the same prompts
for all.

Random weights give near-flat logits, so quality gates mean nothing here: scale builds carry
their own limits (SCALE_LIMITS: measured, not gated), named so in the results; the shared gates
of params.yaml are untouched. The largest size runs export and int4 quantize only (--export-only).

    python benchmarks/scale.py [--sizes qwen2.5-0.5b llama-3.2-1b llama-3.2-3b] [--export-only llama-3.1-8b]
                               [--openvino ../peers/openvino/bin/python] [--workdir benchmarks/.cache/scale]

Needs the default model's download first (its tokenizer): dvc repro download@smollm2-135m. Writes
benchmarks/results/scale.json and scale.png. Takes about 2 hours on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import engines, provenance, random_models  # noqa: E402
from benchmarks.load_peers import stream_prompts  # noqa: E402
from benchmarks.peers import openvino_peer  # noqa: E402
from benchmarks.side_by_side import memory_bandwidth_gb_s  # noqa: E402
from flows.cache_links import disk_bytes  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PROJECT_FILES = ("tasks", "ortforge", "flows", "data", "dvc.yaml", "versions.yaml", ".dvcignore", "prefect.toml")
TOKENIZER = REPO / "artifacts" / "smollm2-135m" / "hf"
VARIANTS = ("int4", "int8", "w8a8")
# What runs beside the peers at --runtime-at: ortforge's int4 and its serving variant (w8a8), at
# batch 1 and under STREAMS concurrent streams.
RUNTIME_VARIANTS = ("int4", "w8a8")
OPENVINO_FORMATS = ("int4", "int8")  # OpenVINO's exports of the same checkpoint (optimum-cli weight formats)
# Random weights: every limit is one the variant cannot miss. The table says so.
SCALE_LIMITS = {
    "ppl_ratio": 1000.0,
    "kl_divergence": 1000.0,
    "top1_agreement": 0.0,
    "greedy_agreement": 0.0,
    "kv_max_prob_diff": 1.0,
}
LIMITS_NAME = "scale-run limits: measured, not gated (random weights)"
PROMPT_TOKENS, NEW_TOKENS, STREAMS, REQUESTS = 128, 64, 8, 2
GB = 1e9


def rusage_run(command: list[str], **options) -> dict:
    """Run a command; its wall time and peak resident memory (the largest of it and its children)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **options)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} exited with {process.returncode}: {failure_reason(output)}")
    return {"seconds": round(time.perf_counter() - started, 1), "peak_rss_bytes": usage.ru_maxrss * 1024}


def failure_reason(output: str) -> str:
    """The line of a tool's output that says why it failed: its last error, else its last line
    with words (progress tables and bars say nothing)."""
    lines = [line.strip() for line in output.splitlines() if any(c.isalpha() for c in line)]
    errors = [line for line in lines if "error" in line.lower() or "killed" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


PER_MODEL_COMMITS = {"commit": None, "code_modified": None, "per_model": "models.<name>.measured"}


def measured_on() -> dict:
    """The code a figure describes: the commit, whether the tree had changes, when, and on which
    CPU (a --merge run may add a size measured on another machine of the same core count)."""
    from ortforge.machine import describe

    commit, modified = provenance.code_state([*PROJECT_FILES, "benchmarks"])
    return {"commit": commit, "uncommitted_changes": modified, "date": time.strftime("%Y-%m-%d"), "machine": describe()}


def checkpoint(name: str, workdir: Path) -> Path:
    """The model's random-weight checkpoint, written once."""
    folder = workdir / "checkpoints" / name
    if not (folder / "config.json").is_file():
        print(f"{name}: writing a random-weight checkpoint", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        random_models.write_model(name, TOKENIZER, folder)
    return folder


def model_name(config: str) -> str:
    """The config's name as params.yaml takes it (no dots: names become DVC stages and folders)."""
    return config.replace(".", "_")


def scale_params(name: str, source: Path) -> dict:
    """The repository's params with this model alone, its VARIANTS' builds under SCALE_LIMITS,
    and the serving workload at 1 and 8 streams; PyTorch's float32 baseline is off (at 3B it would
    need 16 GB)."""
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params["models"] = {name: {"source": {"kind": "local", "path": str(source)}, "exporter": "auto"}}
    params["builds"] = {f"{name}-{v}": {"model": name, "variant": v, "thresholds": SCALE_LIMITS} for v in VARIANTS}
    params["bench"] |= {"baseline": False}
    params["bench"]["concurrency"] = {**params["bench"].get("concurrency", {}), "streams": [1, STREAMS]}
    return params


def project(name: str, source: Path, workdir: Path) -> Path:
    """A fresh git + DVC repository with the project's code, DVC config and this model's params."""
    folder = workdir / "projects" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for item in PROJECT_FILES:
        if (REPO / item).is_dir():
            shutil.copytree(REPO / item, folder / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / item, folder / item)
    (folder / "params.yaml").write_text(yaml.safe_dump(scale_params(name, source), sort_keys=False), encoding="utf-8")
    for command in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(command, cwd=folder, check=True)
    shutil.copy2(REPO / ".dvc" / "config", folder / ".dvc" / "config")
    return folder


def build(name: str, folder: Path, export_only: bool) -> dict:
    """ortforge's build of the model in folder; per stage, what the stage recorded."""
    costs = folder / "costs.jsonl"
    env = {**os.environ, "ORTFORGE_STAGE_COSTS": str(costs), "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1"}
    if export_only:
        command = [sys.executable, "-m", "dvc", "repro", f"quantize@{name}-int4"]
    else:
        command = [sys.executable, "-m", "ortforge.cli", "--root", str(folder), "build", "--model", name]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: build failed: {(done.stdout + done.stderr)[-3000:]}")
    stages = [json.loads(line) for line in costs.read_text(encoding="utf-8").splitlines()]
    artifacts = folder / "artifacts" / name
    variants = [artifacts / "variants" / v for v in VARIANTS if (artifacts / "variants" / v).is_dir()]
    return {
        "wall_seconds": round(time.perf_counter() - started, 1),
        "stages": stages,
        "disk": {
            "workspace_and_cache_bytes": disk_bytes(folder / "artifacts", folder / ".dvc" / "cache"),
            "artifacts_bytes": disk_bytes(*variants),
            "checkpoint_bytes": disk_bytes(artifacts / "hf"),
        },
        "reports": {v: _report(folder, name, v) for v in VARIANTS},
    }


def _report(folder: Path, name: str, variant: str) -> dict:
    found = {}
    for kind in ("validate", "bench"):
        path = folder / "reports" / name / "variants" / variant / f"{kind}.json"
        if path.is_file():
            found[kind] = json.loads(path.read_text(encoding="utf-8"))
    return found


# Peak memory per byte of the bfloat16 checkpoint, measured at 1B here: genai's builder loads the
# model in float32 and writes it (10.2 GB for 2.5 GB); optimum-cli's NNCF compresses node by node.
PEER_MEMORY_PER_CHECKPOINT_BYTE = {"genai": 4.5, "openvino": 1.5}


def peer_figures(peer: str, run_peer, source: Path) -> dict:
    """The peer's figures, or why it did not run: a machine too small for it, or its failure."""
    import psutil

    needed = PEER_MEMORY_PER_CHECKPOINT_BYTE[peer.split()[0]] * random_models.checkpoint_bytes(source)
    available = psutil.virtual_memory().available
    if needed > available:
        return {"skipped": f"would need about {needed / GB:.0f} GB of memory; {available / GB:.0f} GB are available"}
    try:
        return run_peer()
    except RuntimeError as error:  # killed by the kernel, or the tool failed on this model
        return {"failed": str(error)}


def genai_build(source: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out)]
    figures = rusage_run(command + ["-p", "int4", "-e", "cpu", "-c", str(out.parent / "genai-cache")])
    return figures | {"tool": "onnxruntime-genai builder", "version": _version("onnxruntime-genai"), "recipe": "int4"}


def openvino_build(python: Path, source: Path, out: Path, weight_format: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    figures = rusage_run(openvino_peer.export_command(python, source, out, weight_format))
    version = openvino_peer.version(python)
    return figures | {"tool": "OpenVINO optimum-cli", "version": version, "recipe": openvino_peer.recipe(weight_format)}


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


def prompts(source: Path) -> tuple[list[int], list[list[list[int]]]]:
    """The batch-1 prompt and, per stream, its requests' prompts: slices of the bench text."""
    from tokenizers import Tokenizer

    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    text = params["bench"].get("text", "data/eval/GPL-3.txt")
    ids = Tokenizer.from_file(str(source / "tokenizer.json")).encode((REPO / text).read_text(encoding="utf-8")).ids
    return ids[:PROMPT_TOKENS], stream_prompts(ids, STREAMS, REQUESTS, PROMPT_TOKENS)


def openvino_run(python: Path, model: Path, command: str, data, scratch: Path) -> dict:
    options = ["--new-tokens", str(NEW_TOKENS)]
    if command == "generate":
        options += ["--warmup", "1", "--repeats", "3"]
    return openvino_peer.run(python, model, command, data, scratch, options)


def runtime(
    folder: Path, name: str, genai_dir: Path, openvino: Path | None, ov_models: dict[str, Path], rounds: int
) -> dict:
    """Batch-1 and 8-stream figures of ortforge's RUNTIME_VARIANTS and OpenVINO GenAI's exports
    (CPU defaults; ov_models: weight format -> its export, run by the venv's python `openvino`),
    batch-1 of onnxruntime-genai's int4; interleaved over rounds, each engine in its own fresh
    process."""
    from tasks.measurement import concurrency
    from tasks.measurement.timing import in_fresh_process

    variants = folder / "artifacts" / name / "variants"
    prompt, streams = prompts(variants / "int4")
    scratch = folder / "runtime"
    scratch.mkdir(exist_ok=True)
    ours = {f"ortforge {v}": variants / v for v in RUNTIME_VARIANTS}
    peers = {f"OpenVINO GenAI {f} (CPU defaults)": model for f, model in ov_models.items()}
    results: dict[str, dict] = {engine: {"batch1": [], "streams": []} for engine in [*ours, *peers]}
    results["onnxruntime-genai int4"] = {"batch1": []}
    for round_index in range(rounds):
        print(f"{name}: runtime round {round_index + 1}/{rounds}", flush=True)
        for engine, variant in ours.items():
            spec = {"kind": "ort", "path": str(variant), "tuned": True}
            results[engine]["batch1"].append(in_fresh_process(engines.measure, spec, prompt, NEW_TOKENS, 1, 3))
            results[engine]["streams"].append(  # the settings the runtime gives it here, as under `ortforge serve`
                in_fresh_process(concurrency.measure_load, str(variant), streams, NEW_TOKENS, None, 0)
            )
        genai = {"kind": "genai", "path": str(genai_dir)}
        results["onnxruntime-genai int4"]["batch1"].append(
            in_fresh_process(engines.measure, genai, prompt, NEW_TOKENS, 1, 3)
        )
        for engine, model in peers.items():
            results[engine]["batch1"].append(openvino_run(openvino, model, "generate", prompt, scratch))
            results[engine]["streams"].append(openvino_run(openvino, model, "load", streams, scratch))
    return results


# ---- what the results say: tables, goals, a plot (scripts/readme_figures.py fills the README from them)

STAGE_ORDER = ("download", "export", "optimize", "reference", "quantize", "validate", "bench", "report")


def by_size(report: dict) -> list[tuple[str, dict]]:
    """The models, smallest first (a --merge run appends sizes in any order)."""
    return sorted(report["models"].items(), key=lambda item: item[1]["parameters"])


def stage_costs(entry: dict) -> dict[str, dict]:
    """Per DVC stage name without the model (export, quantize-int4...), what it recorded."""
    found = {}
    for record in entry["ortforge"]["stages"]:
        kind, _, target = record["stage"].partition("@")
        variant = target.rpartition("-")[2] if kind in ("quantize", "validate", "bench") else None
        found[f"{kind} {variant}" if variant else kind] = record
    return dict(sorted(found.items(), key=lambda item: (STAGE_ORDER.index(item[0].split()[0]), item[0])))


def _gb(value: float) -> str:
    return f"{value / GB:.1f}"


def table(report: dict) -> str:
    """One row per model and stage: wall time, peak memory and the preflight's estimate."""
    lines = [
        "| model (random weights) | parameters | stage | wall s | peak memory GB | estimate GB |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in by_size(report):
        for index, (stage, record) in enumerate(stage_costs(entry).items()):
            first = f"{name}{' (export + int4 only)' if entry['export_only'] else ''}" if index == 0 else ""
            params = f"{entry['parameters'] / 1e9:.2f}B" if index == 0 else ""
            estimate = _gb(record["estimated_memory_bytes"]) if "estimated_memory_bytes" in record else "-"
            lines.append(
                f"| {first} | {params} | {stage} | {record['seconds']:.0f} | {_gb(record['peak_rss_bytes'])} | "
                f"{estimate} |"
            )
    return "\n".join(lines)


def export_and_int4(entry: dict) -> dict:
    """ortforge's export (with optimize) and int4 quantize: seconds summed, the larger peak."""
    costs = stage_costs(entry)
    parts = [costs[k] for k in ("export", "optimize", "quantize int4") if k in costs]
    return {"seconds": sum(p["seconds"] for p in parts), "peak_rss_bytes": max(p["peak_rss_bytes"] for p in parts)}


def peers_table(report: dict) -> str:
    """Checkpoint to int4 (and int8) artifact: ortforge's stages against the peers' one command."""
    lines = [
        "| model | ortforge export + int4 | onnxruntime-genai builder int4 | OpenVINO optimum-cli int4 g32 "
        "| ortforge int8 quantize | OpenVINO optimum-cli int8 | ortforge / genai time |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(figures: dict | None) -> str:
        if not figures:
            return "-"
        if "seconds" not in figures:
            return f"not run: {figures['skipped']}" if "skipped" in figures else f"failed: {figures['failed']}"
        return f"{figures['seconds']:.0f} s, {_gb(figures['peak_rss_bytes'])} GB"

    for name, entry in by_size(report):
        ours, peers = export_and_int4(entry), entry["peers"]
        int8 = stage_costs(entry).get("quantize int8")
        genai = peers.get("genai int4")
        ratio = f"x{ours['seconds'] / genai['seconds']:.2f}" if genai and "seconds" in genai else "-"
        lines.append(
            f"| {name} | {cell(ours)} | {cell(genai)} | {cell(peers.get('openvino int4'))} | {cell(int8)} | "
            f"{cell(peers.get('openvino int8'))} | {ratio} |"
        )
    return "\n".join(lines)


def disk_table(report: dict) -> str:
    lines = [
        "| model | workspace + DVC cache GB | artifacts (the variants built) GB | checkpoint GB | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, entry in by_size(report):
        disk = entry["ortforge"]["disk"]
        base = disk["artifacts_bytes"] + disk["checkpoint_bytes"]
        lines.append(
            f"| {name} | {_gb(disk['workspace_and_cache_bytes'])} | {_gb(disk['artifacts_bytes'])} | "
            f"{_gb(disk['checkpoint_bytes'])} | x{disk['workspace_and_cache_bytes'] / base:.2f} |"
        )
    return "\n".join(lines)


def runtime_summary(runs: dict) -> dict[str, dict]:
    """Per engine: batch-1 decode tok/s and first token (medians over rounds), 8-stream figures."""
    summary = {}
    for engine, figures in runs.items():
        batch1 = figures["batch1"]
        steps = [ms for run in batch1 for ms in _step_ms(run)]
        firsts = [s for run in batch1 for s in run["first_token_s"]]
        row = {"decode_tok_s": 1000 / float(np.median(steps)), "first_token_ms": 1000 * float(np.median(firsts))}
        if figures.get("streams"):
            row["streams_tok_s"] = float(np.median([_rate(run) for run in figures["streams"]]))
            row["streams_first_token_p95_ms"] = 1000 * float(np.median([_first_p95(run) for run in figures["streams"]]))
        summary[engine] = row
    return summary


def _step_ms(run: dict) -> list[float]:
    if "decode_ms_per_token" in run:  # the OpenVINO runner's field before it wrote step_s
        return run["decode_ms_per_token"]
    return [1000 * s for repeat in run["step_s"] for s in repeat]


def _rate(run: dict) -> float:
    return run.get("tokens_per_s") or run["aggregate_tokens_per_second"]


def _first_p95(run: dict) -> float:
    """Seconds to the first token, p95 over one streams run's requests (the OpenVINO runner lists them)."""
    if "seconds_to_first_token_p95" in run:
        return run["seconds_to_first_token_p95"]
    return float(np.percentile(run["first_token_s"], 95))


def runtime_table(report: dict) -> str:
    lines = [
        f"| engine (same run, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens) | batch-1 decode tok/s "
        f"| first token ms | {STREAMS} streams aggregate tok/s | first token p95 ms at {STREAMS} |",
        "|---|---|---|---|---|",
    ]
    for name, entry in by_size(report):
        if "runtime" not in entry:
            continue
        for engine, row in runtime_summary(entry["runtime"]).items():
            streams = f"{row['streams_tok_s']:.1f}" if "streams_tok_s" in row else "-"
            first = f"{row['streams_first_token_p95_ms']:.0f}" if "streams_first_token_p95_ms" in row else "-"
            lines.append(
                f"| {name}: {engine} | {row['decode_tok_s']:.1f} | {row['first_token_ms']:.0f} | {streams} | {first} |"
            )
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def goals(report: dict) -> str:
    """The issue's goals, each against the figure that judges it, met or not."""
    models, lines = dict(by_size(report)), []

    def peak(entry: dict) -> float:
        return max(r["peak_rss_bytes"] for r in entry["ortforge"]["stages"])

    for name, limit in (("llama-3.2-1b", 4), ("llama-3.2-3b", 8), ("llama-3.1-8b", 16)):
        if name in models:
            what = "export + int4 quantize" if models[name]["export_only"] else "every stage"
            worst = peak(models[name]) / GB
            lines.append(f"- {name}, {what}: peak {worst:.1f} GB (goal at most {limit} GB: {verdict(worst <= limit)})")
    for name, entry in models.items():
        if "seconds" in entry["peers"].get("genai int4", {}):
            ratio = export_and_int4(entry)["seconds"] / entry["peers"]["genai int4"]["seconds"]
            lines.append(
                f"- {name}: export + int4 in x{ratio:.2f} the time of onnxruntime-genai's builder "
                f"(goal at most x1.5: {verdict(ratio <= 1.5)})"
            )
    for name, entry in models.items():
        disk = entry["ortforge"]["disk"]
        if not entry["export_only"]:
            ratio = disk["workspace_and_cache_bytes"] / (disk["artifacts_bytes"] + disk["checkpoint_bytes"])
            lines.append(
                f"- {name}: workspace + cache x{ratio:.2f} the artifacts plus the checkpoint "
                f"(goal at most x1.5: {verdict(ratio <= 1.5)})"
            )
    for name, entry in models.items():
        if "runtime" in entry:
            rows = runtime_summary(entry["runtime"])
            ratio = rows["ortforge int4"]["decode_tok_s"] / rows["onnxruntime-genai int4"]["decode_tok_s"]
            lines.append(
                f"- {name}: int4 decodes at x{ratio:.2f} onnxruntime-genai's int4 "
                f"(goal at least x1: {verdict(ratio >= 1)})"
            )
            lines += under_load_goals(name, rows)
    return "\n".join(lines)


def under_load_goals(name: str, rows: dict[str, dict]) -> list[str]:
    """Issue 23's concurrent-load goals at this size: ortforge's best at STREAMS streams against
    OpenVINO GenAI's best, and first-token p95 against that peer's (speed only: random weights
    say nothing of quality)."""
    ours = {e: r for e, r in rows.items() if e.startswith("ortforge") and "streams_tok_s" in r}
    peers = {e: r for e, r in rows.items() if e.startswith("OpenVINO") and "streams_tok_s" in r}
    if not ours or not peers:
        return []
    best, peer = (max(group, key=lambda e: group[e]["streams_tok_s"]) for group in (ours, peers))
    ratio = rows[best]["streams_tok_s"] / rows[peer]["streams_tok_s"]
    first = rows[best]["streams_first_token_p95_ms"] / rows[peer]["streams_first_token_p95_ms"]
    return [
        f"- {name}, {STREAMS} streams: {best} {rows[best]['streams_tok_s']:.1f} tok/s, x{ratio:.2f} {peer} "
        f"(goal at least x1.2: {verdict(ratio >= 1.2)}); first-token p95 x{first:.2f} the peer's "
        f"(goal at most x1: {verdict(first <= 1)})"
    ]


def plot(report: dict, path: Path) -> None:
    """Peak memory and wall time of each stage against parameters, the peers beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    for axis in axes:  # eleven stages: ten default colors would repeat one
        axis.set_prop_cycle(color=plt.cm.tab20.colors)
    entries = sorted(report["models"].values(), key=lambda e: e["parameters"])
    stages = sorted(
        {stage for e in entries for stage in stage_costs(e)}, key=lambda s: (STAGE_ORDER.index(s.split()[0]), s)
    )
    for stage in stages:
        points = [(e["parameters"] / 1e9, stage_costs(e)[stage]) for e in entries if stage in stage_costs(e)]
        x = [p for p, _ in points]
        axes[0].plot(x, [r["peak_rss_bytes"] / GB for _, r in points], marker="o", label=f"ortforge {stage}")
        axes[1].plot(x, [r["seconds"] for _, r in points], marker="o", label=f"ortforge {stage}")
    for peer in sorted({peer for e in entries for peer in e["peers"]}):
        points = [(e["parameters"] / 1e9, e["peers"][peer]) for e in entries if "seconds" in e["peers"].get(peer, {})]
        x = [p for p, _ in points]
        style = {"linestyle": ":" if "int8" in peer else "--", "marker": "s"}
        style["color"] = "black" if "genai" in peer else "grey"
        axes[0].plot(x, [r["peak_rss_bytes"] / GB for _, r in points], label=peer, **style)
        axes[1].plot(x, [r["seconds"] for _, r in points], label=peer, **style)
    axes[0].set_ylabel("peak resident memory, GB")
    axes[1].set_ylabel("wall time, s")
    axes[1].set_yscale("log")
    for axis in axes:
        axis.set_xlabel("parameters, billions (random weights, real configs)")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    figure.suptitle(f"Building as models grow ({report['machine']['cpu_count']} cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=["qwen2.5-0.5b", "llama-3.2-1b", "llama-3.2-3b"])
    parser.add_argument("--export-only", nargs="*", default=["llama-3.1-8b"])
    parser.add_argument("--runtime-at", default="llama-3.2-1b", help="the size whose built int4 runs beside the peers")
    parser.add_argument("--openvino", type=Path, default=openvino_peer.PYTHON)
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / ".cache" / "scale")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--render", action="store_true", help="only redraw scale.png from scale.json")
    parser.add_argument("--keep", action="store_true", help="keep each model's project and peer outputs")
    parser.add_argument(
        "--merge", action="store_true", help="keep scale.json's other models (each entry records its own commit)"
    )
    args = parser.parse_args(argv)
    if args.render:
        plot(json.loads((RESULTS / "scale.json").read_text(encoding="utf-8")), RESULTS / "scale.png")
        return 0
    if not (TOKENIZER / "tokenizer.json").is_file():
        raise SystemExit(f"{TOKENIZER} has no tokenizer.json; run `dvc repro download@smollm2-135m` first")
    openvino = args.openvino if args.openvino.is_file() else None
    report = {
        # Random-weight models it makes itself: nothing in dvc.lock describes them; with --merge the
        # sizes come from different runs, so each records its own commit (models.<name>.measured).
        "provenance": provenance.record(provenance.command("scale.py", argv)) | PER_MODEL_COMMITS,
        "machine": {"cpu_count": os.cpu_count(), "memory_bandwidth_gb_s": round(memory_bandwidth_gb_s(), 1)},
        "limits": {"name": LIMITS_NAME, "values": SCALE_LIMITS},
        "openvino": str(openvino) if openvino else f"not installed ({openvino_peer.SETUP})",
        "models": {},
    }
    if args.merge and (RESULTS / "scale.json").is_file():
        earlier = json.loads((RESULTS / "scale.json").read_text(encoding="utf-8"))
        if earlier["machine"]["cpu_count"] != report["machine"]["cpu_count"]:
            raise SystemExit("scale.json was measured on another machine; run every size again without --merge")
        report["models"] = {k: v for k, v in earlier["models"].items() if k not in [*args.sizes, *args.export_only]}
    for name in [*args.sizes, *args.export_only]:
        export_only = name in args.export_only
        source = checkpoint(name, args.workdir)
        folder = project(model_name(name), source, args.workdir)
        print(f"{name}: building ({'export and int4 only' if export_only else 'every stage'})", flush=True)
        entry = {
            "config": random_models.CONFIGS[name],
            "parameters": random_models.parameter_count(random_models.CONFIGS[name]),
            "export_only": export_only,
            "measured": measured_on(),
            "ortforge": build(model_name(name), folder, export_only),
            "peers": {},
        }
        genai_dir = args.workdir / "peers" / name / "genai-int4"
        peers = {"genai int4": functools.partial(genai_build, source, genai_dir)}
        if openvino is not None:
            for weight_format in OPENVINO_FORMATS:
                out = args.workdir / "peers" / name / f"openvino-{weight_format}"
                peers[f"openvino {weight_format}"] = functools.partial(
                    openvino_build, openvino, source, out, weight_format
                )
        for peer, run_peer in peers.items():
            print(f"{name}: {peer}", flush=True)
            entry["peers"][peer] = peer_figures(peer, run_peer, source)
        if name == args.runtime_at and not export_only:
            ov_models = {
                weight_format: args.workdir / "peers" / name / f"openvino-{weight_format}"
                for weight_format in (OPENVINO_FORMATS if openvino else ())
                if "seconds" in entry["peers"][f"openvino {weight_format}"]  # exported
            }
            entry["runtime"] = runtime(folder, model_name(name), genai_dir, openvino, ov_models, args.rounds)
        report["models"][name] = entry
        atomic_write_json(RESULTS / "scale.json", report)  # what is measured so far survives a later failure
        if not args.keep:  # an 8B project and its peers' outputs are about 50 GB
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(args.workdir / "peers" / name, ignore_errors=True)
    plot(report, RESULTS / "scale.png")
    print("\n\n".join((table(report), peers_table(report), disk_table(report), runtime_table(report), goals(report))))
    print(f"wrote {RESULTS / 'scale.json'} and scale.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

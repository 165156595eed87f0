"""The KV cache's storage against its cost: bytes per token, perplexity against the float cache,
decode speed at growing contexts, and the server's peak RSS with 8 streams of 2,048 tokens.

    python benchmarks/kv_cache.py [--model smollm2-135m] [--variants int4,int4_kv8]
                                  [--contexts 128,1024,2048] [--rounds 2] [--streams 8]

The first variant is the float-cache reference (same weights). Decode: one process per variant and
round (rounds interleave the variants), every variant with the same session settings (the
reference's tuned ones: the rows differ only in the cache), a prefill of each context's tokens of
data/eval/GPL-3.txt, then 32 timed greedy steps. Quality: the validate stage's figures (reports/
<model>/variants/<v>/validate.json), per evaluation text, against the reference variant's, and
the cached-decode gap over its float cache. Memory: `ortforge serve` as a user runs it (each
variant's own tuned settings) with --streams slots, as many concurrent requests of (context - 64)-
token prompts and 64 new tokens, VmHWM of the server process. Writes benchmarks/results/
kv_cache.json (with its provenance) and kv_cache.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from benchmarks.engines import CONTEXT_STEPS as STEPS  # noqa: E402
from benchmarks.engines import decode_at_contexts  # noqa: E402
from benchmarks.serving import free_port, one_request, ortforge_command, peak_rss_mb, started  # noqa: E402
from ortforge.session import SessionSettings  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.measurement.concurrency import run_streams  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TEXTS = [REPO / "data" / "eval" / "GPL-3.txt", REPO / "data" / "eval" / "lstrlib.c"]


def text_ids(folder: Path) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [i for text in TEXTS for i in tokenizer.encode(text.read_text(encoding="utf-8")).ids]


def quality(model: str, variant: str, reference: str) -> dict:
    """Per evaluation text, the variant's perplexity over the float-cache reference variant's."""
    read = lambda v: json.loads((paths.variant_reports(model) / v / "validate.json").read_text(encoding="utf-8"))  # noqa: E731
    ours, theirs = read(variant), read(reference)
    ratios = {text: ours["texts"][text]["perplexity"] / theirs["texts"][text]["perplexity"] for text in ours["texts"]}
    return {
        "ppl_over_float_cache": ratios,
        "worst_ppl_over_float_cache": max(ratios.values()),
        "kl_divergence_from_fp32": ours["kl_divergence"],
        "ppl_ratio_to_fp32": ours["ppl_ratio"],
        "cached_decode_gap": ours["kv_max_prob_diff"],  # against the same graph's full pass, worst text
    }


def server_memory(folder: Path, model_id: str, ids: list[int], streams: int, context: int) -> dict:
    """Peak RSS of `ortforge serve` while streams requests of context tokens run at once."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    stride = max(1, (len(ids) - context) // max(1, streams - 1))
    prompts = [tokenizer.decode(ids[i * stride : i * stride + context - 64]) for i in range(streams)]
    port = free_port()
    server = started(ortforge_command(folder, port, streams) + ["--prefix-cache-mb", "0"], port)
    try:
        url = f"http://127.0.0.1:{port}"
        run_streams([[prompt] for prompt in prompts], lambda prompt: one_request(url, model_id, prompt, 64))
        rss = peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"  {folder.name}: {streams} x {context} tokens, server peak RSS {rss:.0f} MB", flush=True)
    return {"streams": streams, "context_tokens": context, "peak_rss_mb": rss}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    variants = report["variants"]
    for name, figures in variants.items():
        contexts = sorted(figures["decode_ms_p50"], key=int)
        times = [figures["decode_ms_p50"][c] for c in contexts]
        speed.plot([int(c) for c in contexts], times, "o-", label=f"{name} ({figures['kv_cache']})")
    speed.set(xlabel="context (tokens)", ylabel="decode ms per token, p50", title="decode against context")
    speed.legend(fontsize=8)
    speed.grid(alpha=0.3)
    names = list(variants)
    memory.bar(names, [variants[n]["server"]["peak_rss_mb"] for n in names], color="#3b75af")
    first = variants[names[0]]["server"]
    memory.set(ylabel="MB", title=f"server peak RSS, {first['streams']} x {first['context_tokens']} tokens")
    figure.suptitle(f"{report['model']}: KV cache storage ({report['cpus']} cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def gap(figures: dict) -> str:
    """The cached-decode gap, or `-` in a file measured before kv_cache.py recorded it."""
    return f"{figures['cached_decode_gap']:.4f}" if "cached_decode_gap" in figures else "-"


def table(report: dict) -> str:
    # JSON keeps the contexts sorted as text
    contexts = sorted(next(iter(report["variants"].values()))["decode_ms_p50"], key=int)
    lines = [
        "| variant | KV cache | KV bytes/token | ppl / float cache | KL from fp32 | cached-decode gap | "
        + " | ".join(f"decode ms @{c}" for c in contexts)
        + " | server RSS MB |",
        "|---|---|---|---|---|---|" + "---|" * len(contexts) + "---|",
    ]
    for name, v in report["variants"].items():
        lines.append(
            f"| {name} | {v['kv_cache']} | {v['kv_bytes_per_token']:,} | {v['worst_ppl_over_float_cache']:.4f} | "
            f"{v['kl_divergence_from_fp32']:.4f} | {gap(v)} | "
            + " | ".join(f"{v['decode_ms_p50'][c]:.2f}" for c in contexts)
            + f" | {v['server']['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="int4,int4_kv8", help="the first is the float-cache reference")
    parser.add_argument("--contexts", default="128,1024,2048")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    folders = {v: paths.variant_dir(args.model, v) for v in variants}
    for folder in folders.values():
        if not (folder / "model.onnx").is_file():
            raise SystemExit(f"error: {folder} is missing; run `dvc repro` first")
    measured = provenance.model_outputs(args.model, variants)
    provenance.require_current(measured)
    settings = SessionSettings.for_artifact(folders[variants[0]]).to_dict()
    ids = text_ids(folders[variants[0]])
    if len(ids) < max(contexts) + STEPS:
        raise SystemExit(f"error: the evaluation texts have {len(ids)} tokens, fewer than the largest context")
    steps: dict[str, dict[str, list]] = {v: {str(c): [] for c in contexts} for v in variants}
    kv_bytes = {}
    for round_index in range(args.rounds):
        for variant in variants:
            print(f"round {round_index + 1}/{args.rounds}: decode at {contexts} on {variant}", flush=True)
            result = in_fresh_process(decode_at_contexts, str(folders[variant]), ids, contexts, settings)
            kv_bytes[variant] = result["kv_bytes_per_token"]
            for context, timed in result["steps"].items():
                steps[variant][context] += timed
    report = {
        "provenance": provenance.record(provenance.command("kv_cache.py", argv), measured),
        "model": args.model,
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "steps": STEPS,
        "decode_session_settings": {"every variant": settings, "from": f"{variants[0]}.runtime.json"},
        "server_session_settings": "each variant's own tuned settings (what `ortforge serve` uses)",
        "variants": {},
    }
    for variant in variants:
        manifest = json.loads((folders[variant] / "manifest.json").read_text(encoding="utf-8"))
        report["variants"][variant] = {
            "kv_cache": manifest["params"].get("kv_cache", "float"),
            "kv_bytes_per_token": kv_bytes[variant],
            "decode_ms_p50": {c: float(np.percentile(s, 50) * 1e3) for c, s in steps[variant].items()},
            "decode_ms_p95": {c: float(np.percentile(s, 95) * 1e3) for c, s in steps[variant].items()},
            **quality(args.model, variant, variants[0]),
        }
    print(f"server memory: {args.streams} streams of {max(contexts)} tokens", flush=True)
    for variant in variants:
        report["variants"][variant]["server"] = server_memory(
            folders[variant], f"{args.model}/{variant}", ids, args.streams, max(contexts)
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "kv_cache.json", report)
    plot(report, RESULTS / "kv_cache.png")
    print(table(report))
    print(f"wrote {RESULTS / 'kv_cache.json'} and kv_cache.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

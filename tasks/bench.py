"""Time one validated variant on a fixed generation workload, beside PyTorch fp32 with its KV cache.

Reads artifacts/<model>/variants/<variant> and its validation stamp (an unvalidated variant is not
benchmarked), artifacts/<model>/hf for the baseline, and params.yaml `bench`; writes
reports/<model>/variants/<variant>/bench.json (a DVC metric): time to first token and decode
ms/token p50/p95, decode and prefill tokens/s, peak RSS, size on disk, and ratios to the baseline.

Each engine runs in its own fresh process (so peak RSS is its own), rounds interleave the engines
(so drift on a shared machine hits both alike), and warm-up runs are never timed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ortforge import machine
from ortforge.manifest import check_validated
from ortforge.names import CONTEXT_LENGTH_KEY, MODEL_FILE
from ortforge.session import SessionSettings
from tasks.core import paths, resources
from tasks.core.files import atomic_write_json, folder_bytes
from tasks.core.params import BenchConfig
from tasks.core.stage import StageError, stage_cli
from tasks.measurement import concurrency, timing
from tasks.measurement.timing import ORT, TORCH, in_fresh_process, measure_engine

log = logging.getLogger(__name__)
TUNED = "tasks.measurement.tuning"  # runtime.json's measured_by when tuning chose its settings


def summarize(runs: list[dict], prompt_tokens: int, size_bytes: int) -> dict:
    return timing.summarize(runs, prompt_tokens, size_bytes) | {"threads": runs[0]["threads"]}


def ratios(variant: dict, baseline: dict) -> dict:
    """How many times better than the baseline (>1 is better): speed up, memory and size down."""
    return {
        "decode_speedup": variant["decode_tokens_per_second"] / baseline["decode_tokens_per_second"],
        "first_token_speedup": baseline["seconds_to_first_token_p50"] / variant["seconds_to_first_token_p50"],
        "rss_reduction": baseline["peak_rss_mb"] / variant["peak_rss_mb"],
        "size_reduction": baseline["size_mb"] / variant["size_mb"],
    }


def prompt_ids(variant_dir: Path, text: Path, count: int) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(variant_dir / "tokenizer.json")).encode(text.read_text(encoding="utf-8")).ids
    if len(ids) < count:
        raise StageError(f"bench text {text} has {len(ids)} tokens, fewer than bench.prompt_tokens {count}")
    return ids[:count]


def check_fits_context(cfg: BenchConfig, variant_dir: Path) -> None:
    import onnx

    metadata = {
        p.key: p.value for p in onnx.load(str(variant_dir / MODEL_FILE), load_external_data=False).metadata_props
    }
    context = int(metadata.get(CONTEXT_LENGTH_KEY, 0))
    for where, load in (("bench", cfg), ("bench.concurrency", cfg.concurrency)):
        if context and load.prompt_tokens + load.new_tokens > context:
            raise StageError(
                f"{where}.prompt_tokens + {where}.new_tokens = {load.prompt_tokens + load.new_tokens} exceed the "
                f"model's context of {context} positions; lower them to fit"
            )


def kv_bytes_per_token(variant_dir: Path) -> int:
    from ortforge.decoder import Decoder

    return Decoder.for_artifact(variant_dir).kv_bytes_per_token


def serving_prompts(cfg: BenchConfig, variant_dir: Path) -> dict[int, list]:
    """Per concurrency level, each stream's request prompts (checked before any timing starts)."""
    load = cfg.concurrency
    if not load.streams:
        return {}
    shared = round(load.prompt_tokens * load.shared_prefix)
    needed = shared + (load.prompt_tokens - shared) * max(load.streams) * load.requests
    ids = prompt_ids(variant_dir, cfg.text, needed)
    return {
        streams: concurrency.request_prompts(ids, streams, load.requests, load.prompt_tokens, load.shared_prefix)
        for streams in load.streams
    }


def under_load(cfg: BenchConfig, variant_dir: Path, prompts: dict[int, list], session: dict | None) -> dict:
    """Per concurrency level (its own fresh process), the serving workload's figures."""
    figures = {}
    for streams, requests in prompts.items():
        log.info("serving workload: %d stream(s) on %s", streams, variant_dir)
        figures[str(streams)] = in_fresh_process(
            concurrency.measure_load,
            str(variant_dir),
            requests,
            cfg.concurrency.new_tokens,
            session,
            cfg.concurrency.prefix_cache_mb,
        )
    return figures


def runtime_settings(result: dict, cfg: BenchConfig) -> dict:
    if result["tuning"]:
        session, source = result["tuning"]["session"], TUNED
    else:
        session, source = SessionSettings(intra_op_threads=cfg.threads).to_dict(), "bench.tune false: not measured"
    return {"session": session, "measured_by": source, "machine": result["machine"]}


def chosen_before(runtime: Path) -> dict | None:
    """The settings tuning chose for this artifact on a machine like this one (the same CPU model
    and features), where this sweep starts; None when there are none, or they came from elsewhere."""
    try:
        recorded = json.loads(runtime.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if recorded.get("measured_by") != TUNED or recorded.get("machine") != machine.describe():
        return None
    return recorded.get("session")


def run(cfg: BenchConfig, variant_dir: Path, hf_dir: Path, before: dict | None = None) -> dict:
    """before: the settings chosen on this machine before (chosen_before), where tuning starts."""
    try:
        check_validated(variant_dir)
    except ValueError as error:
        raise StageError(f"{error}; only validated variants are benchmarked (dvc repro validate@...)") from None
    check_fits_context(cfg, variant_dir)
    prompt = prompt_ids(variant_dir, cfg.text, cfg.prompt_tokens)
    serving = serving_prompts(cfg, variant_dir)
    tuning = None
    if cfg.tune:
        from tasks.measurement.tuning import sweep

        log.info("choosing session settings for %s by measurement", variant_dir)
        tuning = in_fresh_process(sweep, str(variant_dir), prompt, cfg.new_tokens, 2, before)
        log.info("best settings %s", tuning["session"])
    engines = {ORT: variant_dir, **({TORCH: hf_dir} if cfg.baseline else {})}
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    workload = cfg.model_dump(mode="json")
    for round_index in range(cfg.rounds):
        for engine, model_dir in engines.items():
            log.info("round %d/%d: %s on %s", round_index + 1, cfg.rounds, engine, model_dir)
            session = tuning["session"] if tuning and engine == ORT else None
            runs[engine].append(in_fresh_process(measure_engine, engine, str(model_dir), prompt, workload, session))
    sizes = {ORT: folder_bytes(variant_dir, MODEL_FILE + "*"), TORCH: folder_bytes(hf_dir, "*.safetensors")}
    result = summarize(runs[ORT], cfg.prompt_tokens, sizes[ORT])
    result["workload"] = workload
    result["tuning"] = tuning
    result["machine"] = machine.describe()
    if cfg.baseline:
        result["baseline"] = summarize(runs[TORCH], cfg.prompt_tokens, sizes[TORCH])
        result["vs_baseline"] = ratios(result, result["baseline"])
    result["kv_bytes_per_token"] = kv_bytes_per_token(variant_dir)
    result["concurrency"] = under_load(cfg, variant_dir, serving, tuning["session"] if tuning else None)
    log.info(
        "%s: %.1f tokens/s decode (p50 %.1f ms), first token %.0f ms, peak RSS %.0f MB",
        variant_dir,
        result["decode_tokens_per_second"],
        result["decode_ms_per_token_p50"],
        result["seconds_to_first_token_p50"] * 1e3,
        result["peak_rss_mb"],
    )
    return result


def needs(a) -> resources.Needs:
    """Each engine runs in a process of its own, one after another: the larger of the variant's
    and, with bench.baseline, PyTorch's float32 model."""
    cfg = a.params.bench
    engine = resources.runtime_needs(a.paths["variant-dir"], cfg.prompt_tokens, "generation")
    if not cfg.baseline:
        return engine
    size = resources.ModelSize.of(a.paths["hf"])
    baseline = resources.BASE_MEMORY + 1.3 * size.total
    basis = f"{engine.basis}, then PyTorch's {resources.amount(size.total)} float32 baseline (bench.baseline)"
    return resources.Needs(max(engine.memory, baseline), 0, basis)


def main(argv: list[str] | None = None) -> int:
    flags = {
        "variant-dir": paths.variant_dir,
        "hf": paths.hf_dir,
        "report": paths.bench_json,
        "runtime": paths.runtime_config,
    }

    def body(a):
        p = a.paths
        result = run(a.params.bench, p["variant-dir"], p["hf"], chosen_before(p["runtime"]))
        # The runtime reads these settings by default (SessionSettings.for_artifact) on a machine
        # with the same CPU features; without tuning they are the ones bench measured with.
        atomic_write_json(p["runtime"], runtime_settings(result, a.params.bench))
        atomic_write_json(p["report"], result)

    return stage_cli("bench", __doc__, flags, body, argv, variant=True, needs=needs)


if __name__ == "__main__":
    raise SystemExit(main())

"""Choose onnxruntime session settings for one artifact by measuring them on the generation
workload, not by guessing: intra-op threads (1..cores), inter-op parallelism, graph optimization
level, memory pattern and arena, and the decoder's prefill chunk.

Coordinate descent: each setting in turn takes the value that generated fastest while the others
stay at their best so far (9 trials on 2 cores instead of 144 for the full grid), among the
settings the validate stage proved to leave the variant's logits as it checked them (a prefill
chunk only where it proved pieces, thread counts and graph levels where it proved each). The
objective is the whole workload's wall time (prefill plus every decode step), median of a few
runs, each trial with its own session and a warm-up. A prefill chunk, like every other setting, wins only by being
faster; an application that needs to bound activation memory on long prompts can set one itself.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from tasks.evaluation.deployment import PREFILL_CHUNKS

log = logging.getLogger(__name__)


def dimensions(cores: int) -> dict[str, list]:
    return {
        "intra_op_threads": list(range(1, cores + 1)),
        "inter_op_threads": [0, 2] if cores > 1 else [0],
        "graph_level": ["basic", "extended", "all"],
        "enable_mem_pattern": [True, False],
        "enable_cpu_mem_arena": [True, False],
        "prefill_chunk": list(PREFILL_CHUNKS),
    }


def workload_seconds(model_dir: Path, settings: dict, prompt: list[int], new_tokens: int, repeats: int) -> float:
    from ortforge.decoder import Decoder
    from ortforge.session import SessionSettings
    from tasks.measurement.timing import timed_generation

    decoder = Decoder.for_artifact(model_dir, SessionSettings.from_dict(settings))
    timed_generation(decoder, prompt, new_tokens)  # warm-up: first-run allocations and caches
    totals = []
    for _ in range(repeats):
        first, steps = timed_generation(decoder, prompt, new_tokens)
        totals.append(first + sum(steps))
    return float(np.median(totals))


def proven(model_dir: Path):
    """Which candidate settings leave the logits as validate checked them (its stamp's deployment,
    tasks/evaluation/deployment.py): a predicate over a settings dict. Without that record, none
    but onnxruntime's defaults."""
    from ortforge.manifest import deployment_record

    record = deployment_record(model_dir) or {}
    sessions = {(s["intra_op_threads"], s["graph_level"]) for s in record.get("session_settings", [])}
    sessions.add((0, "all"))  # onnxruntime's defaults: what validate itself ran

    def allowed(settings: dict) -> bool:
        pieces = not settings["prefill_chunk"] or record.get("prefill_pieces") is True
        return pieces and (settings["intra_op_threads"], settings["graph_level"]) in sessions

    return allowed


def sweep(model_dir: str, prompt: list[int], new_tokens: int, repeats: int = 2) -> dict:
    """Run in a fresh process; returns the best settings and every trial. Only settings validate
    proved to leave the logits as they were are tried (proven)."""
    from ortforge.session import SessionSettings

    cores = os.cpu_count() or 1
    allowed = proven(Path(model_dir))
    best = SessionSettings(intra_op_threads=cores).to_dict()
    if not allowed(best):
        best = SessionSettings().to_dict()
    best_seconds = workload_seconds(Path(model_dir), best, prompt, new_tokens, repeats)
    trials = [{"settings": dict(best), "seconds": best_seconds}]
    for name, values in dimensions(cores).items():
        for value in values:
            candidate = best | {name: value}
            if value == best[name] or not allowed(candidate):
                continue
            started = time.perf_counter()
            seconds = workload_seconds(Path(model_dir), candidate, prompt, new_tokens, repeats)
            trials.append({"settings": candidate, "seconds": seconds})
            log.debug("%s=%s: %.1f ms (trial took %.1f s)", name, value, seconds * 1e3, time.perf_counter() - started)
            if seconds < best_seconds:
                best, best_seconds = candidate, seconds
    return {"session": best, "workload_seconds": best_seconds, "trials": trials}

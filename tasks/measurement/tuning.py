"""Choose onnxruntime session settings for one artifact by measuring them on the generation
workload, not by guessing: intra-op threads (1..cores), inter-op parallelism, graph optimization
level, memory pattern and arena, and the decoder's prefill chunk.

Coordinate descent: each setting in turn takes the value that generated clearly fastest while the
others stay at their best so far (9 trials on 2 cores instead of 144 for the full grid), among the
settings the validate stage proved to leave the variant's logits as it checked them (a prefill
chunk only where it proved pieces, thread counts and graph levels where it proved each). The
objective is the whole workload's wall time (prefill plus every decode step), median of a few
runs, each trial with its own session and a warm-up. A prefill chunk, like every other setting,
wins only by being faster; an application that needs to bound activation memory on long prompts
can set one itself.

A setting changes only when it is clearly faster (clearly_faster): each of its runs beats each of
the current best's, and its median by at least MIN_GAIN, in its first trial and again in
CONFIRMATIONS rounds that measure the best and the candidate in turn, judged on those rounds alone.
Taking any faster median chose within noise: 15 of the 20 committed choices beat the defaults by
under 3%, and one re-run of every variant's bench changed 15 of them. Confirming with one more
trial of each, back to back and pooled with the first, still let two of 14 choices flip on a
re-run: this machine's speed drifts over minutes, and a stale slow trial of the best made a
candidate look ahead. A graph level whose optimized graph is the one the best level already runs
(onnxruntime's "extended" and "all" build the same graph for a decoder) is not measured at all:
between identical graphs only noise can choose.
The sweep starts from the settings this machine chose before (bench passes the artifact's
runtime.json when it was measured on a CPU with the same features), so a re-run keeps a choice
unless a candidate beats it clearly; without one, from onnxruntime's defaults with every core.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from tasks.evaluation.deployment import PREFILL_CHUNKS

log = logging.getLogger(__name__)
MIN_GAIN = 0.03  # the least median gain that changes a setting (noise re-ran to other choices below it)
CONFIRMATIONS = 2  # rounds of best-then-candidate trials a first win must also win


def dimensions(cores: int) -> dict[str, list]:
    return {
        "intra_op_threads": list(range(1, cores + 1)),
        "inter_op_threads": [0, 2] if cores > 1 else [0],
        "graph_level": ["basic", "extended", "all"],
        "enable_mem_pattern": [True, False],
        "enable_cpu_mem_arena": [True, False],
        "prefill_chunk": list(PREFILL_CHUNKS),
    }


def workload_runs(model_dir: Path, settings: dict, prompt: list[int], new_tokens: int, repeats: int) -> list[float]:
    """The workload's wall time (prefill plus every decode step) in each of `repeats` runs, after a warm-up."""
    from ortforge.decoder import Decoder
    from ortforge.session import SessionSettings
    from tasks.measurement.timing import timed_generation

    decoder = Decoder.for_artifact(model_dir, SessionSettings.from_dict(settings))
    timed_generation(decoder, prompt, new_tokens)  # warm-up: first-run allocations and caches
    totals = []
    for _ in range(repeats):
        first, steps = timed_generation(decoder, prompt, new_tokens)
        totals.append(first + sum(steps))
    return totals


def clearly_faster(runs: list[float], best_runs: list[float]) -> bool:
    """Each run faster than each of the best's, and the median by at least MIN_GAIN."""
    return max(runs) < min(best_runs) and float(np.median(runs)) <= (1 - MIN_GAIN) * float(np.median(best_runs))


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


def sweep(model_dir: str, prompt: list[int], new_tokens: int, repeats: int = 2, incumbent: dict | None = None) -> dict:
    """Run in a fresh process; returns the chosen settings and every trial. Only settings validate
    proved to leave the logits as they were are tried (proven). incumbent: the settings chosen on
    this machine before, where the sweep starts when they are still proven."""
    cores = os.cpu_count() or 1
    allowed = proven(Path(model_dir))
    best = start(incumbent, cores, allowed)
    trials = []

    def measure(settings: dict, confirming: bool = False) -> list[float]:
        runs = workload_runs(Path(model_dir), settings, prompt, new_tokens, repeats)
        trials.append(trial(settings, runs) | ({"confirming": True} if confirming else {}))
        log.debug("%s: %s ms", settings, [round(r * 1e3, 1) for r in runs])
        return runs

    graphs = GraphDigests(Path(model_dir))
    best_runs = measure(best)
    for name, values in dimensions(cores).items():
        for value in values:
            candidate = best | {name: value}
            if value == best[name] or not allowed(candidate):
                continue
            if name == "graph_level" and graphs.tried(value, best[name]):
                continue
            runs = measure(candidate)
            if not clearly_faster(runs, best_runs):
                continue
            # One trial's verdict can be luck: the best's trial may have run in a slow minute. Both
            # are measured again in turn, and the candidate must win those rounds on every run.
            again_best, again_candidate = [], []
            for _ in range(CONFIRMATIONS):
                again_best += measure(best, confirming=True)
                again_candidate += measure(candidate, confirming=True)
            best_runs = again_best
            if clearly_faster(again_candidate, again_best):
                best, best_runs = candidate, again_candidate
    return {
        "session": best,
        "workload_seconds": float(np.median(best_runs)),
        "trials": trials,  # the first trial's settings are where the sweep started
        "graph_levels": graphs.digests,  # the optimized graph each level built, where one was compared
    }


class GraphDigests:
    """The graph onnxruntime optimizes a model into at each graph level, as a digest of the saved
    graph (its nodes and where each weight lies, not the weights' bytes), built once per level."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.digests: dict[str, str] = {}
        self._measured: set[str] = set()

    def tried(self, level: str, best: str) -> bool:
        """Whether level builds the graph of the best level or of a level measured before it;
        if not, level counts as measured from now on."""
        self._measured.add(self.digest(best))
        graph = self.digest(level)
        if graph in self._measured:
            return True
        self._measured.add(graph)
        return False

    def digest(self, level: str) -> str:
        if level not in self.digests:
            self.digests[level] = optimized_graph_digest(self.model_dir, level)
        return self.digests[level]


def optimized_graph_digest(model_dir: Path, level: str) -> str:
    """onnxruntime writes the graph it optimized at level (weights to a scratch data file, which
    is dropped); its serialized form, initializers' locations included, is hashed."""
    import hashlib
    import tempfile

    import onnx
    import onnxruntime as ort

    from ortforge import custom_ops
    from ortforge.names import MODEL_FILE
    from ortforge.session import SessionSettings

    with tempfile.TemporaryDirectory(prefix="ortforge-graph-") as scratch:
        options = SessionSettings(graph_level=level).session_options()
        custom_ops.register(options, model_dir / MODEL_FILE)
        options.optimized_model_filepath = str(Path(scratch) / MODEL_FILE)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(model_dir / MODEL_FILE), options, providers=["CPUExecutionProvider"])
        saved = onnx.load(str(Path(scratch) / MODEL_FILE), load_external_data=False)
    return hashlib.sha256(saved.graph.SerializeToString()).hexdigest()


def start(incumbent: dict | None, cores: int, allowed) -> dict:
    """The incumbent when it is a complete, proven set of settings; else onnxruntime's defaults
    with every core (or with its own thread count where validate proved no other)."""
    from ortforge.session import SessionSettings

    defaults = SessionSettings(intra_op_threads=cores).to_dict()
    if incumbent is not None and set(incumbent) == set(defaults) and allowed(incumbent):
        return dict(incumbent)
    return defaults if allowed(defaults) else SessionSettings().to_dict()


def trial(settings: dict, runs: list[float]) -> dict:
    return {"settings": dict(settings), "seconds": float(np.median(runs)), "runs": runs}

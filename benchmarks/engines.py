"""The engines the side-by-side benchmark compares, each measured inside its own fresh process.

Every engine reports the same thing for one workload (prompt of N tokens, M greedy new tokens):
seconds to the first token and the seconds of each later token, for each repeat after warm-up,
plus the process's peak RSS. Loads that an engine needs (torch, genai, llama.cpp) happen in the
child process only.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np


class PlainDecoder:
    """onnxruntime without I/O binding: numpy feeds and fetches every step, the cache copied
    through Python each token. What the I/O-binding runtime is measured against."""

    def __init__(self, model_dir: Path, settings):
        from ortforge import Decoder, create_session

        self.inner = Decoder(create_session(model_dir, settings))  # for shapes and names only
        self.session = self.inner.session
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.inputs = {i.name for i in self.session.get_inputs()}

    def empty_cache(self):
        d = self.inner
        return [np.zeros((1, d.kv_heads, 0, d.head_dim), np.float32) for _ in range(2 * d.num_layers)]

    def forward(self, token_ids, cache, last_only: bool = False):
        from ortforge import names

        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, -1)
        length = cache[0].shape[2]
        feed = {names.INPUT_IDS: ids, **dict(zip(names.past_names(self.inner.num_layers), cache, strict=True))}
        if names.ATTENTION_MASK in self.inputs:
            feed[names.ATTENTION_MASK] = np.ones((1, length + ids.shape[1]), dtype=np.int64)
        if names.POSITION_IDS in self.inputs:
            feed[names.POSITION_IDS] = np.arange(length, length + ids.shape[1], dtype=np.int64).reshape(1, -1)
        if names.LOGITS_TO_KEEP in self.inputs:
            feed[names.LOGITS_TO_KEEP] = np.array([int(last_only)], dtype=np.int64)
        results = dict(zip(self.outputs, self.session.run(self.outputs, feed), strict=True))
        presents = [results[name] for name in names.present_names(self.inner.num_layers)]
        return results[names.LOGITS][0], presents


class RecomputeDecoder:
    """PyTorch without its KV cache: every token runs the whole sequence again."""

    def __init__(self, hf_dir: Path):
        from tasks.evaluation.torch_decoder import TorchDecoder

        self.inner = TorchDecoder(hf_dir)

    def empty_cache(self):
        return []

    def forward(self, token_ids, cache, last_only: bool = False):
        sequence = list(cache) + [int(t) for t in np.asarray(token_ids).reshape(-1)]
        logits, _ = self.inner.forward(sequence, self.inner.empty_cache(), last_only=True)
        return logits, sequence


class TimedRuns:
    """A decoder wrapper that records how long each model run takes."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, []

    def empty_cache(self):
        return self.inner.empty_cache()

    def forward(self, token_ids, cache, last_only: bool = False):
        start = time.perf_counter()
        result = self.inner.forward(token_ids, cache, last_only)
        self.seconds.append(time.perf_counter() - start)
        return result

    def rewind(self, cache, length: int):
        return self.inner.rewind(cache, length)


def _generate_with_lookup(decoder, prompt: list[int], new_tokens: int, draft_tokens: int, decode_runs: list):
    """(first-token seconds, per-token seconds) for prompt lookup decoding. A run that yields k
    tokens gives each of them 1/k of its time (the tokens arrive together); the time between runs
    (lookup, argmax) goes to the run after it, so the per-token times add up to the decode time.
    Appends the number of decode runs (prefill excluded) to decode_runs."""
    from ortforge.greedy import greedy_tokens

    timed = TimedRuns(decoder)
    start = time.perf_counter()
    runs_before, marks = [], []
    for _ in greedy_tokens(timed, prompt, new_tokens, prompt_lookup=draft_tokens):
        runs_before.append(len(timed.seconds))
        marks.append(time.perf_counter())
    first, previous, steps = marks[0] - start, marks[0], []
    for _, run_tokens in itertools.groupby(range(1, len(marks)), key=runs_before.__getitem__):
        tokens = list(run_tokens)  # the tokens one run yielded, in order
        steps += [(marks[tokens[-1]] - previous) / len(tokens)] * len(tokens)
        previous = marks[tokens[-1]]
    decode_runs.append(len(timed.seconds) - 1)
    return first, steps


def _decoder(spec: dict):
    from ortforge import Decoder, SessionSettings, create_session

    kind, path = spec["kind"], Path(spec["path"])
    if kind == "torch-kv":
        from tasks.evaluation.torch_decoder import TorchDecoder

        return TorchDecoder(path)
    if kind == "torch-nokv":
        return RecomputeDecoder(path)
    settings = SessionSettings.for_artifact(path) if spec.get("tuned") else SessionSettings()
    if kind == "ort-plain":
        return PlainDecoder(path, settings)
    return Decoder(create_session(path, settings))


def _generate(decoder, prompt: list[int], new_tokens: int, sample_steps: int | None):
    """(first-token seconds, per-step seconds). With sample_steps, only that many evenly spaced
    steps are run (for decoders whose every step recomputes everything) and the rest are
    interpolated linearly in sequence length; the spec says so in the results."""
    from tasks.measurement.timing import timed_generation

    if not sample_steps:
        return timed_generation(decoder, prompt, new_tokens)
    start = time.perf_counter()
    decoder.forward(prompt, decoder.empty_cache(), last_only=True)
    first = time.perf_counter() - start
    positions = np.linspace(1, new_tokens - 1, sample_steps).round().astype(int)
    timings = []
    for offset in positions:
        cache = list(prompt) + [0] * int(offset - 1)
        start = time.perf_counter()
        decoder.forward([0], cache, last_only=True)
        timings.append(time.perf_counter() - start)
    steps = np.interp(np.arange(1, new_tokens), positions, timings)
    return first, list(steps)


def _run_genai(path: Path, prompt: list[int], new_tokens: int):
    import onnxruntime_genai as og

    model = og.Model(str(path))

    def once():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)  # prefill; the first token comes with it
        first = time.perf_counter() - start
        steps = []
        while not generator.is_done():
            start = time.perf_counter()
            generator.generate_next_token()
            steps.append(time.perf_counter() - start)
        return first, steps

    return once


def _run_llamacpp(path: Path, prompt: list[int], new_tokens: int, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + new_tokens + 8, n_threads=threads, verbose=False)

    def once():
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        first = time.perf_counter() - start
        steps = []
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            steps.append(time.perf_counter() - start)
        return first, steps

    return once


def measure(spec: dict, prompt: list[int], new_tokens: int, warmup: int, repeats: int) -> dict:
    """Run in a fresh process: load the engine, then the bench stage's own timed runs."""
    import os

    from tasks.measurement.timing import timed_runs

    started = time.perf_counter()
    kind, decode_runs = spec["kind"], []
    if kind == "genai":
        once = _run_genai(Path(spec["path"]), prompt, new_tokens)
    elif kind == "llamacpp":
        once = _run_llamacpp(Path(spec["path"]), prompt, new_tokens, os.cpu_count() or 1)
    else:
        decoder = _decoder(spec)

        def once():
            if spec.get("prompt_lookup"):
                return _generate_with_lookup(decoder, prompt, new_tokens, spec["prompt_lookup"], decode_runs)
            return _generate(decoder, prompt, new_tokens, spec.get("sample_steps"))

    load_seconds = time.perf_counter() - started
    result = timed_runs(once, warmup, repeats)
    # prompt lookup only: how many decode runs each repeat took (its warm-up aside)
    return result | {"load_seconds": load_seconds, "decode_runs": decode_runs[-repeats:] if decode_runs else None}


CONTEXT_STEPS = 32  # timed decode steps after each context's prefill


def decode_at_contexts(folder: str, ids: list[int], contexts: list[int], settings: dict | None = None) -> dict:
    """Run in a fresh process: per context, ms per decode step after a prefill of that many tokens
    (settings: the session settings to use; None: the artifact's tuned ones)."""
    from ortforge.decoder import Decoder
    from ortforge.session import SessionSettings

    decoder = Decoder.for_artifact(Path(folder), SessionSettings.from_dict(settings) if settings else None)
    figures = {}
    for context in contexts:
        logits, cache = decoder.forward(ids[:context], decoder.empty_cache(), last_only=True)
        steps = []
        for _ in range(CONTEXT_STEPS):
            token = int(np.argmax(logits[-1]))
            start = time.perf_counter()
            logits, cache = decoder.forward([token], cache, last_only=True)
            steps.append(time.perf_counter() - start)
        figures[str(context)] = steps
    return {"steps": figures, "kv_bytes_per_token": decoder.kv_bytes_per_token}


def genai_quality(folder: str, reference_dir: str, params_file: str) -> dict:
    """Run in a fresh process (so it lives in an importable module, not a script's __main__):
    onnxruntime-genai's int4 graph scored as validate scores a variant
    (the same texts, windows and PyTorch reference: tasks.evaluation.metrics.compare), through
    ortforge's decoder over the graph genai's runtime runs (the same onnxruntime graph and kernels)."""
    from ortforge import names
    from ortforge.decoder import Decoder
    from ortforge.session import create_session
    from tasks.core.params import load_params
    from tasks.evaluation.metrics import Reference, compare

    config = json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))["model"]["decoder"]
    session = create_session(Path(folder))
    decoder = Decoder(session, head_dim=config["head_size"], layout=names.KV_SHARED)
    reference = Reference.load(Path(reference_dir))
    cfg = load_params(params_file).validation.eval
    per_text = {
        name: compare(decoder, text, cfg, reference.sequence_tokens)
        | {"reference_perplexity": reference.perplexity[name]}
        for name, text in reference.texts.items()
    }
    return quality_summary(per_text)


def quality_summary(per_text: dict) -> dict:
    """The worst over the evaluation texts, as validate reports a variant's."""
    ratios = [t["perplexity"] / t["reference_perplexity"] for t in per_text.values()]
    return {
        "ppl_ratio": max(ratios),
        "kl_divergence": max(t["kl_divergence"] for t in per_text.values()),
        "top1_agreement": min(t["top1_agreement"] for t in per_text.values()),
        "measured_by": "validate's texts and PyTorch reference",
    }

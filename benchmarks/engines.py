"""The engines the side-by-side benchmark compares, each measured inside its own fresh process.

Every engine reports the same thing for one workload (prompt of N tokens, M greedy new tokens):
seconds to the first token and the seconds of each later token, for each repeat after warm-up,
plus the process's peak RSS. Loads that an engine needs (torch, genai, llama.cpp) happen in the
child process only; OpenVINO GenAI runs in its own venv (benchmarks/peers/openvino_peer.py).

Quality is scored the way validate scores a variant (tasks.evaluation.metrics.compare: the same
texts, windows and PyTorch reference), through a decoder over each peer's own logits.
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

    def runs_like_any(self, total: int) -> bool:
        return self.inner.runs_like_any(total)


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
    from ortforge import SessionSettings

    kind, path = spec["kind"], Path(spec["path"])
    if kind == "torch-kv":
        from tasks.evaluation.torch_decoder import TorchDecoder

        return TorchDecoder(path)
    if kind == "torch-nokv":
        return RecomputeDecoder(path)
    settings = SessionSettings.for_artifact(path) if spec.get("tuned") else SessionSettings()
    if kind == "ort-plain":
        return PlainDecoder(path, settings)
    from ortforge.generate import TextGenerator

    decoder = TextGenerator(path, settings).decoder  # the runtime's: its prompt pieces, the runs validate proved
    if spec.get("whole_prompt"):
        decoder.prefill_chunk = 0
    return decoder


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


def llamacpp_without_amx() -> bool:
    """llama-cpp-python 0.3.36's extra CPU buffer types (its AMX path and repacked weights) crash
    (SIGSEGV) on a prompt of 4 tokens or more on this AMX CPU; one token at a time runs. Where the CPU
    has AMX they are turned off, and the result files say so."""
    from ortforge.machine import cpu_flags

    return "amx_int8" in cpu_flags()


def load_llamacpp(gguf: str, **options):
    import contextlib
    from unittest import mock

    import llama_cpp

    def without_extra_buffers(defaults=llama_cpp.llama_model_default_params):
        params = defaults()
        params.use_extra_bufts = False
        return params

    # Llama() reads its model params from llama_cpp.llama_cpp's defaults, with no option for this one.
    patched = (
        mock.patch.object(llama_cpp.llama_cpp, "llama_model_default_params", without_extra_buffers)
        if llamacpp_without_amx()
        else contextlib.nullcontext()
    )
    with patched:
        return llama_cpp.Llama(model_path=gguf, verbose=False, **options)


def _run_llamacpp(path: Path, prompt: list[int], new_tokens: int, threads: int):
    llm = load_llamacpp(str(path), n_ctx=len(prompt) + new_tokens + 8, n_threads=threads)

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


def _measure_openvino(spec: dict, prompt: list[int], new_tokens: int, warmup: int, repeats: int) -> dict:
    """OpenVINO GenAI's LLMPipeline timed by its runner, in its venv: the runner reports the
    fields timed_runs does, and its own process's load time and peak RSS."""
    import tempfile

    from benchmarks.peers import openvino_peer

    options = ["--new-tokens", str(new_tokens), "--warmup", str(warmup), "--repeats", str(repeats)]
    with tempfile.TemporaryDirectory(prefix="ortforge-openvino-") as scratch:
        result = openvino_peer.run(Path(spec["python"]), Path(spec["path"]), "generate", prompt, Path(scratch), options)
    fields = ("first_token_s", "step_s", "peak_rss_mb", "load_seconds")
    return {name: result[name] for name in fields} | {"decode_runs": None}


def measure(spec: dict, prompt: list[int], new_tokens: int, warmup: int, repeats: int) -> dict:
    """Run in a fresh process: load the engine, then the bench stage's own timed runs."""
    import os

    from tasks.measurement.timing import timed_runs

    if spec["kind"] == "openvino":
        return _measure_openvino(spec, prompt, new_tokens, warmup, repeats)
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


def _reference(reference_dir: str, params_file: str):
    from tasks.core.params import load_params
    from tasks.evaluation.metrics import Reference

    return Reference.load(Path(reference_dir)), load_params(params_file).validation.eval


def _scored(decoder, reference, cfg) -> dict:
    """validate's figures for a decoder on every text, the worst over the texts."""
    from tasks.evaluation.metrics import compare

    per_text = {
        name: compare(decoder, text, cfg, reference.sequence_tokens)
        | {"reference_perplexity": reference.perplexity[name]}
        for name, text in reference.texts.items()
    }
    return quality_summary(per_text)


def genai_quality(folder: str, reference_dir: str, params_file: str) -> dict:
    """Run in a fresh process (so it lives in an importable module, not a script's __main__):
    onnxruntime-genai's int4 graph through ortforge's decoder (the same onnxruntime graph and
    kernels genai's runtime runs)."""
    from ortforge import names
    from ortforge.decoder import Decoder
    from ortforge.session import create_session

    config = json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))["model"]["decoder"]
    decoder = Decoder(create_session(Path(folder)), head_dim=config["head_size"], layout=names.KV_SHARED)
    return _scored(decoder, *_reference(reference_dir, params_file))


class LlamaCppDecoder:
    """llama.cpp through llama-cpp-python as a decoder: the cache is the number of tokens it holds
    (its own KV cache, rewound by setting n_tokens), logits for every position (logits_all)."""

    def __init__(self, gguf: str, context: int, threads: int):
        self.llm = load_llamacpp(gguf, n_ctx=context, n_batch=512, n_threads=threads, logits_all=True)

    def empty_cache(self) -> int:
        return 0

    def forward(self, token_ids, cache: int, last_only: bool = False):
        ids = [int(t) for t in np.asarray(token_ids).reshape(-1)]
        self.llm.n_tokens = cache  # eval() drops the cache past n_tokens before it runs
        self.llm.eval(ids)
        return np.array(self.llm.scores[cache : cache + len(ids)], dtype=np.float32), cache + len(ids)


def llamacpp_quality(gguf: str, reference_dir: str, params_file: str) -> dict:
    """Run in a fresh process: llama.cpp on the GGUF the model was built from."""
    import os

    reference, cfg = _reference(reference_dir, params_file)
    decoder = LlamaCppDecoder(gguf, reference.sequence_tokens, os.cpu_count() or 1)
    summary = _scored(decoder, reference, cfg)
    # The reference is PyTorch on this same GGUF's weights, dequantized: the ratio measures
    # llama.cpp's kernels (its 8-bit activations), not a quantization of float weights.
    return summary | {"measured_by": f"{summary['measured_by']} (the reference runs this GGUF's own weights)"}


def scored_sequences(reference) -> list[list[int]]:
    """The token sequences validate scores, in the order it scores them: per text, its inputs
    split every sequence_tokens tokens, each from an empty cache (as metrics.windows splits)."""
    sequence, found = reference.sequence_tokens, []
    for text in reference.texts.values():
        inputs = [int(t) for t in text.ids[:-1]]
        found += [inputs[first : first + sequence] for first in range(0, len(inputs), sequence)]
    return found


class ScoredLogits:
    """A decoder that replays logits another process computed for scored_sequences(), in order.
    Any token that is not the one scored there fails loudly, so a misalignment cannot pass as a
    quality figure."""

    def __init__(self, sequences: list[list[int]], logits: list[np.ndarray]):
        self.sequences, self.logits, self.current = sequences, logits, -1

    def empty_cache(self) -> int:
        self.current += 1
        return 0

    def forward(self, token_ids, cache: int, last_only: bool = False):
        ids = [int(t) for t in np.asarray(token_ids).reshape(-1)]
        end = cache + len(ids)
        if self.sequences[self.current][cache:end] != ids:
            raise ValueError(f"sequence {self.current}: tokens {cache}..{end} are not the ones scored")
        return np.asarray(self.logits[self.current][cache:end], dtype=np.float32), end


def openvino_quality(python: str, model: str, reference_dir: str, params_file: str) -> dict:
    """OpenVINO GenAI's model scored with its CPU defaults (the settings its speed row ran with):
    its runner writes the logits of validate's sequences, fed in validate's windows through its
    own KV cache; ortforge's metrics score them here."""
    import tempfile

    from benchmarks.peers import openvino_peer

    reference, cfg = _reference(reference_dir, params_file)
    sequences = scored_sequences(reference)
    with tempfile.TemporaryDirectory(prefix="ortforge-openvino-") as scratch:
        options = ["--window", str(cfg.window), "--out", scratch]
        found = openvino_peer.run(Path(python), Path(model), "score", sequences, Path(scratch), options)
        logits = [np.load(path, mmap_mode="r") for path in found["logits"]]
        summary = _scored(ScoredLogits(sequences, logits), reference, cfg)
    chosen = found["properties"]
    precision = f"{chosen['INFERENCE_PRECISION_HINT']} activations, {chosen['KV_CACHE_PRECISION']} KV cache"
    return summary | {"measured_by": f"{summary['measured_by']} ({precision}, its CPU defaults)"}


def quality_summary(per_text: dict) -> dict:
    """The worst over the evaluation texts, as validate reports a variant's."""
    ratios = [t["perplexity"] / t["reference_perplexity"] for t in per_text.values()]
    return {
        "ppl_ratio": max(ratios),
        "kl_divergence": max(t["kl_divergence"] for t in per_text.values()),
        "top1_agreement": min(t["top1_agreement"] for t in per_text.values()),
        "measured_by": "validate's texts and PyTorch reference",
    }

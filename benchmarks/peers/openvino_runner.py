"""Time OpenVINO GenAI on an exported model, as a benchmark peer of ortforge.

Run it with the peer venv's own python (benchmarks/peers/setup_openvino.sh makes it): OpenVINO's
transformers/optimum pins clash with ortforge's, so this script imports nothing from the repo,
only the standard library, numpy, openvino and openvino_genai. Prompts go in as token ids, so
both engines see exactly the same input and no tokenizer takes part in the timing.

Each subcommand prints exactly one JSON object on stdout; everything else goes to stderr.

  generate  batch-1 greedy generation through LLMPipeline: seconds to the first token (prefill)
            of each timed repeat and the milliseconds of every later token.
  load      streams of requests through ContinuousBatchingPipeline: aggregate tokens/s,
            first-token latency and inter-token p50/p95 of each request.
  score     the logits of every position of each token sequence, fed in windows through the
            model's own KV cache (its state) as ortforge's validate feeds a variant, one .npy per
            sequence: its quality is then computed by ortforge's own metrics, not here.

Example:
  /work/peers/openvino/bin/python benchmarks/peers/openvino_runner.py generate \\
      --model OV_DIR --prompt-ids prompt.json --new-tokens 64 --warmup 1 --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import resource
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

log = logging.getLogger("openvino_runner")
request_ids = itertools.count()  # unique over warm-up and timed runs: the pipeline keys requests by id

# CPU defaults on a bf16-capable CPU: bf16 activations, u8 KV cache, activations quantized to int8
# in groups of 32. f32 turns all three off; the two precisions must be set together or the
# plugin refuses the pair.
PRECISIONS = {
    "default": {},
    "f32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
}


def device_properties(threads: int, precision: str) -> dict:
    return {"INFERENCE_NUM_THREADS": threads, **PRECISIONS[precision]}


def scheduler_config(prefix_caching: bool) -> ov_genai.SchedulerConfig:
    # LLMPipeline on CPU runs paged attention with prefix caching ON by default: a repeated timed
    # prompt would then be a cache hit and its prefill would measure nothing.
    config = ov_genai.SchedulerConfig()
    config.enable_prefix_caching = prefix_caching
    return config


def greedy_config(new_tokens: int) -> ov_genai.GenerationConfig:
    # ignore_eos: every run yields exactly new_tokens tokens, as ortforge's own engines do.
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = new_tokens
    config.do_sample = False
    config.ignore_eos = True
    return config


def ids_tensor(ids: list[int]) -> ov.Tensor:
    return ov.Tensor(np.asarray(ids, dtype=np.int64).reshape(1, -1))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def read_ids(path: str) -> list:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def header(args) -> dict:
    return {
        "engine": "openvino-genai",
        "version": ov_genai.__version__,
        "openvino_version": ov.get_version(),
        "threads": args.threads,
        "precision": args.precision,
        "new_tokens": getattr(args, "new_tokens", None),
    }


class TokenClock(ov_genai.StreamerBase):
    """Notes when each token reaches the caller. The pipeline calls write() synchronously from
    generate(), once per token for greedy batch-1 generation."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []
        self.tokens: list[int] = []

    def write(self, token):
        now = time.perf_counter()
        new = [token] if isinstance(token, int) else list(token)
        self.times.extend([now] * len(new))  # a chunk of k tokens arrives at one instant
        self.tokens.extend(int(t) for t in new)
        return ov_genai.StreamingStatus.RUNNING

    def end(self):
        pass


def generate_once(pipe, prompt: ov.Tensor, config) -> tuple[float, list[float], list[int]]:
    clock = TokenClock()
    start = time.perf_counter()
    pipe.generate(prompt, config, clock)
    if not clock.times:
        raise RuntimeError("the pipeline produced no token")
    first = clock.times[0] - start
    steps = (np.diff(clock.times) * 1e3).tolist()
    return first, steps, clock.tokens


def cmd_generate(args) -> dict:
    prompt_ids = read_ids(args.prompt_ids)
    if not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
        raise SystemExit("--prompt-ids must hold a flat JSON list of token ids")
    started = time.perf_counter()
    pipe = ov_genai.LLMPipeline(
        args.model,
        "CPU",
        scheduler_config=scheduler_config(prefix_caching=False),
        **device_properties(args.threads, args.precision),
    )
    load_s = time.perf_counter() - started
    prompt, config = ids_tensor(prompt_ids), greedy_config(args.new_tokens)
    for _ in range(args.warmup):
        generate_once(pipe, prompt, config)
    first_token_s, step_s, tokens = [], [], []
    for repeat in range(args.repeats):
        first, steps, tokens = generate_once(pipe, prompt, config)
        log.info("repeat %d: first token %.4f s, %d decode steps", repeat, first, len(steps))
        first_token_s.append(first)
        step_s.append([ms / 1e3 for ms in steps])
    # The fields of ortforge's own timed runs (tasks.measurement.timing.timed_runs), so both are
    # summarized by the same code.
    return header(args) | {
        "prompt_tokens": len(prompt_ids),
        "load_seconds": load_s,
        "first_token_s": first_token_s,
        "step_s": step_s,
        "tokens": tokens,
        "peak_rss_mb": peak_rss_mb(),
    }


def cmd_score(args) -> dict:
    sequences = read_ids(args.sequences)
    core = ov.Core()
    model = core.compile_model(
        os.path.join(args.model, "openvino_model.xml"), "CPU", device_properties(args.threads, args.precision)
    )
    request = model.create_infer_request()
    inputs = {name for port in model.inputs for name in port.get_names()}
    written = []
    for index, ids in enumerate(sequences):
        request.reset_state()  # a new sequence starts from an empty cache
        parts = []
        for start in range(0, len(ids), args.window):
            window = np.asarray(ids[start : start + args.window], dtype=np.int64).reshape(1, -1)
            end = start + window.shape[1]
            feed = {"input_ids": window, "attention_mask": np.ones((1, end), dtype=np.int64)}
            if "position_ids" in inputs:
                feed["position_ids"] = np.arange(start, end, dtype=np.int64).reshape(1, -1)
            if "beam_idx" in inputs:
                feed["beam_idx"] = np.zeros(1, dtype=np.int32)
            request.infer(feed)
            logits = request.get_tensor("logits").data
            if logits.shape[1] != window.shape[1]:
                raise SystemExit(f"the model returned logits for {logits.shape[1]} of {window.shape[1]} positions")
            parts.append(np.array(logits[0], dtype=np.float32))
        path = os.path.join(args.out, f"logits-{index}.npy")
        np.save(path, np.concatenate(parts))
        written.append(path)
        log.info("sequence %d: %d tokens scored", index, len(ids))
    # The CPU plugin picks these per CPU (bf16 and u8 where the CPU has them): the figures say which.
    chosen = {}
    for name in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION"):
        value = model.get_property(name)
        chosen[name] = value.get_type_name() if isinstance(value, ov.Type) else str(value)
    return header(args) | {"window": args.window, "logits": written, "properties": chosen}


class Stream:
    """One client: sends its requests one after another, each when the previous one is done."""

    def __init__(self, index: int, requests: list[list[int]]):
        self.index, self.pending, self.done = index, list(requests), []
        self.handle = self.current = None

    def send(self, pipe, config) -> None:
        ids = self.pending.pop(0)
        self.handle = pipe.add_request(next(request_ids), ids_tensor(ids), config)
        self.current = {"stream": self.index, "prompt_tokens": len(ids), "sent": time.perf_counter()}
        self.current |= {"arrivals": [], "tokens": []}

    def collect(self, now: float) -> bool:
        """Take the tokens the last step produced; True when the current request has finished."""
        while self.handle.can_read():
            for output in self.handle.read().values():  # one sequence per greedy request
                self.current["arrivals"].extend([now] * len(output.generated_ids))
                self.current["tokens"].extend(int(t) for t in output.generated_ids)
        return self.handle.get_status() != ov_genai.GenerationStatus.RUNNING


def summarize_request(request: dict) -> dict:
    arrivals = request["arrivals"]
    gaps = np.diff(arrivals) * 1e3
    percentile = (lambda q: float(np.percentile(gaps, q))) if len(gaps) else (lambda q: None)
    return {
        "stream": request["stream"],
        "prompt_tokens": request["prompt_tokens"],
        "generated_tokens": len(arrivals),
        "first_token_s": arrivals[0] - request["sent"] if arrivals else None,
        "inter_token_ms_p50": percentile(50),
        "inter_token_ms_p95": percentile(95),
        "tokens": request["tokens"],  # to check batched output against batch-1 output
    }


def run_streams(pipe, streams: list[Stream], config) -> tuple[float, list[dict]]:
    """Drive the pipeline step by step; timestamps have the resolution of one step."""
    start = time.perf_counter()
    for stream in streams:
        stream.send(pipe, config)
    active = list(streams)
    while active:
        pipe.step()
        now = time.perf_counter()
        for stream in list(active):
            if not stream.collect(now):
                continue
            stream.done.append(stream.current)
            if stream.pending:
                stream.send(pipe, config)
            else:
                active.remove(stream)
    wall = time.perf_counter() - start
    return wall, [request for stream in streams for request in stream.done]


def cmd_load(args) -> dict:
    prompts = read_ids(args.prompts)
    if not prompts or not all(isinstance(stream, list) and stream for stream in prompts):
        raise SystemExit("--prompts must hold a JSON list of streams, each a non-empty list of token-id lists")
    started = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(
        args.model,
        scheduler_config(args.prefix_caching),
        "CPU",
        device_properties(args.threads, args.precision),
    )
    load_s = time.perf_counter() - started
    config = greedy_config(args.new_tokens)
    # The first inferences pay one-off kernel set-up. Reversed, the warm-up prompt shares no prefix
    # with the timed ones, so --prefix-caching cannot turn the first timed request into a cache hit.
    for _ in range(args.warmup):
        run_streams(pipe, [Stream(0, [prompts[0][0][::-1]])], config)
    wall, requests = run_streams(pipe, [Stream(i, s) for i, s in enumerate(prompts)], config)
    generated = sum(len(r["arrivals"]) for r in requests)
    all_gaps = np.concatenate([np.diff(r["arrivals"]) * 1e3 for r in requests])
    summaries = [summarize_request(r) for r in requests]
    log.info("%d requests, %d tokens in %.3f s", len(requests), generated, wall)
    return header(args) | {
        "streams": len(prompts),
        "requests": len(requests),
        "prefix_caching": args.prefix_caching,
        "load_s": load_s,
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "first_token_s": [s["first_token_s"] for s in summaries],
        "inter_token_ms_p50": float(np.percentile(all_gaps, 50)) if all_gaps.size else None,
        "inter_token_ms_p95": float(np.percentile(all_gaps, 95)) if all_gaps.size else None,
        "per_request": summaries,
        "peak_rss_mb": peak_rss_mb(),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub, generates: bool = True):
        sub.add_argument("--model", required=True, help="folder of an optimum-cli OpenVINO export")
        if generates:
            sub.add_argument("--new-tokens", type=int, required=True, help="tokens per request (EOS ignored)")
        sub.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="INFERENCE_NUM_THREADS")
        sub.add_argument(
            "--precision",
            choices=sorted(PRECISIONS),
            default="default",
            help="default: the CPU plugin's choices (bf16, u8 KV, dynamic int8 quantization where the CPU has "
            "them); f32: f32 activations and KV cache, no dynamic quantization",
        )

    gen = commands.add_parser("generate", help="batch-1 greedy latency through LLMPipeline")
    common(gen)
    gen.add_argument("--prompt-ids", required=True, help="JSON file: a flat list of token ids")
    gen.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    gen.add_argument("--repeats", type=int, default=3, help="timed runs")

    load = commands.add_parser("load", help="throughput and latency of request streams (ContinuousBatchingPipeline)")
    common(load)
    load.add_argument("--prompts", required=True, help="JSON file: a list of streams, each a list of token-id lists")
    load.add_argument("--warmup", type=int, default=1, help="untimed single requests first (default 1)")
    load.add_argument("--prefix-caching", action="store_true", help="let requests reuse cached prefixes (default off)")

    score = commands.add_parser("score", help="logits of every position of token sequences, as .npy files")
    common(score, generates=False)
    score.add_argument("--sequences", required=True, help="JSON file: token-id lists, each from an empty cache")
    score.add_argument("--window", type=int, required=True, help="tokens per model run (the cache carries between)")
    score.add_argument("--out", required=True, help="folder for logits-<i>.npy")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    # Native code may print to fd 1; keep the real stdout for our JSON and send the rest to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    result = {"generate": cmd_generate, "load": cmd_load, "score": cmd_score}[args.command](args)
    out.write(json.dumps(result) + "\n")
    out.flush()


if __name__ == "__main__":
    main()

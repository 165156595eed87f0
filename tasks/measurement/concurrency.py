"""The serving workload: concurrent streams, each sending requests one after another, through the
continuous-batching scheduler that `ortforge serve` runs (ortforge.scheduler), without HTTP in
between (benchmarks/serving.py measures the server itself, beside llama-server).

Every request's prompt is prompt_tokens long; its first shared_prefix share is the same for all
requests (a system prompt), the rest its own slice of the text, so a prefix cache has something to
reuse and the streams still decode different sequences. Figures: aggregate generated tokens/s over
the wall time, time to first token and inter-token latency p50/p95 over every request, and the
process's peak RSS. One fresh process per concurrency level (tasks.measurement.timing).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from tasks.measurement.timing import peak_rss_mb

REQUEST_TIMEOUT_S = 600


def request_prompts(ids: list[int], streams: int, requests: int, tokens: int, shared_prefix: float) -> list[list]:
    """Per stream, its requests' prompt ids: a common start, then each request's own slice."""
    shared = int(round(tokens * shared_prefix))
    own, count = tokens - shared, streams * requests
    rest = ids[shared:]
    if own and len(rest) < own * count:
        raise ValueError(f"the text has {len(ids)} tokens; {count} requests of {tokens} tokens need more")
    prompts = [list(ids[:shared]) + list(rest[i * own : (i + 1) * own]) for i in range(count)]
    return [prompts[s * requests : (s + 1) * requests] for s in range(streams)]


def request(scheduler, prompt: list[int], new_tokens: int) -> dict:
    """One request through the scheduler, waited for: its first-token time, its inter-token gaps and
    how many tokens it got. A request that errs or gets no end fails the run."""
    from ortforge.scheduler import Job

    arrivals, done, ends = [], threading.Event(), []
    start = time.perf_counter()

    def on_end(end: str) -> None:
        ends.append(end)
        done.set()

    scheduler.submit(Job(prompt, new_tokens, lambda _token: arrivals.append(time.perf_counter()), on_end))
    if not done.wait(REQUEST_TIMEOUT_S):
        raise RuntimeError(f"a request got no end within {REQUEST_TIMEOUT_S} s")
    if ends[0].startswith("error"):
        raise RuntimeError(f"a request failed: {ends[0]}")
    return {"first": arrivals[0] - start, "gaps": np.diff(arrivals).tolist(), "tokens": len(arrivals)}


def measure_load(
    model_dir: str, prompts: list[list[list[int]]], new_tokens: int, session: dict | None, cache_mb: float
):
    """Run in a fresh process: a scheduler with one slot per stream, a warm-up request, then all
    streams at once; JSON-ready figures."""
    from ortforge.generate import TextGenerator
    from ortforge.scheduler import Scheduler
    from ortforge.session import SessionSettings

    settings = SessionSettings.from_dict(session) if session else None
    generator = TextGenerator(model_dir, settings)
    streams = len(prompts)
    scheduler = Scheduler(generator, slots=streams, queue_size=streams, prefix_cache_mb=cache_mb).start()
    try:
        request(scheduler, prompts[0][0][: max(1, len(prompts[0][0]) // 2)], 4)  # warm-up, untimed
        done, wall = run_streams(prompts, lambda prompt: request(scheduler, prompt, new_tokens))
    finally:
        scheduler.stop()
    return {
        "streams": streams,
        **request_figures(done, wall),
        "peak_rss_mb": peak_rss_mb(),
        "scheduler": scheduler.note,
        "widest_step": scheduler.widest_step,
    }


def run_streams(prompts: list[list], one_request) -> tuple[list[dict], float]:
    """Every stream at once, each sending its prompts in turn through one_request(prompt) -> {first,
    gaps, tokens}; every request's figures and the wall time. A failed request fails the run."""
    results: list[list[dict]] = [[] for _ in prompts]
    failures: list[BaseException] = []

    def stream(index: int) -> None:
        try:
            results[index] = [one_request(prompt) for prompt in prompts[index]]
        except Exception as error:  # noqa: BLE001 - raised below, on the measuring thread
            failures.append(error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if failures:
        raise failures[0]
    return [r for per_stream in results for r in per_stream], wall


def request_figures(done: list[dict], wall: float) -> dict:
    """Aggregate tokens/s over the wall time; first token and inter-token latency p50/p95."""
    first, gaps = [r["first"] for r in done], [g for r in done for g in r["gaps"]]
    return {
        "requests": len(done),
        "aggregate_tokens_per_second": sum(r["tokens"] for r in done) / wall,
        "seconds_to_first_token_p50": float(np.percentile(first, 50)),
        "seconds_to_first_token_p95": float(np.percentile(first, 95)),
        "inter_token_ms_p50": float(np.percentile(gaps, 50) * 1e3),
        "inter_token_ms_p95": float(np.percentile(gaps, 95) * 1e3),
        "wall_seconds": wall,
    }

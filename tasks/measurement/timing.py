"""What runs inside a measured process: load one engine, warm it up, time the generation workload,
and read the process's peak memory.

Kept apart from the bench stage so that the measured process imports only numpy, onnxruntime (or
torch for the baseline) and ortforge: the stage's own imports (pydantic, yaml) would otherwise add
about 20 MB to every engine's peak RSS.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tasks.core.files import megabytes

ORT, TORCH = "onnxruntime", "pytorch"
REPO = Path(__file__).resolve().parents[2]  # children import tasks, ortforge and benchmarks from here


def timed_generation(decoder, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """Seconds to the first token (prefill + argmax), and seconds of each later decode step."""
    start = time.perf_counter()
    logits, cache = decoder.forward(prompt, decoder.empty_cache(), last_only=True)
    token = int(np.argmax(logits[-1]))
    first = time.perf_counter() - start
    steps = []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        logits, cache = decoder.forward([token], cache, last_only=True)
        token = int(np.argmax(logits[-1]))
        steps.append(time.perf_counter() - start)
    return first, steps


def _load_decoder(engine: str, model_dir: Path, threads: int, session: dict | None):
    if engine == TORCH:
        from tasks.evaluation.torch_decoder import TorchDecoder

        # The baseline is PyTorch as its users run it: the whole model loaded, however large.
        decoder = TorchDecoder(model_dir, threads, resident_bytes=sys.maxsize)
        return decoder, decoder.torch.get_num_threads()
    from ortforge.decoder import Decoder
    from ortforge.session import SessionSettings

    settings = SessionSettings.from_dict(session) if session else SessionSettings(intra_op_threads=threads)
    return Decoder.for_artifact(model_dir, settings), settings.intra_op_threads


def timed_runs(once, warmup: int, repeats: int) -> dict:
    """warmup untimed then `repeats` timed runs of once() -> (first-token seconds, step seconds),
    and this process's peak memory: what every engine, ortforge's or a peer's, reports."""
    for _ in range(warmup):
        once()
    runs = [once() for _ in range(repeats)]
    return {
        "first_token_s": [first for first, _ in runs],
        "step_s": [list(steps) for _, steps in runs],
        "peak_rss_mb": peak_rss_mb(),
    }


def measure_engine(engine: str, model_dir: str, prompt: list[int], cfg: dict, session: dict | None = None) -> dict:
    """Run in a fresh process: load, warm up, then time cfg['repeats'] generations."""
    started = time.perf_counter()
    decoder, threads = _load_decoder(engine, Path(model_dir), cfg["threads"], session)
    load_seconds = time.perf_counter() - started
    result = timed_runs(lambda: timed_generation(decoder, prompt, cfg["new_tokens"]), cfg["warmup"], cfg["repeats"])
    return result | {"load_seconds": load_seconds, "threads": threads}


def summarize(runs: list[dict], prompt_tokens: int, size_bytes: int) -> dict:
    """The metrics of every measurement, one vocabulary (seconds_to_first_token, decode ms per
    token p50/p95, tokens/s, peak RSS, size), over the runs of one engine's fresh processes."""
    first = np.array([s for run in runs for s in run["first_token_s"]])
    steps = np.array([s for run in runs for repeat in run["step_s"] for s in repeat])
    per_repeat_rate = [len(r) / sum(r) for run in runs for r in run["step_s"]]
    end_to_end = [f + sum(r) for run in runs for f, r in zip(run["first_token_s"], run["step_s"], strict=True)]
    return {
        "seconds_to_first_token_p50": float(np.percentile(first, 50)),
        "seconds_to_first_token_p95": float(np.percentile(first, 95)),
        "prefill_tokens_per_second": float(prompt_tokens / np.percentile(first, 50)),
        "decode_ms_per_token_p50": float(np.percentile(steps, 50) * 1e3),
        "decode_ms_per_token_p95": float(np.percentile(steps, 95) * 1e3),
        "decode_tokens_per_second": float(np.median(per_repeat_rate)),
        "end_to_end_seconds": float(np.median(end_to_end)),
        "peak_rss_mb": float(max(run["peak_rss_mb"] for run in runs)),
        "size_mb": megabytes(size_bytes),
        "load_seconds": float(np.median([run["load_seconds"] for run in runs])),
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM belongs to the process image (reset by exec);
    getrusage's ru_maxrss survives exec on Linux and would report the parent's peak after spawn."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_fresh_process(function, *args):
    """function(*args) (JSON in, JSON out) in a new interpreter that imports only its module.

    fork would share the parent's pages and its RSS; multiprocessing's spawn re-imports the
    parent's main module (the bench stage, with pydantic and yaml) into the child."""
    with tempfile.TemporaryDirectory(prefix="ortforge-measure-") as scratch:
        result = Path(scratch) / "result.json"
        call = {"module": function.__module__, "function": function.__qualname__, "args": args, "result": str(result)}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        child = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(call), text=True, env=env)
        if child.returncode != 0:
            raise RuntimeError(
                f"{function.__qualname__} failed in its own process (exit {child.returncode}); see above"
            )
        return json.loads(result.read_text(encoding="utf-8"))


def _call_from_parent() -> None:
    call = json.loads(sys.stdin.read())
    function = getattr(importlib.import_module(call["module"]), call["function"])
    Path(call["result"]).write_text(json.dumps(function(*call["args"])), encoding="utf-8")


if __name__ == "__main__":
    _call_from_parent()

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

ORT, TORCH = "onnxruntime", "pytorch"
REPO = Path(__file__).resolve().parents[1]  # children import tasks, ortforge and benchmarks from here


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
        from tasks.torch_decoder import TorchDecoder

        decoder = TorchDecoder(model_dir, threads)
        return decoder, decoder.torch.get_num_threads()
    from ortforge.decoder import Decoder
    from ortforge.session import SessionSettings

    settings = SessionSettings.from_dict(session) if session else SessionSettings(intra_op_threads=threads)
    return Decoder.for_artifact(model_dir, settings), settings.intra_op_threads


def measure_engine(engine: str, model_dir: str, prompt: list[int], cfg: dict, session: dict | None = None) -> dict:
    """Run in a fresh process: load, warm up, then time cfg['repeats'] generations."""
    started = time.perf_counter()
    decoder, threads = _load_decoder(engine, Path(model_dir), cfg["threads"], session)
    load_seconds = time.perf_counter() - started
    for _ in range(cfg["warmup"]):
        timed_generation(decoder, prompt, cfg["new_tokens"])
    runs = [timed_generation(decoder, prompt, cfg["new_tokens"]) for _ in range(cfg["repeats"])]
    return {
        "first_token_s": [first for first, _ in runs],
        "step_s": [steps for _, steps in runs],
        "load_seconds": load_seconds,
        "threads": threads,
        "peak_rss_mb": peak_rss_mb(),
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

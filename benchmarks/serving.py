"""Serving under load: aggregate decode throughput, time to first token and inter-token latency
(p50/p95) and the server's peak RSS, against the number of concurrent streams, for `ortforge
serve` and, when installed, llama.cpp's `llama-server` (`--parallel N`, continuous batching) on the
same model's GGUF, driven by the same load generator over HTTP and interleaved per concurrency.

    python benchmarks/serving.py [--model smollm2-135m] [--variant int4,int8,w8a8,fp32] [--streams 1,4,8]
                                 [--prompt-tokens 128] [--new-tokens 64] [--requests 2] [--rounds 3]

Each stream sends --requests streamed completions one after another (greedy); a request's prompt is
--prompt-tokens of the GPL-3 text from its own offset, so streams share no prefix. Then prefix
reuse: the time to first token of a request whose --prefix-tokens start another request sent just
before, against that first (cold) one. Each server runs in its own process (its RSS is its own),
one at a time, with as many slots as the concurrency; the whole sweep runs --rounds times, and
each figure is the median over rounds.
llama-server is found on PATH or in LLAMA_SERVER. Writes benchmarks/results/serving.json and
serving.png and prints the table. Needs `dvc repro` first (it serves artifacts/).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from benchmarks.load_peers import medians  # noqa: E402
from benchmarks.side_by_side import gguf_file  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.measurement.concurrency import request_figures, run_streams  # noqa: E402
from tasks.reporting.load import figure_cells, levels  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TEXT = REPO / "data" / "eval" / "GPL-3.txt"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ortforge_command(folder: Path, port: int, slots: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ortforge.cli",
        "serve",
        str(folder),
        "--port",
        str(port),
        "--slots",
        str(slots),
        "--queue",
        "64",
    ]


def llama_command(binary: str, gguf: Path, port: int, slots: int, context: int) -> list[str]:
    return [
        binary,
        "-m",
        str(gguf),
        "--port",
        str(port),
        "--parallel",
        str(slots),
        "-c",
        str(context * slots),
        "-t",
        str(os.cpu_count() or 1),
        "--cont-batching",
        "--log-disable",
    ]


def started(command: list[str], port: int) -> subprocess.Popen:
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"error: {command[0]} exited with {server.returncode} before serving")
        time.sleep(0.2)
    server.kill()
    raise SystemExit(f"error: {command[0]} did not answer /health within 300 s")


def status_mb(pid: int, field: str) -> float:
    """A memory figure of /proc/PID/status in MB (VmHWM: peak RSS, VmRSS: RSS now); NaN if absent."""
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb(pid: int) -> float:
    return status_mb(pid, "VmHWM")


def one_request(url: str, model: str, prompt: str, new_tokens: int) -> dict:
    """A streamed completion: seconds to the first text, the gaps between later pieces, tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, arrivals, tokens = time.perf_counter(), [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in event.get("choices", [])):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"{url} streamed no text")
    return {"first": arrivals[0] - start, "gaps": list(np.diff(arrivals)), "tokens": tokens or len(arrivals)}


def load(url: str, model: str, prompts: list[list[str]], new_tokens: int) -> dict:
    """Each stream's prompts in turn, all streams at once; aggregate and per-token figures."""
    done, wall = run_streams(prompts, lambda prompt: one_request(url, model, prompt, new_tokens))
    return request_figures(done, wall)


def stream_prompts(streams: int, requests: int, prompt_tokens: int, folder: Path) -> list[list[str]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8")).ids
    step = max(1, (len(ids) - prompt_tokens) // max(1, streams * requests))
    chunks = [tokenizer.decode(ids[i * step : i * step + prompt_tokens]) for i in range(streams * requests)]
    return [chunks[s * requests : (s + 1) * requests] for s in range(streams)]


def measure(name: str, command: list[str], port: int, model: str, prompts: list[list[str]], new_tokens: int) -> dict:
    server = started(command, port)
    try:
        load(f"http://127.0.0.1:{port}", model, [p[:1] for p in prompts[:1]], new_tokens)  # warm-up
        result = load(f"http://127.0.0.1:{port}", model, prompts, new_tokens)
        result["peak_rss_mb"] = peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(
        f"  {name}: {result['aggregate_tokens_per_second']:.1f} tok/s aggregate, first token p50 "
        f"{result['seconds_to_first_token_p50'] * 1e3:.0f} ms, inter-token p95 {result['inter_token_ms_p95']:.1f} ms, "
        f"peak RSS {result['peak_rss_mb']:.0f} MB",
        flush=True,
    )
    return result


def prefix_reuse(folder: Path, model: str, prefix_tokens: int, new_tokens: int) -> dict:
    """Time to first token of a request whose prompt starts with prefix_tokens another request
    sent just before (cached), against the first one (cold); ortforge's server, one slot."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8")).ids
    prefix = tokenizer.decode(ids[:prefix_tokens])
    port = free_port()
    server = started(ortforge_command(folder, port, 1), port)
    try:
        url = f"http://127.0.0.1:{port}"
        one_request(url, model, "warm-up", 2)
        cold = one_request(url, model, prefix + " Summarize this in one line:", new_tokens)["first"]
        cached = one_request(url, model, prefix + " Which license is it?", new_tokens)["first"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"  {prefix_tokens}-token shared prefix: first token {cold * 1e3:.0f} ms cold, {cached * 1e3:.0f} ms cached")
    return {
        "prefix_tokens": prefix_tokens,
        "cold_seconds_to_first_token": cold,
        "cached_seconds_to_first_token": cached,
        "cached_share_of_cold": cached / cold,
    }


def table(report: dict) -> str:
    lines = [
        "| server | streams | aggregate tok/s | x its 1 stream | first token ms p50 / p95 | inter-token ms p50 / p95 "
        "| peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, by_streams in report["servers"].items():
        one = by_streams.get("1", {}).get("aggregate_tokens_per_second")
        lines += [f"| {name} | {s} | {figure_cells(by_streams[s], one)} |" for s in levels(by_streams)]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_streams in report["servers"].items():
        streams = levels(by_streams)
        x = [int(s) for s in streams]
        throughput.plot(x, [by_streams[s]["aggregate_tokens_per_second"] for s in streams], "o-", label=name)
        latency.plot(x, [by_streams[s]["inter_token_ms_p95"] for s in streams], "o-", label=name)
    throughput.set(xlabel="concurrent streams", ylabel="aggregate decode tokens/s", title="throughput")
    latency.set(xlabel="concurrent streams", ylabel="inter-token latency p95, ms", title="latency")
    throughput.legend()
    figure.suptitle(f"{report['model']}: serving under load ({report['cpus']} cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def llama_version(llama: str) -> str:
    """What `llama-server --version` says of itself (its build number and commit)."""
    said = subprocess.run([llama, "--version"], capture_output=True, text=True, timeout=30)
    return next((line.strip() for line in (said.stdout + said.stderr).splitlines() if "version" in line), "unknown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variant", default="int4,int8,w8a8,fp32", help="variants to serve, comma-separated")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests each stream sends in turn")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="the shared prefix of the reuse test")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each figure is their median")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds {args.rounds}: at least 1")
    variants = args.variant.split(",")
    folders = {v: paths.variant_dir(args.model, v) for v in variants}
    for folder in folders.values():
        if not (folder / "model.onnx").is_file():
            raise SystemExit(f"error: {folder} is missing; run `dvc repro` first")
    measured = provenance.model_outputs(args.model, variants)
    provenance.require_current(measured)
    folder = folders[variants[0]]
    llama = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    gguf = gguf_file(args.model)
    peers = {"llama-server": llama_version(llama)} if llama and gguf else {}
    report = {
        "provenance": provenance.record(provenance.command("serving.py", argv), measured, peers),
        "model": args.model,
        "variant": args.variant,
        "cpus": os.cpu_count(),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "requests_per_stream": args.requests,
        "servers": {},
    }
    context = args.prompt_tokens + args.new_tokens + 64
    # name, the model name requests carry, and the server's command for (port, slots)
    engines = [
        (f"ortforge serve ({v})", f"{args.model}/{v}", functools.partial(ortforge_command, served))
        for v, served in folders.items()
    ]
    if llama and gguf:

        def llama_server(port: int, slots: int) -> list[str]:
            return llama_command(llama, gguf, port, slots, context)

        engines.append((f"llama-server ({gguf.name})", "gguf", llama_server))
    runs: dict[str, dict[str, list[dict]]] = {}
    for round_index in range(args.rounds):
        for streams in [int(s) for s in args.streams.split(",")]:
            print(f"round {round_index + 1}/{args.rounds}: {streams} concurrent stream(s)", flush=True)
            prompts = stream_prompts(streams, args.requests, args.prompt_tokens, folder)
            for name, model, command_of in engines:
                port = free_port()
                result = measure(name, command_of(port, streams), port, model, prompts, args.new_tokens)
                runs.setdefault(name, {}).setdefault(str(streams), []).append(result)
    report["servers"] = {name: {s: medians(found) for s, found in by.items()} for name, by in runs.items()}
    report["rounds"] = args.rounds
    print("prefix reuse", flush=True)
    report["prefix_reuse"] = prefix_reuse(folder, f"{args.model}/{variants[0]}", args.prefix_tokens, 8)
    if not (llama and gguf):
        report["llama_server"] = "not installed here (no llama-server on PATH or LLAMA_SERVER)"
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "serving.json", report)
    plot(report, RESULTS / "serving.png")
    print(table(report))
    print(f"wrote {RESULTS / 'serving.json'} and serving.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

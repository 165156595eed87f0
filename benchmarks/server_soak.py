"""`ortforge serve` under long prompts and a long mixed load, through its HTTP API, one variant:

1. interleaving: a stream decodes alone (its inter-token p50/p95 unloaded), then again while a
   long prompt is sent (prefilled in pieces between the stream's steps) and, half a second later, a
   short request: the stream's inter-token p95 while the long prompt is prefilled, against its
   unloaded p95, and the short request's first-token time against a piece's time;
2. memory: the server's RSS when idle, after one request with a very long prompt;
3. soak: thousands of mixed requests from several clients (short and long prompts, streamed and
   not, streams the client abandons after a few tokens), the server's RSS sampled throughout.

Writes benchmarks/results/server_soak.json (with the RSS series) and server_soak.png. Needs
`dvc repro` first (it serves artifacts/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from benchmarks.serving import TEXT, free_port, ortforge_command, started, status_mb  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
# The soak's mix: (share, kind); a kind's prompt length and reply are in soak_request.
MIX = ((0.40, "short stream"), (0.30, "short"), (0.20, "abandoned stream"), (0.10, "long"))


def rss_mb(pid: int) -> float:
    return status_mb(pid, "VmRSS")


def texts(folder: Path, lengths: dict[str, int]) -> dict[str, str]:
    """Prompts of about the given token counts, cut from the evaluation text (repeated as needed),
    and "long_alone": as long as "long" but starting where it ends, so the server's prefix cache
    cannot answer it from the long prompt sent before it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8")).ids
    long = lengths["long"]
    ids = ids * (1 + max(2 * long, *lengths.values()) // len(ids))
    prompts = {name: tokenizer.decode(ids[:count]) for name, count in lengths.items()}
    return prompts | {"long_alone": tokenizer.decode(ids[long : 2 * long])}


def streamed(url: str, model: str, prompt: str, max_tokens: int, stop_after: int | None = None) -> dict:
    """A streamed completion: arrival times of its text pieces; stop_after: hang up after that many."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, arrivals = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as answer:
        status = answer.status_code
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            if any(choice.get("text") for choice in json.loads(line[6:]).get("choices", [])):
                arrivals.append(time.perf_counter())
                if stop_after and len(arrivals) >= stop_after:
                    break
    return {"status": status, "start": start, "arrivals": arrivals}


def gaps_ms(arrivals: list[float], after: float = -1.0, before: float = float("inf")) -> list[float]:
    return [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:], strict=False) if after <= a and b <= before]


def interleaving(url: str, model: str, prompts: dict[str, str], stream_tokens: int) -> dict:
    alone = streamed(url, model, prompts["short"], stream_tokens)
    unloaded = gaps_ms(alone["arrivals"])
    results: dict[str, dict] = {}

    def run(name: str, prompt: str, tokens: int) -> None:
        results[name] = streamed(url, model, prompt, tokens)

    stream = threading.Thread(target=run, args=("stream", prompts["short"], stream_tokens))
    stream.start()
    time.sleep(1.0)
    long_request = threading.Thread(target=run, args=("long", prompts["long"], 8))
    long_request.start()
    time.sleep(0.5)
    run("short_behind", prompts["short"], 8)
    for thread in (stream, long_request):
        thread.join()
    long, short = results["long"], results["short_behind"]
    during = gaps_ms(results["stream"]["arrivals"], after=long["start"], before=long["arrivals"][0])
    figures = {
        "unloaded_inter_token_ms_p50": float(np.percentile(unloaded, 50)),
        "unloaded_inter_token_ms_p95": float(np.percentile(unloaded, 95)),
        "inter_token_ms_p50_during_long_prefill": float(np.percentile(during, 50)),
        "inter_token_ms_p95_during_long_prefill": float(np.percentile(during, 95)),
        "steps_during_long_prefill": len(during),
        "long_prompt_first_token_s": long["arrivals"][0] - long["start"],
        "short_behind_long_first_token_s": short["arrivals"][0] - short["start"],
    }
    figures["p95_ratio_to_unloaded"] = (
        figures["inter_token_ms_p95_during_long_prefill"] / figures["unloaded_inter_token_ms_p95"]
    )
    alone_long = streamed(url, model, prompts["long_alone"], 8)
    figures["long_prompt_first_token_s_alone"] = alone_long["arrivals"][0] - alone_long["start"]
    return figures


def soak_request(url: str, model: str, kind: str, prompts: dict[str, str]) -> int:
    if kind == "short stream":
        return streamed(url, model, prompts["short"], 32)["status"]
    if kind == "abandoned stream":
        return streamed(url, model, prompts["short"], 200, stop_after=3)["status"]
    prompt, tokens = (prompts["soak_long"], 16) if kind == "long" else (prompts["short"], 24)
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=900).status_code


def soak(url: str, model: str, prompts: dict[str, str], requests: int, clients: int, pid: int, every: float) -> dict:
    """requests mixed requests from `clients` threads; the server's RSS every `every` seconds."""
    rng = random.Random(0)
    kinds = rng.choices([kind for _, kind in MIX], weights=[share for share, _ in MIX], k=requests)
    series, done = [], threading.Event()
    start = time.perf_counter()

    def sample() -> None:
        while not done.is_set():
            series.append((round(time.perf_counter() - start, 2), round(rss_mb(pid), 1)))
            done.wait(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(clients) as pool:
        statuses = list(pool.map(lambda kind: soak_request(url, model, kind, prompts), kinds))
    done.set()
    sampler.join()
    series.append((round(time.perf_counter() - start, 2), round(rss_mb(pid), 1)))
    tail = [mb for _, mb in series[-max(3, len(series) // 4) :]]
    head = [mb for _, mb in series[: max(3, len(series) // 4)]]
    return {
        "requests": requests,
        "clients": clients,
        "mix": {kind: kinds.count(kind) for _, kind in MIX},
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "seconds": round(time.perf_counter() - start, 1),
        "rss_mb_first_quarter_median": float(np.median(head)),
        "rss_mb_last_quarter_median": float(np.median(tail)),
        "rss_mb_max": max(mb for _, mb in series),
        "rss_mb_series": series,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["soak"]["rss_mb_series"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([t for t, _ in series], [mb for _, mb in series], label="server RSS")
    ax.axhline(report["memory"]["idle_rss_mb"], color="gray", linestyle="--", label="idle RSS")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"ortforge serve ({report['variant']}): {report['soak']['requests']} mixed requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variant", default="int4")
    parser.add_argument("--long-tokens", type=int, default=4000, help="the long prompt beside a running stream")
    parser.add_argument("--memory-tokens", type=int, default=6000, help="the prompt of the memory test")
    parser.add_argument("--requests", type=int, default=2000, help="the soak's requests")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    folder, measured = provenance.current_variant(args.model, args.variant)
    lengths = {"short": 48, "long": args.long_tokens, "memory": args.memory_tokens, "soak_long": 1000}
    prompts = texts(folder, lengths)
    model = f"{args.model}/{args.variant}"
    port = free_port()
    server = started(ortforge_command(folder, port, 4), port)
    url = f"http://127.0.0.1:{port}"
    report = {
        "provenance": provenance.record(provenance.command("server_soak.py", argv), measured, {}),
        "model": args.model,
        "variant": args.variant,
        "cpus": os.cpu_count(),
        "slots": 4,
        "prompt_tokens": lengths,
    }
    try:
        streamed(url, model, prompts["short"], 8)  # warm-up
        print("interleaving", flush=True)
        report["interleaving"] = interleaving(url, model, prompts, 800)
        print(json.dumps(report["interleaving"], indent=1), flush=True)
        time.sleep(1)
        idle = rss_mb(server.pid)
        streamed(url, model, prompts["memory"], 16)
        time.sleep(1)
        report["memory"] = {"idle_rss_mb": idle, "rss_mb_after_long_request": rss_mb(server.pid)}
        report["memory"]["growth_mb"] = report["memory"]["rss_mb_after_long_request"] - idle
        print(json.dumps(report["memory"]), flush=True)
        print(f"soak: {args.requests} requests from {args.clients} clients", flush=True)
        report["soak"] = soak(url, model, prompts, args.requests, args.clients, server.pid, 2.0)
        report["soak"]["rss_mb_after_soak_minus_idle"] = report["soak"]["rss_mb_series"][-1][1] - idle
        print({k: v for k, v in report["soak"].items() if k != "rss_mb_series"}, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "server_soak.json", report)
    plot(report, RESULTS / "server_soak.png")
    print(f"wrote {RESULTS / 'server_soak.json'} and server_soak.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

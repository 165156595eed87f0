"""Whether a long prompt prefills faster whole or in pieces: per variant, batch-1 time to the first
token of prompts of 256 to 4,096 tokens, run whole and in pieces of 128, 256 and 512 tokens; and
the peak RSS of the longest prompt, whole and in the runtime's pieces
(ortforge.generate.LONG_PROMPT_PIECE).

Why pieces can be faster although they compute the same thing: onnxruntime's CPU
GroupQueryAttention scores every query of a run against every key the run sees, the masked half
included, so a run of N tokens costs N x N scores where pieces of P cost about N x N / 2 + N x P / 2,
and the scores of one run (heads x N x N floats per layer) grow with the square of the prompt.

Each variant runs in its own process with its tuned session settings (its runtime.json), every
length and piece size once per round, interleaved, after a warm-up round; the timing loop is the
one every engine is timed with (tasks.measurement.timing.timed_generation). Peak RSS comes from a
fresh process per configuration. Only variants validate proved pieces for are measured in pieces.
Beside them, where its venv is installed (benchmarks/peers/setup_openvino.sh), OpenVINO GenAI's
first token for the same token ids, its int4 and int8 exports of the same HF folder at its CPU
defaults, each length in its own process after a warm-up.

    python benchmarks/prefill_pieces.py [--model smollm2-135m] [--variants fp32,int4,int8,w8a8]
        [--lengths 256,1024,2048,4096] [--pieces 128,256,512] [--rounds 2]

Writes benchmarks/results/prefill_pieces.json (prefill_pieces-<model>.json for another model) and
prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from benchmarks.load_peers import PEER_FORMATS  # noqa: E402
from benchmarks.peers import openvino_peer  # noqa: E402
from benchmarks.side_by_side import CACHE  # noqa: E402
from ortforge.generate import LONG_PROMPT_PIECE  # noqa: E402
from tasks.bench import prompt_ids  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TEXT = REPO / "data" / "eval" / "GPL-3.txt"
WHOLE = 0  # a piece size of 0: the prompt in one run


def first_tokens(folder: str, ids: list[int], lengths: list[int], pieces: list[int], rounds: int) -> dict:
    """Seconds to the first token per length and piece size (a list, one per round), in this process."""
    from ortforge.decoder import Decoder
    from tasks.measurement.timing import timed_generation

    decoder = Decoder.for_artifact(folder)
    tuned, proven = decoder.prefill_chunk, decoder.runs_like_any(max(lengths))
    sizes = [WHOLE, *pieces] if proven else [WHOLE]
    found = {str(n): {str(p): [] for p in sizes} for n in lengths}
    for round_ in range(rounds + 1):  # round 0 warms every shape up
        for n in lengths:
            for piece in sizes:
                decoder.prefill_chunk = piece
                first, _ = timed_generation(decoder, ids[:n], 1)
                if round_:
                    found[str(n)][str(piece)].append(first)
    return {"pieces_proven": proven, "tuned_prefill_chunk": tuned, "seconds": found}


def peak_memory(folder: str, ids: list[int], piece: int) -> dict:
    """Resident MB once the session is loaded, and this process's peak after one prefill of ids."""
    from ortforge.decoder import Decoder
    from tasks.measurement.timing import peak_rss_mb

    decoder = Decoder.for_artifact(folder)
    loaded = peak_rss_mb()
    decoder.prefill_chunk = piece
    decoder.forward(ids, decoder.empty_cache(), last_only=True)
    return {"loaded_mb": loaded, "peak_mb": peak_rss_mb()}


def openvino_first_tokens(model: str, ids: list[int], lengths: list[int], rounds: int) -> dict:
    """OpenVINO GenAI's batch-1 first-token ms per length (median of rounds after a warm-up), per
    export of the model's HF folder, at its CPU defaults."""
    found = {}
    options = ["--new-tokens", "2", "--warmup", "1", "--repeats", str(rounds), "--precision", "default"]
    with tempfile.TemporaryDirectory(prefix="ortforge-prefill-") as scratch:
        for weights in PEER_FORMATS:
            built = openvino_peer.build(
                openvino_peer.PYTHON, paths.hf_dir(model), CACHE / model / f"openvino-{weights}", weights
            )
            name = f"OpenVINO GenAI {openvino_peer.recipe(weights)} (CPU defaults)"
            print(f"{name}: first token at {lengths} tokens", flush=True)
            found[name] = {}
            for n in lengths:
                runs = openvino_peer.run(openvino_peer.PYTHON, built, "generate", ids[:n], Path(scratch), options)
                found[name][str(n)] = float(np.median(runs["first_token_s"]) * 1e3)
    return found


def peer_table(report: dict) -> str:
    """First token ms per length: every ortforge variant in pieces of LONG_PROMPT_PIECE, then each peer."""
    ours = {v: f["first_token_ms"] for v, f in report["variants"].items() if f["pieces_proven"]}
    peers = report.get("peers", {})
    head = " | ".join([*(f"ortforge {v}, pieces of {LONG_PROMPT_PIECE}" for v in ours), *peers])
    lines = [f"| prompt tokens | {head} |", "|---|" + "---|" * (len(ours) + len(peers))]
    for n in map(str, report["lengths"]):
        cells = [f"{by[n][str(LONG_PROMPT_PIECE)]:,.0f}" for by in ours.values()]
        cells += [f"{peer[n]:,.0f}" for peer in peers.values()]
        lines.append(f"| {int(n):,} | {' | '.join(cells)} |")
    return "\n".join(lines)


def table(report: dict) -> str:
    pieces = report["pieces"]
    head = "| variant | prompt tokens | whole, ms | " + " | ".join(f"pieces of {p}, ms" for p in pieces)
    lines = [head + f" | pieces of {LONG_PROMPT_PIECE} (the runtime's) against whole |"]
    lines.append("|---|---|---|" + "---|" * (len(pieces) + 1))
    for variant, found in report["variants"].items():
        for n in sorted(found["first_token_ms"], key=int):
            by_piece = found["first_token_ms"][n]
            whole, runtime = by_piece[str(WHOLE)], by_piece.get(str(LONG_PROMPT_PIECE))
            cells = " | ".join(f"{by_piece[str(p)]:,.0f}" if str(p) in by_piece else "-" for p in pieces)
            against = "-" if runtime is None else f"x{runtime / whole:.2f}"
            lines.append(f"| {variant} | {int(n):,} | {whole:,.0f} | {cells} | {against} |")
    return "\n".join(lines)


def memory_lines(report: dict) -> list[str]:
    longest = max(report["lengths"])
    lines = []
    for variant, found in report["variants"].items():
        memory = found.get("memory")
        if memory:
            whole, pieced = memory[str(WHOLE)], memory[str(LONG_PROMPT_PIECE)]
            lines.append(
                f"{variant}, {longest:,}-token prompt: peak RSS {whole['peak_mb']:,.0f} MB whole, "
                f"{pieced['peak_mb']:,.0f} MB in pieces of {LONG_PROMPT_PIECE} "
                f"(session loaded: {whole['loaded_mb']:,.0f} MB)"
            )
    return lines


def summary(report: dict) -> str:
    """What the README shows: how it was measured, the piece table, the peers beside, memory."""
    peers = report["provenance"]["peers"]
    beside = f"; OpenVINO GenAI {peers['openvino-genai']} at its CPU defaults on the same token ids" if peers else ""
    head = (
        f"{report['model']}, batch-1 time to the first token (prefill and its argmax) of the first N tokens of "
        f"{report['text']}, {report['cpus']} cores, each variant in its own process with the settings its runtime.json "
        "gives on this CPU (onnxruntime's defaults where bench tuned it on another), "
        f"medians of {report['rounds']} interleaved rounds after a warm-up round{beside}:"
    )
    parts = [head, table(report)]
    if report.get("peers"):
        parts.append(peer_table(report))
    return "\n\n".join([*parts, "\n".join(f"- {line}" for line in memory_lines(report))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="fp32,int4,int8,w8a8")
    parser.add_argument("--lengths", default="256,1024,2048,4096")
    parser.add_argument("--pieces", default="128,256,512")
    parser.add_argument("--rounds", type=int, default=2, help="every length and piece size once per round")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    lengths = sorted(int(n) for n in args.lengths.split(","))
    pieces = sorted(int(p) for p in args.pieces.split(","))
    if min(lengths) < 1 or min(pieces) < 1 or args.rounds < 1:
        raise SystemExit("error: --lengths, --pieces and --rounds must be positive")
    if LONG_PROMPT_PIECE not in pieces:
        raise SystemExit(f"error: --pieces must include {LONG_PROMPT_PIECE} (the runtime's piece)")
    os.chdir(REPO)
    measured = provenance.model_outputs(args.model, variants)
    provenance.require_current(measured)
    ids = prompt_ids(paths.hf_dir(args.model), TEXT, max(lengths))
    from benchmarks import prefill_pieces as here  # a fresh process imports this module by name

    report = {
        "provenance": provenance.record(provenance.command("prefill_pieces.py", argv), measured),
        "model": args.model,
        "cpus": os.cpu_count(),
        "text": TEXT.relative_to(REPO).as_posix(),
        "rounds": args.rounds,
        "lengths": lengths,
        "pieces": pieces,
        "variants": {},
    }
    for variant in variants:
        folder = str(paths.variant_dir(args.model, variant))
        print(f"{variant}: first token at {lengths} tokens, whole and in pieces of {pieces}", flush=True)
        found = in_fresh_process(here.first_tokens, folder, ids, lengths, pieces, args.rounds)
        medians = {n: {p: float(np.median(s) * 1e3) for p, s in by.items()} for n, by in found["seconds"].items()}
        report["variants"][variant] = {**found, "first_token_ms": medians}
        if found["pieces_proven"]:
            print(f"{variant}: peak RSS at {max(lengths)} tokens", flush=True)
            report["variants"][variant]["memory"] = {
                str(p): in_fresh_process(here.peak_memory, folder, ids, p) for p in (WHOLE, LONG_PROMPT_PIECE)
            }
        print(table({**report, "variants": {variant: report["variants"][variant]}}), flush=True)
    if openvino_peer.installed():
        report["peers"] = openvino_first_tokens(args.model, ids, lengths, args.rounds)
        report["provenance"]["peers"] = {"openvino-genai": openvino_peer.version(openvino_peer.PYTHON)}
    else:
        print(f"OpenVINO GenAI not installed ({openvino_peer.SETUP} installs it): ortforge alone", flush=True)
    name = "prefill_pieces.json" if args.model == "smollm2-135m" else f"prefill_pieces-{args.model}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / name, report)
    print(summary(report))
    print(f"wrote {RESULTS / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Replay load_peers' workload through ortforge's own Scheduler over a stand-in batch decoder whose
runs take the times measured for each variant, to compare prefill shares without the model:

    python benchmarks/scheduler_replay.py --shares 1.5 4 8 16 --finish-shares 0 8

A step over r rows sleeps as long as step_profile.json's batched step took at 1, 4 and 8 rows
(interpolated); a prefill piece of t tokens as a 1-row step plus t/128 of what a 128-token prompt's
first token took beyond it (load_peers.json). The scheduler, the streams and the figures are the
real code (ortforge/scheduler.py, tasks/measurement/concurrency.py); only the model is replaced,
and sleeping leaves the cores free, so it runs beside other work. It prints a table; what a share
does on the real model is load_peers.py's to measure (this is how PREFILL_SHARE and FINISH_SHARE
were chosen).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ortforge import scheduler  # noqa: E402
from ortforge.generate import LONG_PROMPT_PIECE  # noqa: E402
from tasks.measurement.concurrency import request, request_figures, run_streams  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
VOCAB = 8  # the stand-in's logits: greedy picks the last id, never a stop id


class Timings:
    def __init__(self, step_ms: dict[int, float], first_token_128_ms: float):
        self.rows, self.step_ms = sorted(step_ms), [step_ms[r] for r in sorted(step_ms)]
        self.per_token_ms = (first_token_128_ms - self.step(1) * 1e3) / 128

    def step(self, rows: int) -> float:
        return float(np.interp(rows, self.rows, self.step_ms)) / 1e3

    def piece(self, tokens: int) -> float:
        return self.step(1) + tokens * self.per_token_ms / 1e3


def measured(variant: str) -> Timings:
    profile = json.loads((RESULTS / "step_profile.json").read_text(encoding="utf-8"))["variants"][variant]
    peers = json.loads((RESULTS / "load_peers.json").read_text(encoding="utf-8"))
    steps = {int(rows): found["batch_step_ms_p50"] for rows, found in profile["scheduler"].items()}
    return Timings(steps, peers["engines"][f"ortforge {variant}"]["first_token_seconds"]["128"] * 1e3)


class StandInBatch:
    """The methods Scheduler calls on a BatchDecoder, each taking the measured time."""

    timings: Timings

    def __init__(self, session, slots: int, *args, **kwargs):
        self.lengths, self.taken = [0] * slots, [False] * slots
        self.single = self

    @staticmethod
    def supports(session) -> bool:
        return True

    def runs_like_any(self, length: int) -> bool:
        return True

    def free_rows(self) -> list[int]:
        return [row for row, taken in enumerate(self.taken) if not taken]

    def begin(self, row: int, token_ids: list[int]) -> None:
        self.taken[row] = True

    def reuse_prefix(self, row: int, token_ids: list[int]) -> int:
        return 0

    def prefill_piece(self, row: int, token_ids: list[int], last: bool = False) -> np.ndarray:
        time.sleep(self.timings.piece(len(token_ids)))
        self.lengths[row] += len(token_ids)
        return np.arange(VOCAB, dtype=np.float32)

    def finish(self, row: int, token_ids: list[int]) -> None:
        pass

    def step(self, tokens: dict[int, int]) -> dict[int, np.ndarray]:
        time.sleep(self.timings.step(max(tokens) + 1))  # rows sitting out below the last one run too
        for row in tokens:
            self.lengths[row] += 1
        return {row: np.arange(VOCAB, dtype=np.float32) for row in tokens}

    def release(self, row: int) -> None:
        self.lengths[row], self.taken[row] = 0, False


class StandInGenerator:
    session, prefill_chunk, rope, stop_ids = None, LONG_PROMPT_PIECE, None, frozenset()  # as TextGenerator's

    class decoder:  # noqa: N801 - the attribute Scheduler reads
        kv_bytes_per_token, context_length = 1, 4096

    class proven:  # noqa: N801
        rows = True


def replay(streams: int, requests: int, prompt_tokens: int, new_tokens: int, share: float, finish: float) -> dict:
    replaced, scheduler.BatchDecoder = scheduler.BatchDecoder, StandInBatch
    try:
        loop = scheduler.Scheduler(
            StandInGenerator(), slots=streams, queue_size=streams, prefill_share=share, finish_share=finish
        ).start()
    finally:
        scheduler.BatchDecoder = replaced
    prompts = [[[1] * prompt_tokens for _ in range(requests)] for _ in range(streams)]
    try:
        request(loop, [1] * prompt_tokens, 4)  # the first step's and prefill's times are measured
        done, wall = run_streams(prompts, lambda prompt: request(loop, prompt, new_tokens))
    finally:
        loop.stop()
    return request_figures(done, wall)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[scheduler.PREFILL_SHARE, 4, 8, 16])
    parser.add_argument("--finish-shares", type=float, nargs="+", default=[0, scheduler.FINISH_SHARE])
    parser.add_argument("--variants", nargs="+", default=["int4", "int8", "w8a8"])
    args = parser.parse_args(argv)
    workload = json.loads((RESULTS / "load_peers.json").read_text(encoding="utf-8"))
    shape = workload["requests_per_stream"], workload["prompt_tokens"], workload["new_tokens"]
    most = max(int(s) for s in workload["streams"])
    columns = f"{most} streams tok/s | x 1 stream | first token ms p50 / p95 | inter-token ms p50 / p95"
    print(f"| variant | prefill share | finish share | {columns} |")
    print("|---|---|---|---|---|---|---|")
    for variant in args.variants:
        StandInBatch.timings = measured(variant)
        alone = replay(1, *shape, args.shares[0], args.finish_shares[0])["aggregate_tokens_per_second"]
        for share, finish in itertools.product(args.shares, args.finish_shares):
            f = replay(most, *shape, share, finish)
            speed, first = f["aggregate_tokens_per_second"], f"{f['seconds_to_first_token_p50'] * 1e3:.0f}"
            first += f" / {f['seconds_to_first_token_p95'] * 1e3:.0f}"
            gaps = f"{f['inter_token_ms_p50']:.1f} / {f['inter_token_ms_p95']:.1f}"
            row = [variant, f"{share:g}", f"{finish:g}", f"{speed:.1f}", f"{speed / alone:.2f}", first, gaps]
            print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the time of serving goes: onnxruntime's profiler, per operator, over one batched decode
step with 1, 4 and 8 occupied rows and over a 128-token prefill, and the Python time around the
model runs: BatchDecoder's bindings and copies, then the scheduler's own work per step (sampling
each row, handing tokens over).

    python benchmarks/step_profile.py [--model smollm2-135m] [--variants int4 int8 w8a8 w8a8_attn fp32] [--steps 30]
    python benchmarks/step_profile.py --prompt-tokens 512 --variants w8a8 w8a8_attn   # longer rows

Each variant runs in its own fresh process with the session settings bench tuned for it
(runtime.json), as `ortforge serve` runs it. Profiling costs a little time per operator, so the
scheduler's figures come from a second process without the profiler. Writes
benchmarks/results/step_profile.json (step_profile-<N>.json for prompts of N tokens other than 128);
scripts/readme_figures.py summarizes it in the README.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from tasks.bench import prompt_ids  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ROWS = (1, 4, 8)
PROMPT_TOKENS = 128
WARMUP_RUNS = 3
UNTIMED = "untimed"  # warm-up runs and the prefills that fill rows before their steps


def prefill_label(tokens: int) -> str:
    return f"prefill {tokens} tokens"


def result_name(prompt_tokens: int) -> str:
    return "step_profile" if prompt_tokens == PROMPT_TOKENS else f"step_profile-{prompt_tokens}"


def step_label(rows: int) -> str:
    return f"step, {rows} row{'s' if rows > 1 else ''}"


class LabelledRuns:
    """The session, noting a label for each model run so profiler events can be told apart."""

    def __init__(self, session):
        self.session, self.label, self.labels = session, UNTIMED, []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run_with_iobinding(self, binding, *args):
        self.labels.append(self.label)
        return self.session.run_with_iobinding(binding, *args)


def profile_variant(folder: str, prompts: list[list[int]], steps: int, repeats: int) -> dict:
    """Run in a fresh process: profiler events per labelled phase, and each phase's Python wall
    time per operation (a prefill, a step)."""
    import onnxruntime as ort

    from ortforge import custom_ops
    from ortforge.batch import BatchDecoder
    from ortforge.names import MODEL_FILE
    from ortforge.session import SessionSettings

    settings = SessionSettings.for_artifact(Path(folder))
    options = settings.session_options()
    custom_ops.register(options, Path(folder) / MODEL_FILE)
    scratch = tempfile.mkdtemp(prefix="ortforge-profile-")
    options.enable_profiling, options.profile_file_prefix = True, os.path.join(scratch, "ort")
    session = ort.InferenceSession(str(Path(folder) / MODEL_FILE), options, providers=["CPUExecutionProvider"])
    batch = BatchDecoder(session, max(ROWS), settings.prefill_chunk)
    runs = batch.session = LabelledRuns(session)
    wall: dict[str, list[float]] = defaultdict(list)

    def timed(label: str, work) -> None:
        runs.label = label
        start = time.perf_counter()
        work()
        wall[label].append(time.perf_counter() - start)
        runs.label = UNTIMED

    for _ in range(WARMUP_RUNS):
        batch.prefill(0, prompts[0])
        batch.release(0)
    for _ in range(repeats):
        timed(prefill_label(len(prompts[0])), lambda: batch.prefill(0, prompts[0]))
        batch.release(0)
    for rows in ROWS:
        for row in range(rows):
            batch.prefill(row, prompts[row])
        tokens = {row: prompts[row][-1] for row in range(rows)}
        for _ in range(WARMUP_RUNS):
            batch.step(tokens)
        for _ in range(steps):
            timed(step_label(rows), lambda tokens=tokens: batch.step(tokens))
        for row in range(rows):
            batch.release(row)
    trace = session.end_profiling()
    events = json.loads(Path(trace).read_text(encoding="utf-8"))
    return {
        "settings": settings.to_dict(),
        "phases": phases(events, runs.labels, wall),
    }


def phases(events: list[dict], labels: list[str], wall: dict[str, list[float]]) -> dict:
    """Per label: model runs per operation, each run's time (p50), kernel time per operator type
    per operation, and the Python time around the runs (wall time of the operation less its runs)."""
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    if len(model_runs) != len(labels):
        raise RuntimeError(f"the profiler saw {len(model_runs)} model runs, the session was asked for {len(labels)}")
    starts = [run["ts"] for run in model_runs]
    per_label: dict[str, dict] = defaultdict(lambda: {"run_us": [], "ops_us": defaultdict(float)})
    for run, label in zip(model_runs, labels, strict=True):
        per_label[label]["run_us"].append(run["dur"])
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        index = bisect.bisect_right(starts, event["ts"]) - 1
        if index >= 0 and labels[index] != UNTIMED:
            per_label[labels[index]]["ops_us"][event["args"]["op_name"]] += event["dur"]
    found = {}
    for label, times in wall.items():
        figures = per_label[label]
        operations = len(times)
        # an operation's model time: the sum of its runs (a chunked prefill makes several)
        model_ms = np.asarray(figures["run_us"], dtype=float).reshape(operations, -1).sum(axis=1) / 1e3
        wall_ms = np.asarray(times) * 1e3
        ops = {op: us / 1e3 / operations for op, us in figures["ops_us"].items()}
        found[label] = {
            "operations": operations,
            "model_runs_per_operation": len(figures["run_us"]) // operations,
            "wall_ms_p50": float(np.median(wall_ms)),
            "model_run_ms": float(np.median(model_ms)),
            "python_ms": float(np.median(wall_ms - model_ms)),  # per operation, then the median
            "kernel_ms": sum(ops.values()),  # mean per operation, as ops_ms
            "ops_ms": ops,
        }
    return found


def scheduler_time(folder: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Run in a fresh process, no profiler: per number of rows, the scheduler's time per step
    (from one step's start to the next's) and the part of it that is BatchDecoder.step; the rest
    is the scheduler's own Python (sampling each row, callbacks, the loop). Prompts are prefilled
    a whole piece a turn (no share of a step's time: this measures steps, not interleaving), and
    a turn that ran a prompt's piece is left out."""
    from ortforge.generate import TextGenerator
    from ortforge.scheduler import Job, Scheduler

    generator = TextGenerator(Path(folder))
    found = {}
    for rows in ROWS:
        scheduler = Scheduler(generator, slots=rows, queue_size=rows, prefill_share=1e9)
        marks: list[tuple[float, float, int]] = []  # (start, end, rows stepped) of every step
        prefills: list[float] = []
        step, prefill = scheduler.batch.step, scheduler.batch.prefill_piece

        def timed_step(tokens, step=step, marks=marks):
            start = time.perf_counter()
            result = step(tokens)
            marks.append((start, time.perf_counter(), len(tokens)))
            return result

        def timed_prefill(row, ids, last=False, prefill=prefill, prefills=prefills):
            prefills.append(time.perf_counter())
            return prefill(row, ids, last=last)

        scheduler.batch.step, scheduler.batch.prefill_piece = timed_step, timed_prefill
        done = threading.Semaphore(0)
        # Every job queued before the loop starts, so all join in its first turns: submitted
        # while it ran, a job could finish before the last one joined (a short one under load did),
        # leaving no step with every row decoding to time.
        for row in range(rows):
            ended = lambda reason, done=done: done.release()  # noqa: E731
            scheduler.submit(Job(prompts[row], new_tokens, lambda token: None, ended))
        scheduler.start()
        for _ in range(rows):
            done.acquire()
        scheduler.stop()
        loops, steps = [], []
        for (start, end, stepped), (following, _, _) in zip(marks, marks[1:], strict=False):
            joined = any(start <= mark < following for mark in prefills)
            if stepped == rows and not joined:  # every row decoding, nobody joining in between
                loops.append(following - start)
                steps.append(end - start)
        found[str(rows)] = {
            "steps": len(loops),
            "loop_ms_p50": float(np.median(loops)) * 1e3 if loops else None,
            "batch_step_ms_p50": float(np.median(steps)) * 1e3 if steps else None,
            "scheduler_python_ms": float(np.median(np.subtract(loops, steps))) * 1e3 if loops else None,
        }
    return found


def table(report: dict) -> str:
    """Per variant and phase: model time, the Python around it, and the operators that take most."""
    lines = [
        "| variant | phase | ms without the profiler | ms under it | of which model runs | Python around the runs "
        "| scheduler's own Python | top operators under the profiler, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, figures in report["variants"].items():
        for label, phase in figures["phases"].items():
            alone = figures["scheduler"].get(label.split()[1], {}) if label.startswith("step") else {}
            plain, own = alone.get("batch_step_ms_p50"), alone.get("scheduler_python_ms")
            largest = sorted(phase["ops_ms"].items(), key=lambda item: -item[1])[:4]  # the JSON sorts keys
            top = ", ".join(f"{op} {ms:.2f}" for op, ms in largest)
            lines.append(
                f"| {variant} | {label} | {_ms(plain)} | {phase['wall_ms_p50']:.2f} | {phase['model_run_ms']:.2f} "
                f"| {phase['python_ms']:.2f} | {_ms(own)} | {top} |"
            )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def batching_cost(report: dict) -> list[str]:
    """Per variant: what a step of 8 rows costs against 1 row, which operators grow, and the
    Python's share of a plain 1-row step."""
    lines = []
    for variant, figures in report["variants"].items():
        one, eight = (figures["scheduler"][rows]["batch_step_ms_p50"] for rows in ("1", "8"))
        ops_one, ops_eight = (figures["phases"][step_label(rows)]["ops_ms"] for rows in (1, 8))
        growth = {
            kind: _sum(ops_eight, prefix) / _sum(ops_one, prefix)
            for kind, prefix in (("matmuls", "MatMul"), ("attention", "GroupQueryAttention"))
        }
        python = figures["phases"][step_label(1)]["python_ms"]
        own = figures["scheduler"]["1"]["scheduler_python_ms"]
        lines.append(
            f"- {variant}: a step of 8 rows takes x{eight / one:.2f} the time of 1 row ({one:.1f} -> {eight:.1f} ms "
            f"without the profiler); from 1 to 8 rows its matmuls take x{growth['matmuls']:.2f} and attention "
            f"x{growth['attention']:.2f}; the Python around a 1-row step's run {python:.2f} ms ({python / one:.0%} of "
            f"the step), the scheduler's own {own:.2f} ms"
        )
    return lines


def _sum(ops: dict[str, float], prefix: str) -> float:
    return sum(ms for op, ms in ops.items() if op.startswith(prefix))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", nargs="+", default=["int4", "int8", "w8a8", "w8a8_attn", "fp32"])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per number of rows")
    parser.add_argument("--repeats", type=int, default=5, help="timed prefills")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per job in the scheduler's run")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each row's prompt")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    measured = provenance.model_outputs(args.model, args.variants)
    provenance.require_current(measured)
    text = REPO / "data" / "eval" / "GPL-3.txt"
    size = args.prompt_tokens
    ids = prompt_ids(paths.hf_dir(args.model), text, size * (max(ROWS) + 1))
    prompts = [ids[i * size : (i + 1) * size] for i in range(max(ROWS))]  # no shared prefix
    report = {
        "provenance": provenance.record(provenance.command("step_profile.py", argv), measured),
        "model": args.model,
        "cpus": os.cpu_count(),
        "prompt_tokens": size,
        "variants": {},
    }
    # A fresh process imports the function's module by name: this script's, not __main__.
    from benchmarks import step_profile as here

    for variant in args.variants:
        folder = str(paths.variant_dir(args.model, variant))
        print(f"{variant}: profiling", flush=True)
        figures = in_fresh_process(here.profile_variant, folder, prompts, args.steps, args.repeats)
        print(f"{variant}: scheduler", flush=True)
        figures["scheduler"] = in_fresh_process(here.scheduler_time, folder, prompts, args.new_tokens)
        report["variants"][variant] = figures
    print(table(report))
    print("\n".join(batching_cost(report)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    written = RESULTS / f"{result_name(size)}.json"
    atomic_write_json(written, report)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Scaling of the build flow's fan-out: wall time to quantize and validate N variants of the default
model with 1 and 2 parallel workers. Each step is the flow's own `variant` task (one
`dvc repro --single-item` per stage), run through Prefect's thread-pool task runner.

    python benchmarks/fanout.py [--model smollm2-135m] [--variants int8,int4,int4_hqq,int4_mixed]

Needs `dvc repro` first. Works in a fresh clone under benchmarks/.cache/fanout whose shared stages
(download, export, optimize, reference) are checked out from this repository's cache; before each
measurement the variants' outputs and lock entries are reset and DVC points at an empty cache, so
every stage really runs. Bench stages are left out: the flow runs them one at a time on purpose.
Writes benchmarks/results/fanout.json and prints the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from flows.dvc import dvc as run_dvc  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
WORK = REPO / "benchmarks" / ".cache" / "fanout"
DEFAULT_VARIANTS = "int8,int4,int4_hqq,int4_mixed"


def dvc(root: Path, *args: str) -> None:
    run_dvc(root, *args, echo=False)  # quiet: only the timings are printed


def prepare(model: str) -> Path:
    """A fresh clone with the model's shared stages checked out of this repository's cache."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(WORK)], check=True)
    dvc(WORK, "config", "--local", "cache.dir", str(REPO / ".dvc" / "cache"))
    dvc(WORK, "checkout", *(f"{stage}@{model}" for stage in ("download", "export", "optimize", "reference")))
    return WORK


def reset(root: Path, model: str, variants: list[str]) -> None:
    """Forget the variants: no outputs, no lock entries, and an empty cache (so no run-cache hits)."""
    for variant in variants:
        shutil.rmtree(root / "artifacts" / model / "variants" / variant, ignore_errors=True)
        (root / "artifacts" / model / "variants" / f"{variant}.valid.json").unlink(missing_ok=True)
    subprocess.run(["git", "checkout", "-q", "dvc.lock"], cwd=root, check=True)
    empty = root / ".bench-cache"
    shutil.rmtree(empty, ignore_errors=True)
    dvc(root, "config", "--local", "cache.dir", str(empty))


def fan_out_seconds(root: Path, model: str, variants: list[str], workers: int) -> tuple[float, int]:
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.build import variant

    @flow(name="fanout-benchmark", task_runner=ThreadPoolTaskRunner(max_workers=workers))
    def fan_out() -> list[str]:
        futures = [variant.submit(root, model, name) for name in variants]
        return [stage for future in futures for stage in future.result()]

    started = time.perf_counter()
    executed = fan_out()
    return time.perf_counter() - started, len(executed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    # What every variant starts from; the variants' own stages are rebuilt from empty each time.
    measured = [f"artifacts/{args.model}/{name}" for name in ("hf", "optimized", "reference")]
    provenance.require_current(measured)
    root = prepare(args.model)

    from prefect import flow

    flow(name="warm-up")(lambda: None)()  # start Prefect's temporary server outside the timings
    results = {}
    for workers in (1, 2):
        reset(root, args.model, variants)
        seconds, stages = fan_out_seconds(root, args.model, variants, workers)
        assert stages == 2 * len(variants), f"expected every stage to run, {stages} did"
        results[workers] = round(seconds, 1)
        print(f"{workers} worker(s): {seconds:.1f} s for {stages} stages", flush=True)
    summary = {
        "provenance": provenance.record(provenance.command("fanout.py", argv), measured),
        "model": args.model,
        "variants": variants,
        "stages": 2 * len(variants),
        "seconds_by_workers": results,
        "speedup_2_vs_1": round(results[1] / results[2], 2),
        "cpus": len(os.sched_getaffinity(0)),
    }
    atomic_write_json(RESULTS / "fanout.json", summary)
    print(f"| workers | wall time | speed-up |\n|---|---|---|\n| 1 | {results[1]} s | 1.00 |")
    print(f"| 2 | {results[2]} s | {summary['speedup_2_vs_1']:.2f} |")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

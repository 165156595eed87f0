"""Build every model through the DVC DAG from Prefect, fanning independent stages out in parallel.

DVC decides what needs work (one cache, not two); the flow decides what may run at the same time:

    download@M (retried)  ->  export@M, optimize@M, reference@M   (per model, models in parallel)
                          ->  quantize@M-V, validate@M-V          (per variant, all in parallel)
                          ->  bench@M-V                           (one at a time, machine-wide)
                          ->  evaluate@M-V                        (per variant, in parallel, between benches)
                          ->  report@M, published as a Prefect markdown artifact

Each step runs `dvc repro --single-item` on its own stages, after the steps it needs, so no two DVC
processes ever want the same stage (DVC's "is busy" lock error cannot occur), and DVC records each
stage in dvc.lock as usual. Benchmarks run one at a time: timings taken while other stages load the
same cores would be noise, so no evaluate (task A/B) runs beside one either. A final plain
`dvc repro` confirms nothing is left to do.

Threads on this machine by default; `--dask tcp://scheduler:8786` (or ORTFORGE_DASK_ADDRESS) sends
the steps to a Dask cluster whose workers share this repository (a shared file system) and the DVC
remote. With no PREFECT_API_URL a temporary local Prefect server starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.dvc import build_lock, metrics_diff, reproduce
from flows.preflight import before_build, measurements_kept, tidy
from tasks.core import paths
from tasks.core.params import load_params

DASK_ENV = "ORTFORGE_DASK_ADDRESS"
SHARED_STAGES = ("export", "optimize", "reference")  # per model, upstream of every variant
VARIANT_STAGES = ("quantize", "validate")  # per variant, independent of the other variants


def single_stages(root: Path, stages: list[str]) -> list[str]:
    """Reproduce each stage alone, in order (its upstream is already built); return those executed."""
    return [ran for stage in stages for ran in reproduce(root, [stage], "--single-item")]


# Prefect's result cache keys on argument values, not file contents; DVC owns content hashing.
@task(retries=3, retry_delay_seconds=[5, 30, 120], cache_policy=NO_CACHE)
def download(root: Path, model: str) -> list[str]:
    return reproduce(root, [f"download@{model}"], "--single-item")


@task(cache_policy=NO_CACHE)
def shared(root: Path, model: str) -> list[str]:
    return single_stages(root, [f"{stage}@{model}" for stage in SHARED_STAGES])


@task(cache_policy=NO_CACHE)
def variant(root: Path, model: str, name: str) -> list[str]:
    return single_stages(root, [f"{stage}@{model}-{name}" for stage in VARIANT_STAGES])


@task(cache_policy=NO_CACHE)
def bench(root: Path, model: str, variants: list[str]) -> list[str]:
    return single_stages(root, [f"bench@{model}-{name}" for name in variants])


@task(cache_policy=NO_CACHE)
def evaluate(root: Path, model: str, name: str) -> list[str]:
    return reproduce(root, [f"evaluate@{model}-{name}"], "--single-item")


@task(cache_policy=NO_CACHE)
def report(root: Path, model: str) -> list[str]:
    """The model's report; published with the metrics diff against the last commit."""
    executed = reproduce(root, [f"report@{model}"], "--single-item")
    table = (root / paths.report_md(model)).read_text(encoding="utf-8")
    diff = metrics_diff(root)
    markdown = f"{table}\n## Metrics against the last commit\n\n{diff or 'No metric changed.'}\n"
    create_markdown_artifact(markdown=markdown, key=f"report-{model}", description=f"ortforge results for {model}")
    return executed


@flow(name="ortforge-build", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=2))
def build(root: Path = Path("."), models: list[str] | None = None) -> dict[str, list[str]]:
    """Reproduce the DAG; returns the stages executed, keyed by step (`download@M`, `variant@M-V`...)."""
    logger = get_run_logger()
    root = Path(root).resolve()
    params = load_params(root / paths.PARAMS)
    names = models or list(params.models)
    variants = {model: params.variants_of(model) for model in names}
    with build_lock(root, say=logger.info), contextlib.ExitStack() as cleanup:
        before_build(root)
        cleanup.callback(tidy, root)
        cleanup.enter_context(measurements_kept(root))
        steps = {}
        for model in names:
            steps[f"download@{model}"] = download.submit(root, model)
            steps[f"shared@{model}"] = shared.submit(root, model, wait_for=[steps[f"download@{model}"]])
            for name in variants[model]:
                steps[f"variant@{model}-{name}"] = variant.submit(
                    root, model, name, wait_for=[steps[f"shared@{model}"]]
                )
        previous = []  # the last model's bench and task answers: the next bench waits for them
        for model in names:
            upstream = [steps[f"variant@{model}-{name}"] for name in variants[model]] + previous
            steps[f"bench@{model}"] = bench.submit(root, model, variants[model], wait_for=upstream)
            benched = [steps[f"bench@{model}"]]
            previous = list(benched)
            for name in variants[model]:
                steps[f"evaluate@{model}-{name}"] = evaluate.submit(root, model, name, wait_for=benched)
                previous.append(steps[f"evaluate@{model}-{name}"])
            steps[f"report@{model}"] = report.submit(root, model, wait_for=previous)
        executed = {step: future.result() for step, future in steps.items()}
        executed["check"] = reproduce(root, [f"report@{model}" for model in names])
    ran = sorted({stage for stages in executed.values() for stage in stages})
    logger.info("stages executed: %s", ", ".join(ran) if ran else "none (everything was up to date)")
    return executed


def task_runner(dask_address: str | None, workers: int):
    """Dask when an address is given (prefect-dask), else a thread pool of `workers`."""
    if dask_address:
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=dask_address)
    return ThreadPoolTaskRunner(max_workers=workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: .)")
    parser.add_argument("--model", action="append", help="build only this model (repeatable)")
    parser.add_argument("--workers", type=int, default=2, help="parallel steps on this machine (default: 2)")
    parser.add_argument("--dask", default=os.environ.get(DASK_ENV), help=f"Dask scheduler address (or ${DASK_ENV})")
    args = parser.parse_args(argv)
    build.with_options(task_runner=task_runner(args.dask, args.workers))(args.root, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

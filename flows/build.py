"""Build every model through the DVC DAG from Prefect.

DVC decides what needs work (one cache, not two): the flow asks it to reproduce the download stages
first, with retries for transient network errors, then everything else, and publishes each model's
results table as a Prefect markdown artifact. Runs without a Prefect server (a temporary local one
starts); set PREFECT_API_URL to report to a real one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.dvc import build_lock, reproduce
from tasks import paths
from tasks.params import load_params


# Prefect's result cache keys on argument values, not file contents; DVC owns content hashing.
@task(retries=3, retry_delay_seconds=[5, 30, 120], cache_policy=NO_CACHE)
def download(root: Path, model: str) -> list[str]:
    return reproduce(root, [f"download@{model}"])


@task(cache_policy=NO_CACHE)
def build_model(root: Path, model: str) -> list[str]:
    """The model's report and everything upstream of it: every variant's quantize, validate, bench."""
    return reproduce(root, [f"report@{model}"])


@task(cache_policy=NO_CACHE)
def publish_report(root: Path, model: str) -> str:
    table = (root / paths.report_md(model)).read_text(encoding="utf-8")
    create_markdown_artifact(markdown=table, key=f"report-{model}", description=f"ortforge results for {model}")
    return table


@flow(name="ortforge-build", log_prints=True)
def build(root: Path = Path("."), models: list[str] | None = None) -> dict[str, list[str]]:
    """Reproduce the DAG; returns the stages executed, keyed by step."""
    logger = get_run_logger()
    root = Path(root).resolve()
    names = models or list(load_params(root / paths.PARAMS).models)
    with build_lock(root, say=logger.info):
        executed = {f"download@{name}": download(root, name) for name in names}
        for name in names:
            executed[f"report@{name}"] = build_model(root, name)
            publish_report(root, name)
    ran = sorted({stage for stages in executed.values() for stage in stages})
    logger.info("stages executed: %s", ", ".join(ran) if ran else "none (everything was up to date)")
    return executed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: .)")
    parser.add_argument("--model", action="append", help="build only this model (repeatable)")
    args = parser.parse_args(argv)
    build(args.root, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

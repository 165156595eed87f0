"""Scheduled rebuilds: follow upstream model revisions, pull what the team already built, rebuild
what changed, push it back, and publish the results and the metrics diff.

    python -m flows.scheduled serve [--cron "0 3 * * *"]   # serve the deployment ortforge-rebuild/nightly
    python -m flows.scheduled run                            # one rebuild now

A Hub model whose params set `follow: <branch>` gets its pinned `revision` bumped to the branch's
current commit (params.yaml is edited in place, comments kept); commit that change to keep it.
Network steps (the Hub, the DVC remote) retry on transient errors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.build import build
from flows.dvc import dvc, metrics_diff
from tasks.core import paths
from tasks.core.params import HubSource, load_params

DEPLOYMENT = "nightly"
DEFAULT_CRON = "0 3 * * *"
NETWORK_RETRIES = {"retries": 3, "retry_delay_seconds": [10, 60, 300], "cache_policy": NO_CACHE}


@task(**NETWORK_RETRIES)
def upstream_revision(repo_id: str, branch: str) -> str:
    """The commit a Hub branch points at now."""
    from huggingface_hub import HfApi

    return HfApi().model_info(repo_id, revision=branch).sha


def bump_revision(params_file: Path, model: str, revision: str) -> None:
    """Set models.<model>.source.revision in params.yaml, keeping its comments and layout."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    data = yaml.load(params_file.read_text(encoding="utf-8"))
    data["models"][model]["source"]["revision"] = revision
    tmp = params_file.with_suffix(".yaml.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        yaml.dump(data, handle)
    tmp.replace(params_file)


@task(cache_policy=NO_CACHE)
def follow_upstream(root: Path, revision_of=upstream_revision) -> dict[str, dict[str, str]]:
    """Bump every followed Hub model to its branch's commit; return what moved."""
    params_file = root / paths.PARAMS
    moved = {}
    for name, spec in load_params(params_file).models.items():
        source = spec.source
        if isinstance(source, HubSource) and source.follow:
            latest = revision_of(source.repo_id, source.follow)
            if latest != source.revision:
                bump_revision(params_file, name, latest)
                moved[name] = {"from": source.revision, "to": latest, "branch": source.follow}
    return moved


@task(**NETWORK_RETRIES)
def pull(root: Path) -> None:
    dvc(root, "pull", "--allow-missing")


@task(**NETWORK_RETRIES)
def push(root: Path) -> None:
    from flows.cache_links import remove_damaged

    # A hard-linked output written in place since the build would push damaged bytes.
    if remove_damaged(root, get_run_logger().warning):
        raise RuntimeError("cache objects were written in place after the build; rebuild before pushing")
    dvc(root, "push")


@task(cache_policy=NO_CACHE)
def publish_summary(root: Path, executed: list[str], moved: dict) -> str:
    diff = metrics_diff(root)
    lines = ["# ortforge rebuild", ""]
    lines += [f"- {name}: {m['branch']} moved {m['from'][:12]} -> {m['to'][:12]}" for name, m in moved.items()]
    lines += [f"Stages executed: {', '.join(executed) if executed else 'none'}", ""]
    lines += ["## Metrics against the last commit", "", diff or "No metric changed."]
    summary = "\n".join(lines) + "\n"
    create_markdown_artifact(markdown=summary, key="rebuild-summary", description="what the scheduled rebuild did")
    return summary


@flow(name="ortforge-rebuild", log_prints=True)
def rebuild(root: str = ".", push_results: bool = True) -> list[str]:
    """One scheduled rebuild; returns the stages it executed."""
    logger = get_run_logger()
    repo = Path(root).resolve()
    moved = follow_upstream(repo)
    pull(repo)
    executed = sorted({stage for stages in build(repo).values() for stage in stages})
    if push_results:
        push(repo)
    publish_summary(repo, executed, moved)
    logger.info("rebuild executed %d stage(s); upstream moved: %s", len(executed), moved or "nothing")
    return executed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve", "run"])
    parser.add_argument("--root", default=".", help="the repository root (default: .)")
    parser.add_argument("--cron", default=DEFAULT_CRON, help=f"schedule for serve (default: {DEFAULT_CRON!r})")
    parser.add_argument("--no-push", action="store_true", help="do not push results to the DVC remote")
    args = parser.parse_args(argv)
    parameters = {"root": str(Path(args.root).resolve()), "push_results": not args.no_push}
    if args.command == "run":
        rebuild(**parameters)
    else:
        rebuild.serve(name=DEPLOYMENT, cron=args.cron, parameters=parameters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

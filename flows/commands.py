"""The build side's `ortforge` commands, added to the runtime's command line through the
`ortforge.commands` entry point (pyproject.toml): they drive the same DVC stages and flows as
`dvc repro` and `python -m flows.build`.

    ortforge build [--model M]         reproduce the DAG (all models, or one), quietly, with its log
    ortforge status                    what is stale and why, from DVC
    ortforge bench [--model M]         measure every variant again on this machine, then report
    ortforge report [--model M]        print the results table (and where its offline HTML page is)
    ortforge doctor                    versions, CPU features, threads, free disk and memory

With a model name, `ortforge generate` runs the variant its report recommends (variant_folder).
This module imports nothing heavy: each command loads what it needs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path

from ortforge.cli import CliError

# What the build side imports first; a runtime-only install (`pip install ortforge`) lacks them.
BUILD_SIDE = ("dvc", "pydantic", "yaml")


def needs_build_side(function):
    """A command or lookup that says how to get the build side instead of failing on an import."""

    @functools.wraps(function)
    def checked(*args, **kwargs):
        missing = [name for name in BUILD_SIDE if importlib.util.find_spec(name) is None]
        if missing:
            raise CliError(
                f"this needs ortforge's build side ({', '.join(missing)} missing): pip install 'ortforge[build]', "
                f"or run scripts/install.sh in the repository"
            )
        return function(*args, **kwargs)

    return checked


def expected_errors() -> list[type[BaseException]]:
    from flows.dvc import BuildBusy, DvcFailed
    from tasks.core.errors import StageError

    return [StageError, DvcFailed, BuildBusy]  # none of these modules imports a build-side library


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def repository(root: Path) -> Path:
    from tasks.core import paths

    if not (root / paths.PARAMS).is_file():
        raise CliError(f"{root} has no params.yaml; run ortforge in the repository root or pass --root")
    return root


def models(root: Path, chosen: str | None) -> list[str]:
    """The params check (one line for a bad file) and the models to work on."""
    from tasks.core import paths
    from tasks.core.params import load_params

    params = load_params(repository(root) / paths.PARAMS)
    if chosen is not None:
        params.model(chosen)  # an unknown model stops here, naming the known ones
        return [chosen]
    return list(params.models)


def cmd_build(args: argparse.Namespace) -> int:
    from flows.dvc import build_lock
    from flows.preflight import before_build, measurements_kept, tidy
    from flows.progress import reproduce_with_progress

    chosen = [model for name in args.model or [None] for model in models(args.root, name)]
    targets = [f"report@{model}" for model in chosen] if args.model else None
    with build_lock(args.root, wait=not args.no_wait, say=_say):
        before_build(args.root)
        try:
            with measurements_kept(args.root):
                ran = reproduce_with_progress(args.root, targets)
        finally:
            tidy(args.root)
    print(f"{len(ran)} stage(s) executed" if ran else "everything was up to date; no stage executed")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from flows.dvc import stale_reasons

    models(args.root, None)  # the params check, before DVC's templating meets a bad file
    reasons = stale_reasons(args.root)
    if not reasons:
        print("up to date: `dvc repro` would execute no stage")
        return 0
    for stage, why in reasons.items():
        print(f"{stage}: {'; '.join(why)}")
    print(f"{len(reasons)} stage(s) stale; downstream stages rerun too if their inputs change. Run `ortforge build`.")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from flows.dvc import build_lock
    from flows.preflight import before_build, measurements_kept, tidy
    from flows.progress import reproduce_with_progress

    chosen = [model for name in args.model or [None] for model in models(args.root, name)]
    with build_lock(args.root, wait=not args.no_wait, say=_say):
        before_build(args.root)
        try:
            with measurements_kept(args.root):
                for model in chosen:
                    # Forced: the point is a fresh measurement on this machine, not DVC's cached figures.
                    reproduce_with_progress(args.root, [f"bench@{model}-*"], "--force", "--single-item", "--glob")
                    reproduce_with_progress(args.root, [f"report@{model}"])
        finally:
            tidy(args.root)
    return cmd_report(args)


def cmd_report(args: argparse.Namespace) -> int:
    from tasks.core import paths

    for model in [model for name in args.model or [None] for model in models(args.root, name)]:
        table = args.root / paths.report_md(model)
        if not table.is_file():
            raise CliError(f"{table} does not exist yet; run `ortforge build --model {model}` first")
        print(table.read_text(encoding="utf-8"))
        print(f"plots and table in one offline page: {args.root / paths.report_html(model)}\n")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from flows.doctor import report

    for line in report(args.root):
        print(line)
    return 0


@needs_build_side
def variant_folder(root: Path, model: str, variant: str | None) -> Path:
    """The folder of a model's variant: the one asked, or the one its report recommends."""
    from tasks.core import paths
    from tasks.core.files import read_json

    models(root, model)
    if variant is None:
        summary = root / paths.report_json(model)
        if not summary.is_file():
            raise CliError(f"{summary} does not exist, so no variant is recommended yet; pass --variant or build first")
        variant = read_json(summary)["recommended"]
        if variant is None:
            raise CliError(f"no variant of {model} is within the report's quality budget; pass --variant")
    folder = root / paths.variant_dir(model, variant)
    if not folder.is_dir():
        raise CliError(f"{folder} does not exist; check the variant name or run `ortforge build --model {model}`")
    return folder


def add_commands(commands) -> None:
    def command(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=needs_build_side(handler))
        return sub

    for name, handler, help_text in (
        ("build", cmd_build, "reproduce the DAG for every model, or one"),
        ("bench", cmd_bench, "measure every variant again on this machine, then report"),
    ):
        sub = command(name, handler, help_text)
        sub.add_argument("--model", action="append", help="only this model from params.yaml (repeatable)")
        sub.add_argument("--no-wait", action="store_true", help="stop instead of waiting when another build runs")
    sub = command("report", cmd_report, "print the results table of every model, or some")
    sub.add_argument("--model", action="append", help="only this model from params.yaml (repeatable)")
    command("status", cmd_status, "what is stale and why, from DVC")
    command("doctor", cmd_doctor, "versions, CPU features, threads, free disk and memory")

"""The `ortforge` command: build, inspect and run artifacts over the same functions the DAG uses.

    ortforge build [--model M]         reproduce the DAG (all models, or one), with a progress bar
    ortforge status                    what is stale and why, from DVC
    ortforge bench [--model M]         measure every variant again on this machine, then report
    ortforge report [--model M]        print the results table (and where its offline HTML page is)
    ortforge generate M "prompt"       stream tokens from a validated variant through the runtime
    ortforge doctor                    versions, CPU features, threads, free disk and memory

Heavy libraries load inside the commands that need them, so `--help` answers at once. Every
expected failure is one line, `error: ...`, naming the bad value and the fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_USAGE = 2


class CliError(Exception):
    """A one-line error for the user."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are an expected failure too: one `error:` line and exit status 2, no usage dump."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _utf8_streams() -> None:
    # Prompts, tokens and reports are UTF-8 whatever the locale: under LANG=C (with Python's locale
    # coercion off) stdout would otherwise be ASCII and the first Hangul or emoji would raise.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="replace")


def _stdin_text() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CliError(
            f"the prompt read from stdin is not UTF-8 (byte 0x{data[error.start]:02x} at offset {error.start}); "
            f"convert it, e.g. with `iconv -t UTF-8`"
        ) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of tokens; ask for at least 1")
    return value


def _argument_text(value: str) -> str:
    """A command-line argument as the UTF-8 the user typed (a C locale decodes argv as ASCII)."""
    return os.fsencode(value).decode("utf-8", errors="replace")


def _models(root: Path, chosen: str | None) -> list[str]:
    from tasks import paths
    from tasks.params import load_params

    params = load_params(root / paths.PARAMS)
    if chosen is not None:
        params.model(chosen)  # an unknown model stops here, naming the known ones
        return [chosen]
    return list(params.models)


def cmd_build(args: argparse.Namespace) -> int:
    from flows.dvc import build_lock
    from flows.preflight import before_build, measurements_kept, tidy
    from flows.progress import reproduce_with_progress

    models = _models(args.root, args.model)
    targets = [f"report@{model}" for model in models] if args.model else None
    with build_lock(args.root, wait=not args.no_wait, say=lambda line: print(line, file=sys.stderr)):
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

    _models(args.root, None)  # the params check, before DVC's templating meets a bad file

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

    models = _models(args.root, args.model)
    with build_lock(args.root, wait=not args.no_wait, say=lambda line: print(line, file=sys.stderr)):
        before_build(args.root)
        try:
            with measurements_kept(args.root):
                for model in models:
                    # Forced: the point is a fresh measurement on this machine, not DVC's cached figures.
                    reproduce_with_progress(args.root, [f"bench@{model}-*"], "--force", "--single-item", "--glob")
                    reproduce_with_progress(args.root, [f"report@{model}"])
        finally:
            tidy(args.root)
    return cmd_report(args)


def cmd_report(args: argparse.Namespace) -> int:
    from tasks import paths

    for model in _models(args.root, args.model):
        table = args.root / paths.report_md(model)
        if not table.is_file():
            raise CliError(f"{table} does not exist yet; run `ortforge build --model {model}` first")
        print(table.read_text(encoding="utf-8"))
        print(f"plots and table in one offline page: {args.root / paths.report_html(model)}\n")
    return 0


def _variant_to_run(root: Path, model: str, variant: str | None) -> Path:
    from ortforge.manifest import check_validated
    from tasks import paths
    from tasks.files import read_json

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
    try:
        check_validated(folder)  # never run an artifact that failed validation or changed since
    except ValueError as error:
        raise CliError(
            f"{error}; run `ortforge build --model {model}` to validate it, or pick a validated variant with --variant"
        ) from None
    return folder


def cmd_generate(args: argparse.Namespace) -> int:
    from ortforge.generate import TextGenerator

    _models(args.root, args.model)
    folder = _variant_to_run(args.root, args.model, args.variant)
    prompt = _stdin_text() if args.prompt == "-" else _argument_text(args.prompt)
    print(f"[{args.model}/{folder.name}]", file=sys.stderr)
    for piece in TextGenerator(folder, prompt_lookup=args.prompt_lookup).stream(prompt, args.max_new_tokens):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ortforge.doctor import report

    for line in report(args.root):
        print(line)
    return 0


def _expected_errors() -> tuple[type[BaseException], ...]:
    from flows.dvc import BuildBusy, DvcFailed
    from tasks.errors import StageError

    # ValueError: the runtime's refusals (an unvalidated or changed artifact, weights outside it).
    return (CliError, StageError, DvcFailed, BuildBusy, ValueError)


def parser() -> argparse.ArgumentParser:
    top = OneLineParser(prog="ortforge", description=__doc__.splitlines()[0])
    top.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: .)")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    for name, handler, help_text in (
        ("build", cmd_build, "reproduce the DAG for every model, or one"),
        ("bench", cmd_bench, "measure every variant again on this machine, then report"),
    ):
        sub = command(name, handler, help_text)
        sub.add_argument("--model", help="only this model from params.yaml")
        sub.add_argument("--no-wait", action="store_true", help="stop instead of waiting when another build runs")
    sub = command("report", cmd_report, "print the results table of every model, or one")
    sub.add_argument("--model", help="only this model from params.yaml")
    command("status", cmd_status, "what is stale and why, from DVC")
    sub = command("generate", cmd_generate, "stream a greedy continuation of a prompt")
    sub.add_argument("model", help="a model from params.yaml")
    sub.add_argument("prompt", help="the prompt text, or - to read it from stdin (UTF-8)")
    sub.add_argument("--variant", help="default: the variant the report recommends")
    sub.add_argument("--max-new-tokens", type=_positive, default=64, metavar="N")
    sub.add_argument(
        "--prompt-lookup",
        type=int,
        default=0,
        metavar="N",
        help="check up to N draft tokens looked up in the text per step: faster where the text repeats",
    )
    command("doctor", cmd_doctor, "versions, CPU features, threads, free disk and memory")
    return top


def main(argv: list[str] | None = None) -> int:
    _utf8_streams()
    args = parser().parse_args(argv)
    args.root = args.root.resolve()
    try:
        if args.handler is not cmd_doctor and not (args.root / "params.yaml").is_file():
            raise CliError(f"{args.root} has no params.yaml; run ortforge in the repository root or pass --root")
        return args.handler(args)
    except _expected_errors() as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted; outputs are written atomically, so run the command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

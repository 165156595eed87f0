"""The `ortforge` command. The runtime brings one command, and the build side (`pip install
'ortforge[build]'`, or this repository's scripts/install.sh) adds its own through the
`ortforge.commands` entry points, so an install of the runtime alone stays small:

    ortforge generate TARGET "prompt"  stream tokens from a validated variant (TARGET: its folder,
                                       or with the build side a model of params.yaml)
    ortforge build / status / bench / report / doctor     with the build side (flows/commands.py)

Heavy libraries load inside the commands that need them, so `--help` answers at once. Every
expected failure is one line, `error: ...`, naming the bad value and the fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path

EXIT_USAGE = 2
# Entry points the build side provides: modules with add_commands(subparsers) and
# expected_errors(), and functions (root, model, variant) -> the folder of a model's variant.
COMMANDS = "ortforge.commands"
RESOLVERS = "ortforge.resolvers"


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


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of tokens; ask for at least 1")
    return value


def _argument_text(value: str) -> str:
    """A command-line argument as the UTF-8 the user typed (a C locale decodes argv as ASCII)."""
    return os.fsencode(value).decode("utf-8", errors="replace")


def _plugins(group: str) -> list:
    return [entry.load() for entry in importlib.metadata.entry_points(group=group)]


def artifact_folder(root: Path, target: str, variant: str | None) -> Path:
    """TARGET as an artifact folder: itself, or (with the build side) a model's chosen variant."""
    folder = Path(target)
    if (folder / "model.onnx").is_file():
        if variant is not None:
            raise CliError(f"{target} is an artifact folder already; drop --variant {variant}")
        return folder
    resolvers = _plugins(RESOLVERS)
    if not resolvers:
        raise CliError(
            f"{target} is not an artifact folder (no model.onnx); give a built variant's folder, or install the "
            f"build side (pip install 'ortforge[build]') to name a model of params.yaml"
        )
    return resolvers[0](root, target, variant)


def _shown(folder: Path) -> str:
    """The folder as the user would type it: relative to the working directory when inside it."""
    resolved = folder.resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else str(folder)


def cmd_generate(args: argparse.Namespace) -> int:
    from ortforge.generate import TextGenerator
    from ortforge.manifest import check_validated

    folder = artifact_folder(args.root, args.target, args.variant)
    try:
        check_validated(folder)  # never run an artifact that failed validation or changed since
    except ValueError as error:
        raise CliError(f"{error}; build and validate it (`ortforge build`), or pick a validated variant") from None
    prompt = _stdin_text() if args.prompt == "-" else _argument_text(args.prompt)
    print(f"[{_shown(folder)}]", file=sys.stderr)
    for piece in TextGenerator(folder, prompt_lookup=args.prompt_lookup).stream(prompt, args.max_new_tokens):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def expected_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: one line each. ValueError: the runtime's refusals
    (an unvalidated or changed artifact, weights outside it, a prompt past the context)."""
    errors = [CliError, ValueError]
    for plugin in _plugins(COMMANDS):
        errors += plugin.expected_errors()
    return tuple(errors)


def parser() -> argparse.ArgumentParser:
    top = OneLineParser(prog="ortforge", description=__doc__.splitlines()[0])
    top.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: .)")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    help_text = "stream a greedy continuation of a prompt from a validated variant"
    sub = commands.add_parser("generate", help=help_text, description=help_text)
    sub.set_defaults(handler=cmd_generate)
    sub.add_argument("target", help="a variant's folder, or (with the build side) a model of params.yaml")
    sub.add_argument("prompt", help="the prompt text, or - to read it from stdin (UTF-8)")
    sub.add_argument("--variant", help="with a model: default, the variant its report recommends")
    sub.add_argument("--max-new-tokens", type=positive, default=64, metavar="N")
    sub.add_argument(
        "--prompt-lookup",
        type=int,
        default=0,
        metavar="N",
        help="check up to N draft tokens looked up in the text per step: faster where the text repeats",
    )
    for plugin in _plugins(COMMANDS):
        plugin.add_commands(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    _utf8_streams()
    args = parser().parse_args(argv)
    args.root = args.root.resolve()
    try:
        return args.handler(args)
    except expected_errors() as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted; outputs are written atomically, so run the command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

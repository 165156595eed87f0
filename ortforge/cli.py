"""The `ortforge` command. The runtime brings one command, and the build side (`pip install
'ortforge[build]'`, or this repository's scripts/install.sh) adds its own through the
`ortforge.commands` entry points, so an install of the runtime alone stays small:

    ortforge generate TARGET "prompt"  stream tokens from a validated variant (TARGET: its folder,
                                       or with the build side a model of params.yaml); greedy, or
                                       sampled (--temperature, --top-k, --top-p, --seed), --stop
                                       TEXT; through the model's chat template when it has one
                                       (--raw: the prompt as plain text to continue)
    ortforge serve TARGET              an OpenAI-compatible server (the serve extra), batching
                                       concurrent requests
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
API_KEY_VARIABLE = "ORTFORGE_API_KEY"
MAX_QUEUE = 4096  # waiting requests hold their prompts in memory; past this, 429 is kinder
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


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; give 1-65535 (0: any free port)")
    return value


def queue_size(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_QUEUE:
        raise argparse.ArgumentTypeError(f"{value} waiting requests: give 0-{MAX_QUEUE}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0")
    return value


def megabytes(text: str) -> float:
    value = float(text)
    if not value >= 0.001:
        raise argparse.ArgumentTypeError(f"{text} MB would refuse every request; give at least 0.001")
    return value


def kv_megabytes(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} MB holds no KV cache; give a budget above 0")
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

    folder = _validated_folder(args)
    prompt = _stdin_text() if args.prompt == "-" else _argument_text(args.prompt)
    chat = _chat_mode(args, folder)
    sampling, messages = _sampling(args), _messages(args, prompt, chat)  # bad options stop before the model loads
    generator = TextGenerator(folder, prompt_lookup=args.prompt_lookup)
    if chat:
        pieces = generator.chat(messages, args.max_new_tokens, sampling, args.stop)
    else:
        pieces = generator.stream(prompt, args.max_new_tokens, sampling, args.stop)
    said = "; the prompt is a user message through its chat template (--raw: plain text)" if chat else ""
    print(f"[{_shown(folder)}{said}]", file=sys.stderr)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _chat_mode(args: argparse.Namespace, folder: Path) -> bool:
    """Whether the prompt goes through the chat template: by default when the model has one (an
    instruct model answers a bare question with end-of-text at once, as llama.cpp's CLI knows);
    --raw continues the text; --chat insists on a template."""
    from ortforge.chat import chat_template

    if args.chat and args.raw:
        raise CliError("--chat and --raw contradict each other; drop one")
    if args.raw:
        return False
    try:
        chat_template(folder)
    except ValueError:
        if args.chat:
            raise CliError(f"{_shown(folder)} has no chat template; drop --chat to continue the text") from None
        return False  # a base model: continue the text
    return True


def _validated_folder(args: argparse.Namespace) -> Path:
    from ortforge.manifest import check_validated

    folder = artifact_folder(args.root, args.target, args.variant)
    try:
        check_validated(folder)  # never run an artifact that failed validation or changed since
    except ValueError as error:
        raise CliError(f"{error}; build and validate it (`ortforge build`), or pick a validated variant") from None
    return folder


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from ortforge import server
    except ImportError as error:
        missing = f"ortforge serve needs the serve extra ({error.name} is missing)"
        raise CliError(f"{missing}: pip install 'ortforge[serve]'") from None
    folder = _validated_folder(args)
    body = int(args.max_body_mb * 1e6) if args.max_body_mb is not None else None  # None: sized by the context
    limits = server.Limits(max_body_bytes=body, shutdown_timeout=args.shutdown_timeout)
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    server.serve(
        folder,
        args.host,
        args.port,
        args.slots,
        args.queue,
        args.prefix_cache_mb,
        api_key,
        args.insecure,
        limits,
        args.kv_cache_mb,
    )
    return 0


def expected_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: one line each. ValueError: the runtime's refusals
    (an unvalidated or changed artifact, weights outside it, a prompt past the context)."""
    errors = [CliError, ValueError]
    for plugin in _plugins(COMMANDS):
        errors += plugin.expected_errors()
    return tuple(errors)


def _sampling_arguments(sub: argparse.ArgumentParser) -> None:
    group = sub.add_argument_group("sampling and chat (default: greedy, through the model's chat template if any)")
    group.add_argument("--temperature", type=float, default=0.0, help="above 0 samples; 0 (default) is greedy")
    group.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely tokens")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P", help="sample within probability mass P")
    group.add_argument("--seed", type=int, help="the random seed: the same seed gives the same text")
    group.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R", help="above 1 penalizes repeats")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before TEXT (repeatable)")
    group.add_argument("--chat", action="store_true", help="require the chat template (the default when there is one)")
    group.add_argument("--raw", action="store_true", help="the prompt as plain text to continue, no chat template")
    group.add_argument("--system", metavar="TEXT", help="in chat: a system message before the prompt")


def _target_arguments(sub: argparse.ArgumentParser) -> None:
    """What to run: an artifact folder, or a model of params.yaml and (optionally) its variant."""
    sub.add_argument("target", help="a variant's folder, or (with the build side) a model of params.yaml")
    sub.add_argument("--variant", help="with a model: default, the variant its report recommends")


def _serve_command(commands) -> None:
    help_text = "serve a validated variant over an OpenAI-compatible HTTP API, batching concurrent requests"
    sub = commands.add_parser("serve", help=help_text, description=help_text)
    sub.set_defaults(handler=cmd_serve)
    _target_arguments(sub)
    sub.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    sub.add_argument("--port", type=port, default=8000, help="default 8000; 0: any free port (printed once bound)")
    sub.add_argument("--slots", type=positive, default=4, help="sequences decoded together (default 4)")
    sub.add_argument(
        "--queue", type=queue_size, default=16, help="requests that may wait for a slot before 429 (default 16)"
    )
    sub.add_argument(
        "--api-key",
        help=f"require Authorization: Bearer KEY on every route but /health (or set {API_KEY_VARIABLE}); "
        "needed to bind beyond loopback",
    )
    sub.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    sub.add_argument(
        "--max-body-mb",
        type=megabytes,
        metavar="MB",
        help="largest request body (default: room for the model's context, at least 1 MB; 413 past it)",
    )
    sub.add_argument(
        "--shutdown-timeout",
        type=non_negative,
        default=30,
        metavar="S",
        help="on SIGTERM, seconds running requests get to finish before they end with an error (default 30)",
    )
    sub.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=128,
        metavar="MB",
        help="memory for reusing shared prompt starts, least recently used evicted (default 128; 0: off)",
    )
    sub.add_argument(
        "--kv-cache-mb",
        type=kv_megabytes,
        metavar="MB",
        help="the KV cache's memory budget: a request reserves its prompt + max_tokens and waits while the "
        "budget is full (default: every slot's whole context, within a quarter of this machine's memory)",
    )


def _sampling(args: argparse.Namespace):
    from ortforge.sampling import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)


def _messages(args: argparse.Namespace, prompt: str, chat: bool) -> list[dict]:
    if args.system is not None and not chat:
        why = "drop --raw" if args.raw else "this model has no chat template"
        raise CliError(f"--system applies to chat; {why}")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [*system, {"role": "user", "content": prompt}]


def parser() -> argparse.ArgumentParser:
    top = OneLineParser(prog="ortforge", description=__doc__.splitlines()[0])
    top.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: .)")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    help_text = "stream a continuation of a prompt (greedy unless --temperature) from a validated variant"
    sub = commands.add_parser("generate", help=help_text, description=help_text)
    sub.set_defaults(handler=cmd_generate)
    _target_arguments(sub)
    sub.add_argument("prompt", help="the prompt text, or - to read it from stdin (UTF-8)")
    sub.add_argument("--max-new-tokens", type=positive, default=64, metavar="N")
    sub.add_argument(
        "--prompt-lookup",
        type=int,
        default=0,
        metavar="N",
        help="check up to N draft tokens looked up in the text per step: faster where the text repeats",
    )
    _sampling_arguments(sub)
    _serve_command(commands)
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

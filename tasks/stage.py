"""What every stage entry point shares: one-line errors for users, logging, and the exit code."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

log = logging.getLogger("ortforge")


class StageError(Exception):
    """A problem the user can fix; its message names the bad value and the fix."""


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def stage_main(
    parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace], object], argv: Sequence[str] | None
) -> int:
    """Parse argv, run body, and turn a StageError into one line on stderr and exit status 2."""
    args = parser.parse_args(argv)
    configure_logging()
    try:
        body(args)
    except StageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def model_parser(description: str, *, variant: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    parser.add_argument("--model", required=True, help="a model name from params.yaml `models`")
    if variant:
        parser.add_argument("--variant", required=True, help="a variant name from params.yaml `quantize`")
    return parser

"""What every stage entry point shares: the command line (model, variant, and input/output paths
that default to tasks/core/paths.py), params loading, logging, and one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.errors import StageError
from tasks.core.lifetime import die_with_parent

if TYPE_CHECKING:
    from tasks.core.params import Params

__all__ = ["StageError", "StageArgs", "stage_cli"]

# Path flags a stage writes; every other path flag is an input.
OUTPUT_FLAGS = ("out", "report", "runtime", "md", "png", "html", "json")


@dataclass(frozen=True)
class StageArgs:
    params: Params
    model: str
    variant: str | None
    paths: dict[str, Path]
    pins_file: Path  # versions.yaml beside the params file


def _default_path(path_of: Callable[..., Path], model: str, variant: str | None) -> Path:
    takes_variant = len(inspect.signature(path_of).parameters) == 2
    return path_of(model, variant) if takes_variant else path_of(model)


def stage_cli(
    stage: str,
    doc: str,
    path_flags: dict[str, Callable[..., Path]],
    body: Callable[[StageArgs], object],
    argv: Sequence[str] | None = None,
    *,
    variant: bool = False,
) -> int:
    """Parse argv, check params and tool versions, run body; a StageError becomes one line, exit 2.

    path_flags maps each flag name (without dashes) to the tasks.core.paths function giving its default.
    The tool versions are checked against versions.yaml beside the params file.
    """
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    parser.add_argument("--model", required=True, help="a model name from params.yaml `models`")
    if variant:
        parser.add_argument("--variant", required=True, help="a variant the model builds (params.yaml `builds`)")
    for flag, path_of in path_flags.items():
        shown = _default_path(path_of, "<model>", "<variant>")
        parser.add_argument(f"--{flag}", type=Path, dest=flag.replace("-", "_"), help=f"default: {shown}")
    args = parser.parse_args(argv)
    if argv is None:  # run as a command (by DVC): end with the process that started it
        die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        from tasks.core.params import load_params
        from tasks.core.versions import PINS_FILE, check_installed

        params = load_params(args.params)
        pins_file = Path(args.params).parent / PINS_FILE.name
        check_installed(stage, pins_file)
        params.model(args.model)
        chosen_variant = None
        if variant:
            params.build(args.model, args.variant)  # an unknown variant or build stops here, naming the known ones
            chosen_variant = args.variant
        resolved = {
            flag: getattr(args, flag.replace("-", "_")) or _default_path(path_of, args.model, chosen_variant)
            for flag, path_of in path_flags.items()
        }
        preflight(stage, resolved)
        body(StageArgs(params, args.model, chosen_variant, resolved, pins_file))
    except StageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def preflight(stage: str, paths: dict[str, Path]) -> None:
    """Before heavy work: every output can be written, and disk and memory hold the estimate."""
    from tasks.core import resources

    outputs = [paths[flag] for flag in OUTPUT_FLAGS if flag in paths]
    for output in outputs:
        resources.check_writable(output)
    needs = resources.STAGE_NEEDS.get(stage)
    if needs is not None:
        resources.check_room(stage, needs, paths[needs.input_flag], outputs[0])

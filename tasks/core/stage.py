"""What every stage entry point shares: the command line (model, variant, and input/output paths
that default to tasks/core/paths.py), params loading, logging, and one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.errors import StageError
from tasks.core.lifetime import die_with_parent, running_as_stage_command

if TYPE_CHECKING:
    from tasks.core.params import Params
    from tasks.core.resources import Needs

# A stage run by DVC ends with the `dvc repro` that started it. Asked for while the stage module is
# still importing, before its heavy imports (numba, onnx, torch): a build killed during them would
# otherwise orphan the stage before it asked, and it would run on (tests/test_faults.py).
if running_as_stage_command():
    die_with_parent()

__all__ = ["StageError", "StageArgs", "stage_cli"]

COSTS_ENV = "ORTFORGE_STAGE_COSTS"  # a file each stage appends its wall time and peak memory to
# Path flags a stage writes; every other path flag is an input.
OUTPUT_FLAGS = ("out", "report", "runtime", "md", "png", "html", "json")


@dataclass(frozen=True)
class StageArgs:
    params: Params
    model: str
    variant: str | None
    paths: dict[str, Path]
    pins_file: Path  # versions.yaml beside the params file

    def name(self, stage: str) -> str:
        """The stage as DVC names it: export@<model>, quantize@<model>-<variant>."""
        return f"{stage}@{self.model}" + (f"-{self.variant}" if self.variant else "")


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
    needs: Callable[[StageArgs], Needs] | None = None,
) -> int:
    """Parse argv, check params and tool versions, run body; a StageError becomes one line, exit 2.

    path_flags maps each flag name (without dashes) to the tasks.core.paths function giving its default.
    The tool versions are checked against versions.yaml beside the params file. needs gives the
    stage's memory and disk estimate, checked before body runs.
    """
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    parser.add_argument("--model", required=True, help="a model name from params.yaml `models`")
    if variant:
        parser.add_argument("--variant", required=True, help="a variant the model builds (params.yaml `builds`)")
    for flag, path_of in path_flags.items():
        shown = _default_path(path_of, "<model>", "<variant>")
        parser.add_argument(f"--{flag}", type=Path, dest=flag.replace("-", "_"), help=f"default: {shown}")
    args = parser.parse_args(argv)  # run as a command, this process asked to end with DVC at import
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
        stage_args = StageArgs(params, args.model, chosen_variant, resolved, pins_file)
        estimate = needs(stage_args) if needs else None
        preflight(stage_args.name(stage), resolved, estimate)
        started = time.perf_counter()
        body(stage_args)
        record_cost(stage_args.name(stage), time.perf_counter() - started, estimate)
    except StageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def record_cost(stage: str, seconds: float, estimate: Needs | None) -> None:
    """Log what the stage took (wall time, the peak resident memory of it and its children), and
    append it as a JSON line to $ORTFORGE_STAGE_COSTS when set (benchmarks/scale.py reads them)."""
    import json
    import resource

    peak = 1024 * max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    logging.getLogger(__name__).info("%s took %.0f s, peak memory %.2f GB", stage, seconds, peak / 1e9)
    if os.environ.get(COSTS_ENV):
        record = {"stage": stage, "seconds": round(seconds, 2), "peak_rss_bytes": peak}
        if estimate is not None:
            record |= {"estimated_memory_bytes": int(estimate.memory), "estimated_disk_bytes": int(estimate.disk)}
        with open(os.environ[COSTS_ENV], "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def preflight(stage: str, paths: dict[str, Path], needs: Needs | None) -> None:
    """Before heavy work: every output can be written, and disk and memory hold the estimate."""
    from tasks.core import resources

    outputs = [paths[flag] for flag in OUTPUT_FLAGS if flag in paths]
    for output in outputs:
        resources.check_writable(output)
    if needs is not None:
        resources.check(stage, needs, outputs[0])

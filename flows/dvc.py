"""Running DVC for the flows: a subprocess in the repository root, so a flow can drive a repository
other than its own working directory (DVC resolves stage paths against the current directory), and
a Dask or Prefect worker needs nothing but the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

STAGE_STARTED = re.compile(r"Running stage '([^']+)'")


class DvcFailed(RuntimeError):
    pass


def dvc(root: Path, *args: str, echo: bool = True) -> str:
    """Run `dvc args...` in root, echoing its output line by line; return the output."""
    lines: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-m", "dvc", *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    ) as process:
        for line in process.stdout:
            if echo:
                print(line.rstrip())
            lines.append(line.rstrip())
    if process.returncode != 0:
        errors = [line for line in lines[-20:] if "error" in line.lower()] or lines[-3:]
        raise DvcFailed(f"`dvc {' '.join(args)}` failed in {root}: {' | '.join(errors)}")
    return "\n".join(lines)


def reproduce(root: Path, targets: list[str] | None = None) -> list[str]:
    """`dvc repro`; returns the stages whose commands actually executed."""
    return STAGE_STARTED.findall(dvc(root, "repro", *(targets or [])))

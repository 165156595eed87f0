"""Running DVC for the flows: a subprocess in the repository root, so a flow can drive a repository
other than its own working directory (DVC resolves stage paths against the current directory), and
a Dask or Prefect worker needs nothing but the repository."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tasks.core.lifetime import BUILD_PID_ENV, die_with_parent

STAGE_STARTED = re.compile(r"Running stage '([^']+)'")
# What DVC prints when another DVC process holds the repository or a stage's outputs.
DVC_LOCKED = ("is busy, it is being blocked by", "Unable to acquire lock")
BUILD_LOCK = Path(".dvc/tmp/ortforge-build.lock")


class DvcFailed(RuntimeError):
    pass


class BuildBusy(RuntimeError):
    pass


# The build lock's file descriptor while this process holds it: DVC children inherit it, so the
# lock is held while any of them runs, also after the build that started them was killed.
_held_lock_fd: int | None = None


@contextlib.contextmanager
def build_lock(root: Path, wait: bool = True, say: Callable[[str], object] = print) -> Iterator[None]:
    """Hold this repository's build lock: a second build waits for the first (or, with wait=False,
    stops with BuildBusy), instead of racing it for DVC's locks halfway through. The kernel drops
    the lock when the last process holding it ends: a killed build whose `dvc repro` still runs
    keeps it until that ends, and a build whose processes all died never blocks the next one."""
    global _held_lock_fd
    path = Path(root) / BUILD_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text(encoding="utf-8").strip() or "another process"
            if not wait:
                raise BuildBusy(f"another build ({holder}) is running in {root}; wait for it to finish") from None
            say(f"waiting for another build ({holder}) in {root} to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        _held_lock_fd = handle.fileno()
        try:
            yield
        finally:
            _held_lock_fd = None
            fcntl.flock(handle, fcntl.LOCK_UN)


def dvc(root: Path, *args: str, echo: bool | Callable[[str], object] = True) -> str:
    """Run `dvc args...` in root, passing its output line by line to echo (print when True); return it."""
    say = print if echo is True else echo or None
    lines: list[str] = []
    # DVC runs each stage's `python -m tasks...` through PATH: put this interpreter first, so an
    # unactivated `.venv/bin/ortforge build` runs the stages with the venv's Python too.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    with subprocess.Popen(
        [sys.executable, "-m", "dvc", *args],
        cwd=root,
        env={**os.environ, "PATH": path, BUILD_PID_ENV: str(os.getpid())},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
        pass_fds=(_held_lock_fd,) if _held_lock_fd is not None else (),
        preexec_fn=die_with_parent,  # a killed build takes its dvc repro (and, through it, the stage) along
    ) as process:
        for line in process.stdout:
            if say:
                say(line.rstrip())
            lines.append(line.rstrip())
    if process.returncode != 0:
        errors = [line for line in lines[-20:] if "error" in line.lower()] or lines[-3:]
        if any(marker in line for line in errors for marker in DVC_LOCKED):
            errors.insert(0, "another DVC process is working in this repository; wait for it to finish, then retry")
        raise DvcFailed(f"`dvc {' '.join(args)}` failed in {root}: {' | '.join(errors)}")
    return "\n".join(lines)


def reproduce(
    root: Path, targets: list[str] | None = None, *options: str, echo: bool | Callable[[str], object] = True
) -> list[str]:
    """`dvc repro [options] [targets]`; returns the stages whose commands actually executed."""
    return STAGE_STARTED.findall(dvc(root, "repro", *options, *(targets or []), echo=echo))


def metrics_diff(root: Path) -> str:
    """`dvc metrics diff` of the workspace against the last commit, as markdown ("" when none)."""
    try:
        return dvc(root, "metrics", "diff", "--md", "HEAD", echo=False).strip()
    except DvcFailed:  # no commit yet to compare with
        return ""


def planned_stages(root: Path, targets: list[str] | None = None, *options: str) -> list[str]:
    """The stages `dvc repro [options]` would run now, in order (a dry run: nothing executes)."""
    return reproduce(root, targets, "--dry", *options, echo=False)


def stale_reasons(root: Path, targets: list[str] | None = None) -> dict[str, list[str]]:
    """Why each stale stage would rerun, from `dvc status`: its changed deps, params and outputs."""
    status = json.loads(dvc(root, "status", "--json", *(targets or []), echo=False) or "{}")
    reasons: dict[str, list[str]] = {}
    for stage, entries in status.items():
        for entry in entries:
            if isinstance(entry, str):
                reasons.setdefault(stage, []).append(entry)
                continue
            for kind, changed in entry.items():
                for path, change in changed.items():
                    what = ", ".join(change) if isinstance(change, dict) else change
                    reasons.setdefault(stage, []).append(f"{kind}: {path} ({what})")
    return reasons

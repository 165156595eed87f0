"""A process that ends with its parent: killing `ortforge build` (even with SIGKILL) must not leave
its `dvc repro` running, nor a stage that `dvc repro` started, beside the next build.

Linux's PR_SET_PDEATHSIG has the kernel signal a process when its parent dies; elsewhere this is a
no-op (the build lock then follows the child instead: flows/dvc.py passes it on)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


# Set by `ortforge build` for the `dvc repro` it starts, and so for every stage DVC runs.
BUILD_PID_ENV = "ORTFORGE_BUILD_PID"


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send signum to this process when its parent ends (call it in the child).

    A stage asks only once its interpreter is up: when the build was killed before that, its dvc
    repro went at once and the stage, already handed to init, would run on; so it also ends when
    the build that started it (BUILD_PID_ENV) is gone."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent or not _running(os.environ.get(BUILD_PID_ENV)):
        os.kill(os.getpid(), signum)


def _running(pid: str | None) -> bool:
    """Whether process pid runs (a zombie does not); True when no pid is given."""
    if not pid:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def running_as_stage_command() -> bool:
    """Whether this interpreter runs a stage module as `python -m tasks.<stage>` (DVC's commands)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name.startswith("tasks.")

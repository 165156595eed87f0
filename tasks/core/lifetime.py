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


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send signum to this process when its parent ends (call it in the child)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signum)

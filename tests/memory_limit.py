"""Run a command under a hard memory limit: a memory cgroup of its own (v1 or v2) where this
process may create one (root on Linux, as CI runs), else RLIMIT_DATA (private writable memory).
The cgroup also reports the peak the command reached."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Limited:
    how: str  # "cgroup v1", "cgroup v2" or "RLIMIT_DATA"
    folder: Path | None
    limit: int

    def peak(self) -> int | None:
        """The cgroup's peak usage (page cache included), or None under RLIMIT_DATA."""
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            if self.folder is not None and (self.folder / name).is_file():
                return int((self.folder / name).read_text())
        return None

    def run(self, command: list[str], **options) -> subprocess.CompletedProcess:
        def enter() -> None:
            if self.folder is None:
                resource.setrlimit(resource.RLIMIT_DATA, (self.limit, self.limit))
            else:
                (self.folder / "cgroup.procs").write_text(str(os.getpid()))

        return subprocess.run(command, preexec_fn=enter, **options)


def _own_cgroup() -> tuple[str, Path, dict[str, str]] | None:
    """(kind, the folder of this process's memory cgroup, its file names), where one is mounted."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return "cgroup v1", folder, {"limit": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes"}
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            return "cgroup v2", folder, {"limit": "memory.max", "swap": "memory.swap.max"}
    return None


@contextlib.contextmanager
def memory_limit(limit: int) -> Iterator[Limited]:
    found = _own_cgroup()
    child = None
    if found is not None:
        how, parent, files = found
        child = parent / f"ortforge-test-{os.getpid()}"
        try:
            child.mkdir()
            (child / files["limit"]).write_text(str(limit))
        except OSError:  # not root, or a read-only cgroup file system
            with contextlib.suppress(OSError):
                child.rmdir()
            child = None
        else:
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                (child / files["swap"]).write_text(str(limit) if how == "cgroup v1" else "0")
    try:
        yield Limited(how if child is not None else "RLIMIT_DATA", child, limit)
    finally:
        if child is not None:
            with contextlib.suppress(OSError):
                child.rmdir()

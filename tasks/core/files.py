"""Writing outputs so that nothing half-written is ever left where an output belongs: each output
is built under a temporary sibling and renamed into place only when complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def _temporary_sibling(path: Path) -> Path:
    # A sibling keeps the rename on one file system, so it is atomic. The pid in the name tells a
    # later run whether its writer is still alive (see remove_abandoned_temporaries).
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_abandoned_temporaries(path: Path) -> list[Path]:
    """Delete temporaries of path left by writers that died (SIGKILL, power loss) before renaming.

    A temporary whose writer still runs is left alone: it may be another build of the same output.
    """
    removed = []
    for tmp in Path(path).parent.glob(f".{Path(path).name}.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def remove_abandoned_under(root: Path) -> list[Path]:
    """Temporaries of dead writers anywhere under root: DVC can restore an output from its run
    cache without running the stage that would have removed them."""
    removed = []
    for tmp in sorted(Path(root).rglob(".*.tmp-*")):
        if tmp.exists():
            output = tmp.with_name(tmp.name[1:].rsplit(".tmp-", 1)[0])
            removed += [found for found in remove_abandoned_temporaries(output) if found == tmp]
    return removed


@contextlib.contextmanager
def atomic_output_dir(out_dir: Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces out_dir, on failure it is removed."""
    out_dir = Path(out_dir)
    first_created = _first_missing_ancestor(out_dir.parent)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temporaries(out_dir)
    tmp = _temporary_sibling(out_dir)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty_parents(out_dir.parent, first_created)
        raise
    if out_dir.exists():
        old = _temporary_sibling(out_dir)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)


@contextlib.contextmanager
def scratch_dir(beside: Path) -> Iterator[Path]:
    """A temporary folder next to `beside` (same file system), removed on exit; named like an
    output's temporary, so a run after a killed one removes it too (remove_abandoned_temporaries)."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temporaries(beside)
    tmp = _temporary_sibling(beside)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _first_missing_ancestor(folder: Path) -> Path | None:
    missing = None
    while not folder.exists():
        missing, folder = folder, folder.parent
    return missing


def _remove_empty_parents(folder: Path, stop: Path | None) -> None:
    """Remove the folders this module created on the way to folder, if nothing else landed there."""
    if stop is None:
        return
    for current in (folder, *folder.parents):
        if not current.exists() or any(current.iterdir()):
            return
        current.rmdir()
        if current == stop:
            return


def atomic_write_text(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temporaries(path)
    tmp = _temporary_sibling(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: Path, data: dict) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def link_or_copy(source: Path, target: Path) -> Path:
    """A hard link to source at target (no second copy of a large file), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
    return target


def folder_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob(pattern) if p.is_file())


def megabytes(num_bytes: int) -> float:
    return round(num_bytes / 1e6, 2)

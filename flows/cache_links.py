"""Workspace files that are hard links to DVC's cache, made safe against in-place writes.

With `cache.type` hardlink (.dvc/config), a multi-GB output is one file on disk, not a copy in the
workspace and another in .dvc/cache. The price: a program that rewrites such a file in place
(opens it for writing, as onnx.save does, rather than writing a new file and renaming it, as every
stage here does) changes the cache object too. DVC marks linked files read-only, which does not
stop root, and DVC would then hand the wrong bytes to the next checkout, or push them, under the
old hash; a rebuilt output with that hash would even be linked back to the damaged object.

So before a build (and before the scheduled flow pushes), the outputs DVC reports modified are
looked at: each of their files that shares its inode with a cache object is hashed, and an object
whose bytes no longer match its name (its md5) is removed from the cache together with the
workspace file, with one line saying so. DVC then runs the stage again and caches a true copy. DVC
notices the modification itself (its state records each file's inode, size and modification
time), so an untouched workspace costs one `dvc status` and no hashing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

CHUNK = 1 << 24


def cache_folder(repo) -> Path:
    return Path(repo.cache.local.path)


def modified_outputs(repo) -> list[Path]:
    """The outputs `dvc status` reports modified, as absolute paths."""
    root = Path(repo.root_dir)
    found = []
    for entries in repo.status().values():
        for entry in entries:
            if isinstance(entry, dict):
                found += [root / path for path, change in entry.get("changed outs", {}).items() if change == "modified"]
    return found


def object_hash(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def expected_hash(relative: str) -> str:
    """An object's md5 from its path in the cache (ab/cdef...; a directory listing ends in .dir)."""
    return relative.replace("/", "").removesuffix(".dir")


def disk_bytes(*paths: Path) -> int:
    """Bytes on disk under paths, a file with several links counted once."""
    seen, total = set(), 0
    for root in paths:
        for path in [root] if root.is_file() else root.rglob("*"):
            info = path.lstat()
            if path.is_file() and info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_blocks * 512
    return total


def linked_files(output: Path) -> list[Path]:
    """The output's files with a second link (possibly to a cache object)."""
    files = [output] if output.is_file() else [p for p in output.rglob("*") if p.is_file()]
    return [path for path in files if path.stat().st_nlink > 1]


def written_in_place(repo) -> list[tuple[Path, Path]]:
    """(workspace file, cache object) pairs that are one file whose bytes no longer match the object's name."""
    cache = cache_folder(repo)
    candidates = {path.stat().st_ino: path for output in modified_outputs(repo) for path in linked_files(output)}
    if not candidates:
        return []
    damaged = []
    for obj in cache.rglob("*"):
        if obj.is_file() and obj.stat().st_ino in candidates:
            if object_hash(obj) != expected_hash(obj.relative_to(cache).as_posix()):
                damaged.append((candidates[obj.stat().st_ino], obj))
    return damaged


def remove_damaged(root: Path, say: Callable[[str], object]) -> list[Path]:
    """Remove every cache object written in place through a workspace link, and that file; say one
    line each. Returns the workspace files removed."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        damaged = written_in_place(repo)
    for workspace_file, obj in damaged:
        obj.unlink()
        workspace_file.unlink()
        say(
            f"warning: {workspace_file.relative_to(Path(root).resolve())} was changed in place, and with it the DVC "
            f"cache's copy (a hard link); both are removed, so the stage that writes it runs again"
        )
    return [workspace_file for workspace_file, _ in damaged]

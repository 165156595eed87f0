"""An artifact's manifest: where it came from, how it was built, and the sha256 of every file, so
a copy can be checked before it is trusted."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ortforge.names import MANIFEST_FILE

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(folder: Path) -> dict[str, dict]:
    """sha256 and size of every file under folder except the manifest itself, by relative path."""
    folder = Path(folder)
    return {
        path.relative_to(folder).as_posix(): {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }


def write_manifest(folder: Path, record: dict) -> Path:
    """Write manifest.json holding record plus the hashes of the folder's files."""
    path = Path(folder) / MANIFEST_FILE
    body = {**record, "files": file_records(folder)}
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST_FILE).read_text(encoding="utf-8"))


def mismatched_files(folder: Path) -> list[str]:
    """Files whose content differs from the manifest, or that are missing or extra."""
    recorded = read_manifest(folder)["files"]
    actual = file_records(folder)
    return sorted(name for name in set(recorded) | set(actual) if recorded.get(name) != actual.get(name))

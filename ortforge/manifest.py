"""An artifact's manifest: where it came from, how it was built, and the sha256 of every file, so
a copy can be checked before it is trusted."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ortforge.names import DEPLOYMENT_KEY, MANIFEST_FILE, RUNTIME_SUFFIX, VALIDATION_SUFFIX

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


def validation_stamp(folder: Path) -> Path:
    """Where the validate stage records that the variant in folder passed: a sibling file, so the
    variant folder itself stays exactly what quantize wrote."""
    folder = Path(folder)
    return folder.with_name(folder.name + VALIDATION_SUFFIX)


def runtime_config(model_dir: Path) -> Path:
    """Where an artifact's tuned settings live: beside its folder, like its validation stamp."""
    model_dir = Path(model_dir)
    return model_dir.with_name(model_dir.name + RUNTIME_SUFFIX)


def deployment_record(folder: Path) -> dict | None:
    """What validate proved of the runs of the variant in folder (its stamp's `deployment`: prefill
    pieces, batched rows, session settings); None when there is no stamp, {} when it records none."""
    stamp = validation_stamp(folder)
    if not stamp.is_file():
        return None
    try:
        record = json.loads(stamp.read_text(encoding="utf-8")).get(DEPLOYMENT_KEY)
    except (OSError, ValueError, AttributeError):
        return {}
    return record if isinstance(record, dict) else {}


def check_validated(folder: Path, verify_files: bool = True) -> dict:
    """The stamp of a variant that passed validation, unchanged since; ValueError otherwise.

    The stamp vouches for the manifest, and the manifest for every file: with verify_files (the
    default; it hashes the folder once) a file modified in place after validation is caught too.
    """
    stamp = validation_stamp(folder)
    if not stamp.is_file():
        raise ValueError(f"{folder} has no validation stamp {stamp.name}: it was not validated or it failed")
    record = json.loads(stamp.read_text(encoding="utf-8"))
    actual = sha256_file(Path(folder) / MANIFEST_FILE)
    if not record.get("passed") or record.get("manifest_sha256") != actual:
        raise ValueError(f"{stamp} does not vouch for {folder} as it is now (manifest sha256 {actual[:12]})")
    changed = mismatched_files(folder) if verify_files else []
    if changed:
        raise ValueError(
            f"{folder} changed after validation ({', '.join(changed)} differ from its manifest); "
            "restore it with `dvc checkout` or rebuild it"
        )
    return record

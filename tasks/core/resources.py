"""Checks run before a stage does heavy work: can it write its outputs, and is there room for them on
disk and in memory? A build that stops at once with the reason beats one that dies halfway.

Estimates scale with the size of the stage's input model. The factors are upper bounds seen on the
default model (fp32 weights loaded once by torch or onnx, plus the copy being written), with margin.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

from tasks.core.errors import StageError
from tasks.core.files import folder_bytes

SKIP_ENV = "ORTFORGE_SKIP_RESOURCE_CHECK"  # for a user who knows the estimate is wrong for their model
GB = 1e9


@dataclass(frozen=True)
class Needs:
    """Per byte of the input model: bytes of free disk beside the output, and of available memory."""

    input_flag: str
    disk: float
    memory: float


# download checks its own source (its input is a params entry, not a path); report is small.
STAGE_NEEDS = {
    "export": Needs("hf", disk=2.5, memory=3.0),
    "optimize": Needs("onnx", disk=1.5, memory=3.0),
    "reference": Needs("hf", disk=0.1, memory=2.5),
    "quantize": Needs("optimized", disk=1.5, memory=3.0),
    "validate": Needs("variant-dir", disk=0.0, memory=2.0),
    "bench": Needs("variant-dir", disk=0.0, memory=2.5),
}
# A 4-bit GGUF becomes fp32 safetensors; a folder is copied (and pickle weights converted).
DOWNLOAD_GGUF_NEEDS = Needs("source", disk=9.0, memory=10.0)
DOWNLOAD_FOLDER_NEEDS = Needs("source", disk=1.5, memory=3.0)


def nearest_existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def check_writable(output: Path) -> None:
    """Raise StageError unless output can be created: its nearest existing ancestor is a writable folder."""
    base = nearest_existing(Path(output).parent)
    if not base.is_dir():
        raise StageError(f"cannot write {output}: {base} is a file, not a folder; choose another output path")
    try:  # a real write: permission bits do not stop root, read-only mounts and /proc do
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError:
        raise StageError(
            f"cannot write {output}: {base} is not writable; fix its permissions or choose another path"
        ) from None


def input_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return folder_bytes(path) if path.is_dir() else 0


def check_room(stage: str, needs: Needs, input_path: Path, output: Path) -> None:
    """Raise StageError when free disk or available memory is below the estimate for this input."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    size = input_bytes(input_path)
    disk_needed = needs.disk * size
    disk_free = shutil.disk_usage(nearest_existing(output)).free
    if disk_free < disk_needed:
        raise StageError(
            f"{stage} needs about {amount(disk_needed)} free beside {output} ({needs.disk}x the "
            f"{amount(size)} input); {amount(disk_free)} free: free disk space, or set {SKIP_ENV}=1"
        )
    memory_needed = needs.memory * size
    memory_free = psutil.virtual_memory().available
    if memory_free < memory_needed:
        raise StageError(
            f"{stage} needs about {amount(memory_needed)} of memory ({needs.memory}x the {amount(size)} "
            f"input); {amount(memory_free)} available: close other programs, or set {SKIP_ENV}=1"
        )


def amount(size: float) -> str:
    """Bytes in the unit that shows them: 0.3 MB is not "0.0 GB"."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} bytes"

"""Checks run before a stage does heavy work: can it write its outputs, and is there room for them on
disk and in memory? A build that stops at once with the reason beats one the kernel kills halfway.

Each stage declares its estimate next to its config (a `needs(args)` function in its module, given
to stage_cli): peak memory and disk from the model's shape as its checkpoint header says it (no
weight is read), so a 135M and an 8B model get the same formula with their own figures. The
formulas are upper bounds of what the stages were measured to take (benchmarks/scale.py records
estimate beside measurement for each stage and model size). Available memory is what the kernel
would give this process: the machine's, or its cgroup's limit (a container, a CI runner), the
smaller.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

from tasks.core.errors import StageError
from tasks.core.files import folder_bytes

log = logging.getLogger(__name__)

SKIP_ENV = "ORTFORGE_SKIP_RESOURCE_CHECK"  # for a user who knows the estimate is wrong for their model
GB = 1e9
# Python with torch, transformers and onnxruntime imported, before any model.
BASE_MEMORY = 0.8 * GB
# Python with onnxruntime alone (the runtime side: validate, bench's engine processes).
RUNTIME_MEMORY = 0.35 * GB
LAYER_INDEX = re.compile(r"\.layers?\.(\d+)\.|\.h\.(\d+)\.")


@dataclass(frozen=True)
class Needs:
    """A stage's estimated peak memory and the free disk it needs beside its output, and what the
    estimate is made of, in words (shown when it refuses)."""

    memory: float
    disk: float
    basis: str


@dataclass(frozen=True)
class ModelSize:
    """What stage memory depends on, in float32 bytes, from the checkpoint's header: the whole model,
    its largest decoder layer, its vocabulary matrices (embedding and untied output layer), its
    largest tensor; the vocabulary's rows; and the checkpoint's own bytes on disk."""

    total: int
    layer: int
    vocabulary: int
    largest: int
    vocab_rows: int
    stored: int

    @classmethod
    def of(cls, hf_dir: Path) -> ModelSize:
        from tasks.sources.checkpoint import Checkpoint

        if not (Path(hf_dir) / "config.json").is_file():
            raise StageError(f"{hf_dir} has no config.json; run the download stage first (dvc repro download@<model>)")
        tensors = Checkpoint(hf_dir).tensors.values()
        layers: dict[str, int] = {}
        outside = [t for t in tensors if not LAYER_INDEX.search(t.name)]
        for tensor in tensors:
            if (match := LAYER_INDEX.search(tensor.name)) is not None:
                layers[match.group(0)] = layers.get(match.group(0), 0) + 4 * tensor.elements
        matrices = [t for t in outside if len(t.shape) == 2]
        return cls(
            total=4 * sum(t.elements for t in tensors),
            layer=max(layers.values(), default=0),
            vocabulary=4 * sum(t.elements for t in matrices),
            largest=4 * max(t.elements for t in tensors),
            vocab_rows=max((t.shape[0] for t in matrices), default=0),
            stored=sum(t.length for t in tensors),
        )

    def logits(self, rows: int) -> int:
        """float32 logits of `rows` positions over the vocabulary."""
        return 4 * rows * self.vocab_rows


def runtime_needs(variant_dir: Path, logits_rows: int, what: str) -> Needs:
    """onnxruntime running a built variant: its weights (and their prepacked copies) and a window
    of logits over its vocabulary (read from the variant's config.json), about seven times over as
    the metrics compute on it."""
    import json

    weights = folder_bytes(variant_dir, "model.onnx*")
    try:
        config = json.loads((Path(variant_dir) / "config.json").read_text(encoding="utf-8"))
        vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)
    except (OSError, ValueError):
        vocab = 0
    logits = 7 * 4 * logits_rows * vocab
    basis = f"{what}: the {amount(weights)} variant in onnxruntime"
    return Needs(RUNTIME_MEMORY + 2 * weights + logits, 0, basis)


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


def available_memory() -> int:
    """Bytes this process can still get: the machine's available memory, or less where a cgroup
    (v1 or v2) caps it; page cache the cgroup could reclaim counts as available."""
    available = psutil.virtual_memory().available
    for limit, used in _cgroup_limits():
        available = min(available, max(limit - used, 0))
    return available


def _cgroup_limits() -> list[tuple[int, int]]:
    """(limit, usage without reclaimable file cache) of each memory cgroup this process is in,
    up its hierarchy."""
    try:
        lines = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2, unified (or the hybrid layout's unified mount)
            roots, names = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")), ("memory.max", "memory.current")
            cache_key = "inactive_file"
        elif "memory" in controllers.split(","):
            roots, names = (Path("/sys/fs/cgroup/memory"),), ("memory.limit_in_bytes", "memory.usage_in_bytes")
            cache_key = "total_inactive_file"
        else:
            continue
        for root in roots:
            folder = root / path.lstrip("/")
            while folder.is_relative_to(root) and folder.exists():
                reading = _cgroup_reading(folder, *names, cache_key)
                if reading is not None:
                    found.append(reading)
                if folder == root:
                    break
                folder = folder.parent
    return found


def _cgroup_reading(folder: Path, limit_file: str, usage_file: str, cache_key: str) -> tuple[int, int] | None:
    try:
        limit_text = (folder / limit_file).read_text(encoding="utf-8").strip()
        used = int((folder / usage_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if limit_text == "max" or int(limit_text) >= 1 << 60:  # no limit ("max", or v1's page-rounded LONG_MAX)
        return None
    stat = {}
    try:
        for entry in (folder / "memory.stat").read_text(encoding="utf-8").splitlines():
            key, _, value = entry.partition(" ")
            stat[key] = int(value)
    except (OSError, ValueError):
        pass
    return int(limit_text), used - stat.get(cache_key, 0)


def resident_memory() -> int:
    """What this process holds now (its imports): part of the stage's peak, already paid."""
    return psutil.Process().memory_info().rss


def check(stage: str, needs: Needs, output: Path) -> None:
    """Raise StageError (one line) when free disk or available memory is below the estimate. The
    estimate is the stage's whole peak, so what this process holds already (its imports) counts
    as available to it."""
    memory_free = available_memory() + resident_memory()
    disk_free = shutil.disk_usage(nearest_existing(output)).free
    log.info(
        "preflight: %s needs about %s of memory and %s of disk (%s); %s of memory and %s of disk are available",
        stage,
        amount(needs.memory),
        amount(needs.disk),
        needs.basis,
        amount(memory_free),
        amount(disk_free),
    )
    if os.environ.get(SKIP_ENV) == "1":
        return
    if disk_free < needs.disk:
        raise StageError(
            f"{stage} needs about {amount(needs.disk)} free beside {output} ({needs.basis}); {amount(disk_free)} "
            f"free: free disk space, or set {SKIP_ENV}=1"
        )
    if memory_free < needs.memory:
        raise StageError(
            f"{stage} needs about {amount(needs.memory)} of memory ({needs.basis}); {amount(memory_free)} are "
            f"available: use a machine with more memory, close other programs, or set {SKIP_ENV}=1"
        )


def amount(size: float) -> str:
    """Bytes in the unit that shows them: 0.3 MB is not "0.0 GB"."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} bytes"

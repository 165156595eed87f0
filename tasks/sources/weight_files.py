"""Cheap structural checks of weight files, run before anything loads them: a truncated or
malformed file must give a clear error, not a crash or a huge allocation halfway through a build."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tasks.core.errors import StageError

MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def check_safetensors(path: Path) -> None:
    """Raise StageError unless path has a sane header and every tensor's bytes are present."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise StageError(f"safetensors file {path} is truncated ({size} bytes); re-download it")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > size:
            raise StageError(
                f"safetensors file {path} has a corrupt or truncated header (claims {header_len} bytes, file has "
                f"{size}); re-download it"
            )
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise StageError(f"safetensors file {path} has a header that is not JSON; re-download it") from None
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        raise StageError(f"safetensors file {path} is truncated (needs {needed} bytes, has {size}); re-download it")


GGUF_MAGIC = b"GGUF"
# The smallest possible entries: a key/value is a length-prefixed key (8 + 1 bytes) and a type
# (4 bytes); a tensor info is a length-prefixed name, dimension count, one dimension, type, offset.
MIN_GGUF_KV_BYTES = 8 + 1 + 4
MIN_GGUF_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8


def check_gguf_header(path: Path) -> None:
    """Raise StageError unless path starts like a GGUF file whose counts fit in the file.

    The gguf reader trusts the tensor and key/value counts and loops over them; a damaged or hostile
    header claiming billions of entries must be refused before that.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise StageError(f"GGUF file {path} is truncated or corrupt (no GGUF header); re-download it")
    version, tensors, kvs = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise StageError(f"GGUF file {path} has version {version}; only versions 2 and 3 are read")
    claimed = tensors * MIN_GGUF_TENSOR_INFO_BYTES + kvs * MIN_GGUF_KV_BYTES
    if claimed > size:
        raise StageError(
            f"GGUF file {path} is truncated or corrupt: its header claims {tensors} tensors and {kvs} "
            f"metadata entries, more than its {size} bytes can hold; re-download it"
        )

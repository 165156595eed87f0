"""Cheap structural checks of weight files, run before anything loads them: a truncated or
malformed file must give a clear error, not a crash or a huge allocation halfway through a build."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tasks.errors import StageError

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

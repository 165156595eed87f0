"""ortforge's own onnxruntime kernels, and the sessions that need them.

One for now: ai.ortforge GroupQueryAttention (csrc/gqa.c, registered by csrc/ort_op.c). It keeps
onnxruntime 1.32's com.microsoft GroupQueryAttention contract (inputs, outputs, attributes), so a
graph picks its attention kernel by its nodes' domain; a variant whose recipe says `attention:
ortforge` is built that way and validated like any other (README, "A hand-written attention kernel").

The library is compiled from the sources here by the machine's C compiler ($CC, else cc), for the
CPU it runs on (-march=native), into a cache folder keyed by the sources, the flags and the CPU, on
first use (scripts/install.sh does it at install). A session registers it for a graph that imports
the domain (the model's opset_import, which every rewritten copy of the graph keeps), and loads
nothing for any other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ortforge import machine

log = logging.getLogger(__name__)

DOMAIN = "ai.ortforge"  # csrc/ort_op.c's
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(SOURCE_DIR / name for name in ("gqa.c", "ort_op.c"))
HEADERS = (SOURCE_DIR / "gqa.h",)
LIBRARY = "libortforge_gqa.so"
# -march=native: built where it runs, for this CPU's vector width; -fopenmp-simd: the loops'
# `omp simd` reductions vectorize without OpenMP's runtime; -ffp-contract=fast: a multiply and an
# add become one fused multiply-add (ISO C mode would keep them apart); no -ffast-math (the
# softmax's clamping and the agreement with onnxruntime need IEEE floats).
FLAGS = (
    *("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-fno-math-errno"),
    *("-std=c11", "-fPIC", "-shared"),
)
CACHE_ENV = "ORTFORGE_KERNEL_CACHE"  # where compiled libraries go (default ~/.cache/ortforge/kernels)


class KernelUnavailable(ValueError):
    """The library cannot be built here: no compiler, or it failed (the message says which)."""


def compiler() -> str:
    name = os.environ.get("CC", "cc")
    if shutil.which(name) is None:
        raise KernelUnavailable(
            f"ortforge's attention kernel needs a C compiler and {name!r} is not on PATH: "
            "install one (apt-get install gcc) or set CC"
        )
    return name


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ortforge" / "kernels"


def build_key(cc: str) -> str:
    """What the library's code depends on: the sources, the flags, the compiler named and the CPU
    (-march=native code may not run on another one)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(json.dumps([FLAGS, cc, machine.describe()], sort_keys=True).encode())
    return digest.hexdigest()[:16]


def cached_library(cc: str) -> Path:
    """Where cc's build of the library for this machine lives (it may not exist yet)."""
    return cache_dir() / build_key(cc) / LIBRARY


def library() -> Path:
    """The compiled library for this machine, built now when the cache has none. Processes that
    build it at once each write their own file and rename it into place: one wins, both load it."""
    cc = compiler()
    path = cached_library(cc)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    handle, partial = tempfile.mkstemp(prefix=f".{LIBRARY}.", dir=path.parent)
    os.close(handle)
    try:
        built = subprocess.run(
            [cc, *FLAGS, "-o", partial, *map(str, SOURCES), "-lm"], capture_output=True, text=True, check=False
        )
        if built.returncode != 0:
            last = (built.stderr.strip().splitlines() or ["no output"])[-1]
            raise KernelUnavailable(f"{cc} could not build ortforge's attention kernel ({last}); see {SOURCE_DIR}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    log.info("compiled %s in %.1f s", path, time.perf_counter() - started)
    return path


def _varint(data, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def _fields(data, start: int, end: int):
    """(field number, payload) of each field of the protobuf message in data[start:end]: a
    length-delimited field's bytes as a memoryview (never copied), None for the other wire types."""
    at = start
    while at < end:
        tag, at = _varint(data, at)
        wire = tag & 7
        if wire == 0:
            _, at = _varint(data, at)
            yield tag >> 3, None
        elif wire == 2:
            size, at = _varint(data, at)
            yield tag >> 3, memoryview(data)[at : at + size]
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
            yield tag >> 3, None
        else:
            raise ValueError(f"wire type {wire}")


OPSET_IMPORT, OPSET_DOMAIN = 8, 1  # ModelProto.opset_import, OperatorSetIdProto.domain (onnx.proto)


def opset_domains(model_file: Path) -> set[str]:
    """The operator-set domains the model imports, read from its top-level fields through a memory
    map, the graph (which may hold gigabytes of weights) skipped unread; empty for a file that is
    not one (onnxruntime then says why)."""
    import mmap

    with open(model_file, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return set()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return {
                    bytes(domain).decode()
                    for number, opset in _fields(data, 0, len(data))
                    if number == OPSET_IMPORT and opset is not None
                    for field, domain in _fields(opset, 0, len(opset))
                    if field == OPSET_DOMAIN and domain is not None
                }
            except (IndexError, ValueError, UnicodeDecodeError):
                return set()


def register(options, model_file: Path) -> None:
    """Register in options (onnxruntime SessionOptions) ortforge's kernel when the model imports its
    domain; KernelUnavailable (a ValueError, one line) when it cannot be built here."""
    if DOMAIN in opset_domains(model_file):
        options.register_custom_ops_library(str(library()))


def main() -> int:
    """`python -m ortforge.custom_ops`: build the library now (scripts/install.sh) and say where."""
    try:
        print(library())
    except KernelUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

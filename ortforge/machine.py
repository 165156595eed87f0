"""The machine a measurement was taken on: the CPU model and the instruction-set features that
onnxruntime's kernels choose between. Settings tuned on one CPU say little about another (an
AVX-512 VNNI kernel does not run on an AVX2-only machine), so they are recorded together."""

from __future__ import annotations

import platform
from pathlib import Path

# The CPU features onnxruntime's int8/int4 kernels choose between, fastest last.
CPU_FEATURES = ("avx", "fma", "avx2", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe() -> dict:
    """{"cpu": model name, "features": the CPU_FEATURES this machine has}, as measurements record it."""
    flags = cpu_flags()
    return {"cpu": cpu_model(), "features": [name for name in CPU_FEATURES if name in flags]}

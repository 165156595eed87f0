"""`ortforge doctor`: the facts that decide whether and how fast a build runs on this machine."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

from ortforge.machine import CPU_FEATURES, cpu_flags, cpu_model


def tool_lines(root: Path) -> list[str]:
    from tasks.core.versions import PINS_FILE, installed, load_pins

    pins_file = root / PINS_FILE
    if not pins_file.is_file():
        return [f"versions: {pins_file} not found (run from the repository root)"]
    lines = []
    for tool, pin in load_pins(pins_file).items():
        actual = installed(tool)
        lines.append(f"  {tool:<16} {actual:<14} {'ok' if actual == pin else f'MISMATCH: pinned {pin}'}")
    return ["tools (installed vs versions.yaml):", *lines]


def kernel_line() -> str:
    """Where ortforge's attention kernel (variants with `attention: ortforge`) stands here; builds nothing."""
    from ortforge import custom_ops

    label = "attention kernel (attention: ortforge)"
    try:
        cc = custom_ops.compiler()
    except custom_ops.KernelUnavailable as error:
        return f"{label}: unavailable: {error}"
    built = custom_ops.cached_library(cc)
    return f"{label}: built for this CPU ({built})" if built.is_file() else f"{label}: {cc} builds it on first use"


def report(root: Path) -> list[str]:
    import psutil

    flags = cpu_flags()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    disk = shutil.disk_usage(root)
    memory = psutil.virtual_memory()
    return [
        f"python: {platform.python_version()} ({platform.machine()})",
        f"cpu: {cpu_model()}; features: "
        + ", ".join(f"{name} {'yes' if name in flags else 'no'}" for name in CPU_FEATURES),
        f"threads: {usable} usable of {os.cpu_count()} logical CPUs (physical cores: {psutil.cpu_count(False)})",
        f"memory: {memory.available / 1e9:.1f} GB available of {memory.total / 1e9:.1f} GB",
        f"disk: {disk.free / 1e9:.1f} GB free at {root}",
        kernel_line(),
        *tool_lines(root),
    ]

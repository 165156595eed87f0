"""Versions of the tools whose upgrade can change an artifact, read without importing them."""

from __future__ import annotations

import importlib.metadata
import platform

TOOLS = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime", "numpy", "ortforge")


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TOOLS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions

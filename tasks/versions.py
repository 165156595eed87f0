"""The pinned versions of the tools that shape artifacts (versions.yaml), which of them each stage
uses, and the check that the installed ones match before a stage writes anything.

DVC sees the pins as params: dvc.yaml lists STAGE_TOOLS[stage] for each stage (a contract test
keeps the two equal), so a pin change reruns exactly the stages that use that tool.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import yaml

from tasks.errors import StageError

PINS_FILE = Path("versions.yaml")

STAGE_TOOLS: dict[str, tuple[str, ...]] = {
    "download": ("torch", "transformers", "gguf", "safetensors", "tokenizers", "huggingface-hub"),
    "export": ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime", "onnxruntime-genai"),
    "optimize": ("onnxruntime", "onnx", "transformers"),
    "reference": ("torch", "transformers", "tokenizers", "numpy"),
    "quantize": ("onnxruntime", "onnx", "onnx-ir", "numpy", "torch", "tokenizers", "transformers"),
    "validate": ("onnxruntime", "tokenizers", "numpy"),
    "bench": ("onnxruntime", "torch", "transformers", "tokenizers", "numpy"),
    "report": ("matplotlib", "markdown"),
}
# The stages whose tools end up in a variant's lineage, as its manifest records them.
VARIANT_LINEAGE = ("download", "export", "optimize", "quantize")


def installed(tool: str) -> str:
    try:
        version = importlib.metadata.version(tool)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    return version.split("+")[0]  # torch's +cpu build label is not a different release


def load_pins(path: Path = PINS_FILE) -> dict[str, str]:
    if not path.is_file():
        raise StageError(f"{path} not found; run from the repository root (it pins the build's tool versions)")
    return {str(k): str(v) for k, v in yaml.safe_load(path.read_text(encoding="utf-8")).items()}


def check_installed(stage: str, pins_file: Path = PINS_FILE) -> dict[str, str]:
    """The pinned versions of the stage's tools; StageError when any installed one differs."""
    pins = load_pins(pins_file)
    tools = STAGE_TOOLS[stage]
    unpinned = [tool for tool in tools if tool not in pins]
    if unpinned:
        raise StageError(f"{pins_file} has no pin for {', '.join(unpinned)}; add one (stage {stage} uses it)")
    wrong = [f"{tool} {installed(tool)} (pinned {pins[tool]})" for tool in tools if installed(tool) != pins[tool]]
    if wrong:
        raise StageError(
            f"installed versions differ from {pins_file}: {'; '.join(wrong)}. Run scripts/install.sh, or change "
            f"the pins (and constraints.txt) to rebuild what they affect"
        )
    return {tool: pins[tool] for tool in tools}


def lineage_versions(pins_file: Path = PINS_FILE) -> dict[str, str]:
    pins = load_pins(pins_file)
    return {tool: pins[tool] for stage in VARIANT_LINEAGE for tool in STAGE_TOOLS[stage]}

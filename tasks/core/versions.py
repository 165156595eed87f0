"""The pinned versions of the tools that shape artifacts (versions.yaml), which of them each stage
uses, and the check that the installed ones match before a stage writes anything.

Which tools a stage uses is read from its code (tasks/core/imports.py: the distributions its modules
import and what those require), not written down: dvc.yaml lists the same pins as params of each
stage (tests/test_contract.py checks they agree), so a pin change reruns exactly the stages whose
code reaches that tool.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import yaml

from tasks.core import imports
from tasks.core.errors import StageError

PINS_FILE = Path("versions.yaml")
STAGES = ("download", "export", "optimize", "reference", "quantize", "validate", "bench", "evaluate", "report")
# The stages whose tools end up in a variant's lineage, as its manifest records them.
VARIANT_LINEAGE = ("download", "export", "optimize", "quantize")


def stage_tools(stage: str, pins: dict[str, str]) -> tuple[str, ...]:
    """The pinned tools the stage's code imports or needs through them, as versions.yaml spells them."""
    derived = set(imports.tools(stage, set(pins)))
    return tuple(tool for tool in pins if imports.normalized(tool) in derived)


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
    tools = stage_tools(stage, pins)
    wrong = [f"{tool} {installed(tool)} (pinned {pins[tool]})" for tool in tools if installed(tool) != pins[tool]]
    if wrong:
        raise StageError(
            f"installed versions differ from {pins_file}: {'; '.join(wrong)}. Run scripts/install.sh, or change "
            f"the pins (and constraints.txt) to rebuild what they affect"
        )
    return {tool: pins[tool] for tool in tools}


def lineage_versions(pins_file: Path = PINS_FILE) -> dict[str, str]:
    pins = load_pins(pins_file)
    return {tool: pins[tool] for stage in VARIANT_LINEAGE for tool in stage_tools(stage, pins)}

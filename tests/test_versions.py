"""versions.yaml: one set of pins that constraints.txt and pyproject agree with, checked at run time."""

from __future__ import annotations

import re

import pytest

from tasks.core.errors import StageError
from tasks.core.versions import STAGES, check_installed, lineage_versions, load_pins, stage_tools
from tests.conftest import REPO


def pinned_in(text: str) -> dict[str, str]:
    """name==version pins in a requirements-like text, names normalized as PEP 503 does."""
    found = re.findall(r"^\s*\"?([A-Za-z0-9_.-]+)==([^\s\",;]+)", text, re.M)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


def test_pins_agree_with_constraints_and_pyproject():
    pins = load_pins(REPO / "versions.yaml")
    constraints = pinned_in((REPO / "constraints.txt").read_text())
    pyproject = pinned_in((REPO / "pyproject.toml").read_text())
    for tool, version in pins.items():
        assert constraints.get(tool) == version, f"constraints.txt pins {tool} {constraints.get(tool)}"
        if tool in pyproject:
            assert pyproject[tool] == version, f"pyproject.toml pins {tool} {pyproject[tool]}"


@pytest.mark.parametrize("stage", STAGES)
def test_check_installed_accepts_this_environment(stage):
    pins = load_pins(REPO / "versions.yaml")
    assert set(check_installed(stage, REPO / "versions.yaml")) == set(stage_tools(stage, pins))


def test_check_installed_names_the_mismatch_and_the_fix(tmp_path):
    pins = (REPO / "versions.yaml").read_text().replace("onnxruntime: 1.32.0", "onnxruntime: 9.9.9")
    (tmp_path / "versions.yaml").write_text(pins)
    with pytest.raises(StageError, match=r"onnxruntime 1\.32\.0 \(pinned 9\.9\.9\).*Run scripts/install.sh"):
        check_installed("quantize", tmp_path / "versions.yaml")
    check_installed("download", tmp_path / "versions.yaml")  # download does not use onnxruntime


def test_stage_tools_are_what_the_code_reaches():
    pins = load_pins(REPO / "versions.yaml")
    assert set(stage_tools("export", pins)) >= {"onnxruntime-genai", "optimum-onnx", "torch", "onnx", "onnxruntime"}
    assert "onnxruntime-genai" not in stage_tools("optimize", pins)  # only export runs the builder
    assert {"torch", "gguf", "sentencepiece"} <= set(stage_tools("download", pins))
    # the task A/B's ROUGE-L (rouge-score, which needs regex); only evaluate runs lm-eval
    assert set(stage_tools("report", pins)) == {"matplotlib", "markdown", "numpy", "rouge-score", "regex"}
    assert "lm-eval" in stage_tools("evaluate", pins) and "lm-eval" not in stage_tools("report", pins)


def test_lineage_versions_cover_every_stage_that_shapes_a_variant():
    versions = lineage_versions(REPO / "versions.yaml")
    assert {"torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "gguf"} <= set(versions)
    assert "matplotlib" not in versions

"""The runtime stands alone: a wheel built from this repository, installed into a fresh virtual
environment, brings onnxruntime, numpy, tokenizers and Jinja2 and nothing of the build (no torch,
transformers, DVC or Prefect), and `ortforge generate` runs a validated artifact folder with it;
the build's commands say how to get the build side."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

# (PyYAML is not here: tokenizers brings it, through huggingface_hub.)
BUILD_SIDE = ("torch", "transformers", "optimum", "onnxruntime_genai", "dvc", "prefect", "pydantic", "onnx")


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory):
    work = tmp_path_factory.mktemp("runtime-alone")
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(REPO / name, source / name)
    for name in ("ortforge", "tasks", "flows"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "wheel"), str(source)], check=True
    )
    (wheel,) = (work / "wheel").glob("ortforge-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    pip = [str(work / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "-c", str(REPO / "constraints.txt"), str(wheel)], check=True)
    return work / "venv" / "bin"


def test_the_runtime_installs_without_the_build_side(runtime_venv):
    probe = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))"
    found = subprocess.run([runtime_venv / "python", "-c", probe, *BUILD_SIDE], capture_output=True, text=True)
    assert found.returncode == 0 and found.stdout.split() == []


def test_generate_runs_an_artifact_folder_with_the_runtime_alone(runtime_venv, built, params, tmp_path):
    from ortforge.generate import TextGenerator
    from tests.test_text_encoding import validated_project

    folder = validated_project(built, params, tmp_path) / "artifacts" / "tiny" / "variants" / "int4"
    prompt = "The GNU General Public License is"
    result = subprocess.run(
        [runtime_venv / "ortforge", "generate", str(folder), prompt, "--max-new-tokens", "12"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "".join(TextGenerator(folder).stream(prompt, 12)) + "\n"


def test_serve_says_how_to_get_the_serve_extra(runtime_venv, tmp_path):
    result = subprocess.run([runtime_venv / "ortforge", "serve", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "ortforge serve needs the serve extra" in result.stderr and "pip install 'ortforge[serve]'" in result.stderr


def test_build_commands_say_how_to_get_the_build_side(runtime_venv, tmp_path):
    result = subprocess.run([runtime_venv / "ortforge", "build"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "needs ortforge's build side" in result.stderr and "pip install 'ortforge[build]'" in result.stderr

"""OpenVINO GenAI as a benchmark peer, driven from ortforge's venv.

OpenVINO lives in a venv of its own (benchmarks/peers/setup_openvino.sh): its transformers and
optimum pins clash with ours. So nothing here imports it: exports run through that venv's
optimum-cli and measurements through benchmarks/peers/openvino_runner.py under that venv's
python, each a process of its own that prints one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO.parent / "peers" / "openvino" / "bin" / "python"  # where setup_openvino.sh puts it
RUNNER = Path(__file__).with_name("openvino_runner.py")
SETUP = "benchmarks/peers/setup_openvino.sh"
INPUT_FLAGS = {"generate": "--prompt-ids", "load": "--prompts", "score": "--sequences"}


def installed(python: Path = PYTHON) -> bool:
    return python.is_file()


def version(python: Path) -> str:
    done = subprocess.run(
        [str(python), "-c", "import openvino_genai; print(openvino_genai.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def recipe(weight_format: str) -> str:
    return "int4, group 32, ratio 1.0" if weight_format == "int4" else weight_format


def export_command(python: Path, source: Path, out: Path, weight_format: str) -> list[str]:
    """optimum-cli's OpenVINO export. int4 in groups of 32 for every layer: the default group of
    128 does not divide SmolLM2's 576 and ratio 1.0 keeps no layer in int8 (ortforge's int4 too)."""
    command = [str(python.parent / "optimum-cli"), "export", "openvino", "-m", str(source)]
    command += ["--task", "text-generation-with-past", "--weight-format", weight_format]
    if weight_format == "int4":
        command += ["--group-size", "32", "--ratio", "1.0"]
    return command + [str(out)]


def build(python: Path, source: Path, out: Path, weight_format: str) -> Path:
    """The export, once: written beside out and renamed, so an interrupted export leaves nothing
    that looks finished."""
    if (out / "openvino_model.xml").is_file():
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    done = subprocess.run(export_command(python, source, partial, weight_format), capture_output=True, text=True)
    if done.returncode != 0:
        output = done.stdout[-1000:] + done.stderr[-1000:]
        raise RuntimeError(f"OpenVINO export ({recipe(weight_format)}) failed: {output}")
    partial.rename(out)
    return out


def run(python: Path, model: Path, command: str, data, scratch: Path, options: list[str]) -> dict:
    """The runner's JSON for one subcommand; data (token ids) goes in through a file in scratch."""
    path = scratch / f"{command}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    args = [str(python), str(RUNNER), command, "--model", str(model), INPUT_FLAGS[command], str(path)]
    args += ["--threads", str(os.cpu_count() or 2), *options]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"OpenVINO runner {command} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)

"""Shared fixtures: a tiny random LLaMA-style model and the outputs of each stage on it, built once
per session; fast test params; and a throwaway copy of the repository for DVC and Prefect runs."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import tiny_models

REPO = Path(__file__).resolve().parents[1]
EVAL_TEXT = REPO / "data" / "eval" / "GPL-3.txt"
PROJECT_FILES = ("tasks", "ortforge", "flows", "data", "dvc.yaml", ".dvcignore", "prefect.toml", ".gitignore")

# Keep every tool in the tests quiet and local.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# dvc.yaml runs `python -m ...`: make that the interpreter running the tests, venv activated or not.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

TINY_PARAMS = {
    "models": {
        "tiny": {
            "source": {"kind": "local", "path": "<set by fixture>"},
            "allow_pickle": False,
            "trust_remote_code": False,
        }
    },
    "export": {"opset": 18},
    "optimize": {"model_type": "gpt2", "opt_level": 0},
    "quantize": {
        "fp32": {"method": "fp32"},
        "int8": {"method": "int8_dynamic", "weight_type": "QUInt8", "per_channel": False, "reduce_range": False},
        "int4": {"method": "int4", "block_size": 32, "symmetric": True, "accuracy_level": 4},
    },
    "validate": {
        "eval": {
            "text": str(EVAL_TEXT),
            "max_tokens": 128,
            "window": 32,
            "seed": 0,
            "logits_tokens": 16,
            "greedy_prompt_offset": 10,
            "greedy_prompt_tokens": 8,
            "greedy_steps": 8,
            "kv_prefill": 8,
            "kv_steps": 8,
        },
        "thresholds": {
            "fp32": {"max_logit_diff": 0.001, "ppl_ratio": 1.001, "greedy_match": 1.0, "kv_max_diff": 0.001},
            "int8": {"max_logit_diff": 1.0, "ppl_ratio": 1.1, "greedy_match": 0.0, "kv_max_diff": 1.0},
            "int4": {"max_logit_diff": 1.0, "ppl_ratio": 1.1, "greedy_match": 0.0, "kv_max_diff": 1.0},
        },
    },
    "bench": {
        "text": str(EVAL_TEXT),
        "prompt_tokens": 16,
        "new_tokens": 6,
        "warmup": 1,
        "repeats": 2,
        "rounds": 1,
        "threads": 1,
        "baseline": True,
    },
}


def tiny_params(hf_dir: Path, **sections) -> dict:
    params = copy.deepcopy(TINY_PARAMS)
    params["models"]["tiny"]["source"]["path"] = str(hf_dir)
    params.update(sections)
    return params


def write_params(folder: Path, params: dict) -> Path:
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return path


def run_module(module: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return tiny_models.build_hf_model(tmp_path_factory.mktemp("tiny") / "hf", EVAL_TEXT)


@pytest.fixture(scope="session")
def params(tiny_hf):
    from tasks.params import Params

    return Params.model_validate(tiny_params(tiny_hf))


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_hf, params) -> dict[str, Path]:
    """Every stage's output folder for the tiny model, built once through the stages' run()."""
    from tasks import download, export, optimize, quantize, reference

    root = tmp_path_factory.mktemp("built")
    out = {name: root / name for name in ("hf", "onnx", "optimized", "reference")}
    download.run(params.model("tiny"), out["hf"])
    export.run(params.export, out["hf"], out["onnx"])
    optimize.run(params.optimize, out["onnx"], out["hf"], out["optimized"])
    reference.run(params.validation.eval, out["hf"], out["reference"])
    for variant, cfg in params.quantize.items():
        out[variant] = root / "variants" / variant
        quantize.run(cfg, out["optimized"], out["hf"], out[variant], {"model": "tiny", "variant": variant})
    return out


@pytest.fixture
def project(tmp_path, tiny_hf) -> Path:
    """A fresh git + DVC repository holding the project's code and tiny-model params."""
    for name in PROJECT_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tmp_path / name)
    write_params(tmp_path, tiny_params(tiny_hf))
    for command in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(command, cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], cwd=tmp_path, check=True)
    return tmp_path

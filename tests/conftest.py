"""Shared fixtures: a tiny random LLaMA-style model and the outputs of each stage on it, built once
per session; fast test params; and a throwaway copy of the repository for DVC and Prefect runs."""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests import tiny_models

REPO = Path(__file__).resolve().parents[1]
EVAL_TEXT = REPO / "data" / "eval" / "GPL-3.txt"
CODE_TEXT = REPO / "data" / "eval" / "lstrlib.c"
PROJECT_FILES = (
    "tasks",
    "ortforge",
    "flows",
    "data",
    "dvc.yaml",
    "versions.yaml",
    ".dvcignore",
    "prefect.toml",
    ".gitignore",
)

# Keep every tool in the tests quiet and local.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# dvc.yaml runs `python -m ...`: make that the interpreter running the tests, venv activated or not.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
for variable in ("GIT_AUTHOR", "GIT_COMMITTER"):  # tests commit in throwaway repositories
    os.environ.setdefault(f"{variable}_NAME", "ortforge tests")
    os.environ.setdefault(f"{variable}_EMAIL", "tests@ortforge.invalid")

WEIGHT_ONLY = {
    "method": "weight_only",
    "bits": 4,
    "algorithm": "rtn",
    "block_size": 32,
    "zero_point": "float",
    "accuracy_level": 4,
    "output_bits": 4,
    "output_algorithm": "rtn",
    "eight_bit_blocks": [],
}
VARIANTS = ("fp32", "int8", "int4")
# The fewest that still run every kind of stage: the task reference and a quantized variant.
EVERY_STAGE_KIND = ("fp32", "int4")
TINY_PARAMS = {
    "models": {
        "tiny": {
            "source": {"kind": "local", "path": "<set by fixture>"},
            "exporter": "auto",
            "allow_pickle": False,
            "trust_remote_code": False,
        }
    },
    "builds": {f"tiny-{variant}": {"model": "tiny", "variant": variant} for variant in VARIANTS},
    "export": {"opset": 18},
    "optimize": {"model_type": "none", "opt_level": 0},
    "quantize": {
        "fp32": {"method": "fp32"},
        "int8": {**WEIGHT_ONLY, "bits": 8, "zero_point": "none", "output_bits": 8},
        "int4": WEIGHT_ONLY,
    },
    "calibration": {"text": str(REPO / "data" / "calibration" / "python-docs.txt"), "samples": 2, "tokens": 64},
    "validate": {
        "eval": {
            "texts": [str(EVAL_TEXT.relative_to(REPO)), str(CODE_TEXT.relative_to(REPO))],  # under data/eval
            "max_tokens": 128,
            "window": 32,
            "top_k": 16,
            "greedy_prompt_offset": 10,
            "greedy_prompt_tokens": 8,
            "greedy_steps": 8,
            "kv_prefill": 8,
            "kv_steps": 8,
        },
        "comparison": [],
        "thresholds": {
            "fp32": {
                "ppl_ratio": 1.001,
                "kl_divergence": 1e-4,
                "top1_agreement": 0.99,
                "greedy_agreement": 1.0,
                "kv_max_prob_diff": 1e-3,
            },
            "int8": {
                "ppl_ratio": 1.1,
                "kl_divergence": 0.1,
                "top1_agreement": 0.85,
                "greedy_agreement": 0.0,
                "kv_max_prob_diff": 0.1,
            },
            "int4": {
                "ppl_ratio": 1.1,
                "kl_divergence": 0.1,
                "top1_agreement": 0.4,
                "greedy_agreement": 0.0,
                "kv_max_prob_diff": 0.1,
            },
        },
    },
    # The shipped sets, their first rows only: the tiny random model answers them as noise.
    "tasks": {
        "sets": {
            "chat_qa": {"kind": "qa", "file": "data/tasks/chat_qa.jsonl"},
            "classify": {"kind": "choice", "file": "data/tasks/classify.jsonl"},
            "summarize": {"kind": "instruct", "file": "data/tasks/summarize.jsonl"},
        },
        "limit": 3,
        "reference": "fp32",
        "gates": {"min_score_retention": 0.95, "min_choice_agreement": 0.9},
    },
    "report": {"recommend_by": "decode_tokens_per_second", "max_ppl_ratio": 1.1, "require_task_gate": True},
    "bench": {
        "text": str(EVAL_TEXT),
        "prompt_tokens": 16,
        "new_tokens": 6,
        "warmup": 1,
        "repeats": 2,
        "rounds": 1,
        "threads": 1,
        "tune": True,
        "baseline": True,
        "concurrency": {
            "streams": [1, 3],
            "prompt_tokens": 16,
            "new_tokens": 6,
            "shared_prefix": 0.5,
            "requests": 2,
            "prefix_cache_mb": 1.0,
        },
    },
}


def tiny_params(hf_dir: Path, **sections) -> dict:
    params = copy.deepcopy(TINY_PARAMS)
    params["models"]["tiny"]["source"]["path"] = str(hf_dir)
    params.update(sections)
    return params


def write_params(folder: Path, params: dict) -> Path:
    """params.yaml in folder, with the repository's versions.yaml beside it (stages read both)."""
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    shutil.copy2(REPO / "versions.yaml", folder / "versions.yaml")
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
def tiny_qwen_hf(tmp_path_factory) -> Path:
    """A second architecture (Qwen2: biased q/k/v, untied output layer) for multi-model builds."""
    return tiny_models.build_hf_model(tmp_path_factory.mktemp("tiny-qwen") / "hf", EVAL_TEXT, architecture="qwen2")


def read_params(project: Path, file: str = "params.yaml") -> dict:
    return yaml.safe_load((project / file).read_text(encoding="utf-8"))


def write_project_params(project: Path, params: dict, file: str = "params.yaml") -> None:
    (project / file).write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


def add_model(project: Path, name: str, hf_dir: Path) -> None:
    """Add a local-folder model and its builds to the project's params.yaml: the only file a new
    model touches."""
    params = read_params(project)
    params["models"][name] = {**params["models"]["tiny"], "source": {"kind": "local", "path": str(hf_dir)}}
    params["builds"] |= {f"{name}-{variant}": {"model": name, "variant": variant} for variant in VARIANTS}
    write_project_params(project, params)


def keep_builds(project: Path, variants: tuple[str, ...] = EVERY_STAGE_KIND) -> None:
    """Build only these variants of each model (params.yaml `builds`)."""
    params = read_params(project)
    params["builds"] = {key: build for key, build in params["builds"].items() if build["variant"] in variants}
    write_project_params(project, params)


@pytest.fixture(scope="session")
def kernel_library(tmp_path_factory) -> Path:
    """ortforge's attention kernel, built once per test process into its own cache folder (which
    every session the tests make then uses)."""
    from ortforge import custom_ops

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler to build ortforge/csrc")
    os.environ[custom_ops.CACHE_ENV] = str(tmp_path_factory.mktemp("kernels"))
    return custom_ops.library()


@pytest.fixture(scope="session")
def hand_written_kernel(kernel_library):
    from benchmarks import attention_kernel

    return attention_kernel.load(kernel_library)


@pytest.fixture(scope="session")
def on_our_kernel(built, kernel_library, tmp_path_factory) -> Path:
    """The tiny model's fp32 recipe with `attention: ortforge`: the built fp32 variant's twin."""
    from tasks import quantize
    from tasks.quantization.configs import quantize_config

    out = tmp_path_factory.mktemp("attention") / "fp32_attn"
    quantize.run(quantize_config(method="fp32", attention="ortforge"), built["optimized"], built["hf"], out, {})
    return out


@pytest.fixture(scope="session")
def params(tiny_hf):
    from tasks.core.params import Params

    return Params.model_validate(tiny_params(tiny_hf))


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_hf, params) -> dict[str, Path]:
    """Every stage's output folder for the tiny model, built once through the stages' run()."""
    from tasks import download, export, optimize, quantize, reference
    from tasks.core.versions import lineage_versions

    root = tmp_path_factory.mktemp("built")
    out = {name: root / name for name in ("hf", "onnx", "optimized", "reference")}
    download.run(params.model("tiny"), out["hf"])
    export.run(params.export, "auto", out["hf"], out["onnx"])
    optimize.run(params.optimize, out["onnx"], out["hf"], out["optimized"])
    reference.run(params.validation.eval, out["hf"], out["reference"])
    for variant, cfg in params.quantize.items():
        out[variant] = root / "variants" / variant
        record = {"model": "tiny", "variant": variant, "tool_versions": lineage_versions(REPO / "versions.yaml")}
        quantize.run(cfg, out["optimized"], out["hf"], out[variant], record)
    return out


def make_project(folder: Path, hf_dir: Path) -> Path:
    """A fresh git + DVC repository at folder with the project's code, DVC config and tiny params.

    The project's default remote (a folder beside the repository) lands beside folder.
    """
    folder.mkdir(parents=True)
    for name in PROJECT_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, folder / name)
    write_params(folder, tiny_params(hf_dir))
    for command in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(command, cwd=folder, check=True)
    shutil.copy2(REPO / ".dvc" / "config", folder / ".dvc" / "config")
    return folder


def copy_project(source: Path, dest: Path) -> Path:
    """A project folder copied whole (git, dvc.lock, workspace and DVC cache) but for DVC's own
    locks and state under .dvc/tmp, which the copy rebuilds. Files hard-linked to each other (a
    workspace output and its cache object, cache.type hardlink) stay one file in the copy, as a
    build leaves them: the tests of those links read the copy."""
    top = source / ".dvc"
    copied: dict[tuple[int, int], str] = {}

    def copy_keeping_links(src: str, dst: str) -> str:
        identity = (os.stat(src).st_dev, os.stat(src).st_ino)
        if identity in copied:
            os.link(copied[identity], dst)
        else:
            copied[identity] = shutil.copy2(src, dst)
        return dst

    shutil.copytree(
        source,
        dest,
        symlinks=True,
        ignore=lambda folder, _: ["tmp"] if Path(folder) == top else [],
        copy_function=copy_keeping_links,
    )
    return dest


@pytest.fixture(scope="session")
def first_build(tmp_path_factory, tiny_hf) -> tuple[Path, list[str]]:
    """The tiny project's whole DAG built from nothing by `dvc repro`, once per test run: its
    folder and the stages that ran. Tests change copies of it (built_project), never it. With
    pytest-xdist's workers (scripts/test.sh runs two), the first to ask builds it under a file lock
    in the folder they share and the others take it: two builds of it cost 2 minutes of CPU."""
    import json

    from filelock import FileLock

    if "PYTEST_XDIST_WORKER" not in os.environ:
        project = make_project(tmp_path_factory.mktemp("first-build") / "repo", tiny_hf)
        return project, dvc_repro(project)
    shared = tmp_path_factory.getbasetemp().parent  # the run's folder; each worker's basetemp is in it
    record = shared / "first-build.json"
    with FileLock(str(shared / "first-build.lock")):
        if not record.is_file():
            project = make_project(shared / "first-build" / "repo", tiny_hf)
            record.write_text(json.dumps({"project": str(project), "ran": dvc_repro(project)}), encoding="utf-8")
    built = json.loads(record.read_text(encoding="utf-8"))
    return Path(built["project"]), built["ran"]


@pytest.fixture
def built_project(tmp_path, first_build) -> Path:
    """A copy of the first build, for a test that starts from a built project."""
    return copy_project(first_build[0], tmp_path / "repo")


@pytest.fixture(scope="session")
def built_genai(tmp_path_factory, built) -> dict[str, Path]:
    """The tiny model through onnxruntime-genai's builder (what `auto` falls back to for families
    ortforge's exporter does not write) and the optimize stage."""
    from tasks import export, optimize
    from tasks.core.params import ExportConfig, OptimizeConfig

    root = tmp_path_factory.mktemp("genai")
    out = {"hf": built["hf"], "onnx": root / "onnx", "optimized": root / "optimized"}
    export.run(ExportConfig(), "genai", built["hf"], out["onnx"])
    optimize.run(OptimizeConfig(model_type="none"), out["onnx"], built["hf"], out["optimized"])
    return out


@pytest.fixture(scope="session")
def built_optimum(tmp_path_factory, built, params) -> dict[str, Path]:
    """The tiny model through optimum's exporter and onnxruntime's fusions, and its fp32 variant."""
    from tasks import export, optimize, quantize
    from tasks.core.params import ExportConfig, OptimizeConfig
    from tasks.quantization.configs import quantize_config

    root = tmp_path_factory.mktemp("optimum")
    out = {"hf": built["hf"], "onnx": root / "onnx", "optimized": root / "optimized", "fp32": root / "fp32"}
    export.run(ExportConfig(), "optimum", built["hf"], out["onnx"])
    optimize.run(OptimizeConfig(model_type="gpt2"), out["onnx"], built["hf"], out["optimized"])
    quantize.run(quantize_config(method="fp32"), out["optimized"], built["hf"], out["fp32"], {"model": "tiny"})
    return out


@pytest.fixture
def project(tmp_path, tiny_hf) -> Path:
    return make_project(tmp_path / "repo", tiny_hf)


def dvc(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, capture_output=True, text=True)
    if check:
        assert result.returncode == 0, f"dvc {' '.join(args)}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def dvc_repro(project: Path, *args: str) -> list[str]:
    """Run `dvc repro`; return the stages whose commands executed."""
    return re.findall(r"Running stage '([^']+)'", dvc(project, "repro", *args).stdout)


def git(project: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=project, check=True, capture_output=True, text=True).stdout


def set_param(project: Path, keys: list[str], value, file: str = "params.yaml") -> None:
    params = read_params(project, file)
    node = params
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    write_project_params(project, params, file)


@pytest.fixture(scope="session")
def pushed(tmp_path_factory, first_build) -> Path:
    """A tiny-model project built once, committed, and pushed to its default remote."""
    project = copy_project(first_build[0], tmp_path_factory.mktemp("cache") / "origin")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "build")
    dvc(project, "push")
    return project


def fresh_clone(origin: Path, name: str) -> Path:
    clone = origin.parent / name
    git(origin.parent, "clone", "-q", str(origin), str(clone))
    return clone


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3-compatible server on 127.0.0.1, with the bucket the project's s3 remote names."""
    import boto3

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test")
        for _ in range(100):
            try:
                client.create_bucket(Bucket="ortforge-cache")
                break
            except Exception:  # not listening yet
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def use_s3(project: Path, endpoint: str) -> None:
    dvc(project, "remote", "modify", "--local", "s3", "endpointurl", endpoint)
    dvc(project, "remote", "modify", "--local", "s3", "access_key_id", "test")
    dvc(project, "remote", "modify", "--local", "s3", "secret_access_key", "test")


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real `prefect server start` on 127.0.0.1 with its own home."""
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home")),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_for(lambda: urllib.request.urlopen(f"{url}/health", timeout=2).status == 200, seconds=180)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_for(ready, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready after {seconds} s")


def prefect_records() -> list[str]:
    """Every log line and artifact the Prefect server holds, as text."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def read_all() -> list[str]:
        texts: list[str] = []
        async with get_client() as client:
            for read in (client.read_logs, client.read_artifacts):
                offset = 0
                while page := await read(limit=200, offset=offset):
                    texts += [record.model_dump_json() for record in page]
                    offset += len(page)
        return texts

    return asyncio.run(read_all())


def assert_batched_decode_equals_batch_1(folder) -> None:
    """Three prompts of different lengths prefilled into one BatchDecoder and stepped together
    greedily give each prompt's batch-1 tokens."""
    import numpy as np

    from ortforge.batch import BatchDecoder
    from ortforge.generate import TextGenerator

    generator = TextGenerator(folder)
    prompts = [generator.encode(text) for text in ("Free software", "You", "the freedom to share and change all")]
    batch = BatchDecoder(generator.session, slots=3)
    tokens = {row: int(np.argmax(batch.prefill(row, ids))) for row, ids in enumerate(prompts)}
    produced = {row: [token] for row, token in tokens.items()}
    for _ in range(6):
        logits = batch.step(tokens)
        tokens = {row: int(np.argmax(logits[i])) for i, row in enumerate(sorted(tokens))}
        for row, token in tokens.items():
            produced[row].append(token)
    for row, ids in enumerate(prompts):
        assert produced[row] == list(generator.generate_ids(ids, max_new_tokens=7))

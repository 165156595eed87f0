"""A model's source is a dependency of its download stage: editing a file of a local folder or a
GGUF file makes download stale, in `dvc status` as in `ortforge status`."""

from __future__ import annotations

import json
import shutil

import pytest

from tests import tiny_models
from tests.conftest import dvc, dvc_repro, make_project, set_param

pytestmark = pytest.mark.e2e


def stale(project) -> set[str]:
    return set(json.loads(dvc(project, "status", "--json", "download@tiny").stdout))


def test_editing_a_file_of_a_local_source_makes_download_stale(tmp_path, tiny_hf):
    source = tmp_path / "my-model"
    shutil.copytree(tiny_hf, source)
    project = make_project(tmp_path / "repo", source)
    assert dvc_repro(project, "download@tiny") == ["download@tiny"]
    assert stale(project) == set()

    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-6}))
    assert stale(project) == {"download@tiny"}
    assert dvc_repro(project, "download@tiny") == ["download@tiny"]
    assert json.loads((project / "artifacts/tiny/hf/config.json").read_text())["rms_norm_eps"] == 1e-6


def test_editing_a_gguf_source_makes_download_stale(tmp_path, tiny_hf):
    gguf = tiny_models.write_gguf(tiny_hf, tmp_path / "tiny.gguf")
    project = make_project(tmp_path / "repo", tiny_hf)
    set_param(project, ["models", "tiny", "source"], {"kind": "gguf", "path": str(gguf)})
    assert dvc_repro(project, "download@tiny") == ["download@tiny"]
    assert stale(project) == set()

    tiny_models.write_gguf(tiny_hf, gguf, add_bos=True)  # the same weights, another tokenizer flag
    assert stale(project) == {"download@tiny"}

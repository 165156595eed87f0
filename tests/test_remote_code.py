"""A model whose config and modeling code ship with it (auto_map), opted in with
models.<name>.trust_remote_code: true. Download records the answer in the folder's source.json and
every later stage that loads the model takes it from there, so a model download accepted is not
refused by reference, optimize or quantize; without the opt-in they refuse in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tasks.core import paths
from tasks.core.errors import StageError

CUSTOM_TYPE = "ortforge_remote_llama"
CONFIG_CODE = f"""from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "{CUSTOM_TYPE}"
"""
MODELING_CODE = """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
"""


def with_own_code(tiny_hf: Path, dest: Path) -> Path:
    """The tiny LLaMA under a model type transformers does not know, with its own Python."""
    shutil.copytree(tiny_hf, dest)
    config = json.loads((dest / "config.json").read_text())
    config["model_type"] = CUSTOM_TYPE
    config["architectures"] = ["RemoteLlamaForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteLlamaConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM",
    }
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "configuration_remote.py").write_text(CONFIG_CODE)
    (dest / "modeling_remote.py").write_text(MODELING_CODE)
    return dest


@pytest.fixture(scope="module")
def downloaded(tiny_hf, tmp_path_factory):
    from tasks import download
    from tasks.core.params import Params
    from tests.conftest import tiny_params

    root = tmp_path_factory.mktemp("remote")
    params = tiny_params(with_own_code(tiny_hf, root / "src"))
    params["models"]["tiny"]["trust_remote_code"] = True
    download.run(Params.model_validate(params).model("tiny"), root / "hf")
    return root / "hf", Params.model_validate(params)


def test_download_records_the_opt_in_and_keeps_the_code(downloaded):
    hf, _ = downloaded
    assert paths.remote_code_allowed(hf)
    assert (hf / "modeling_remote.py").is_file() and (hf / "configuration_remote.py").is_file()


def test_later_stages_load_the_model_with_the_recorded_opt_in(downloaded, tiny_hf, tmp_path):
    from tasks import reference
    from tasks.evaluation.torch_decoder import TorchDecoder
    from tasks.graphs import architecture

    hf, params = downloaded
    assert architecture.read(hf).model_type == CUSTOM_TYPE  # optimize's and quantize's reading
    ids = list(range(3, 19))
    custom, plain = TorchDecoder(hf), TorchDecoder(tiny_hf)
    got, _ = custom.forward(ids, custom.empty_cache())
    expected, _ = plain.forward(ids, plain.empty_cache())
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)  # the same weights under its own class
    reference.run(params.validation.eval, hf, tmp_path / "reference")  # the whole reference stage
    assert any((tmp_path / "reference").iterdir())


def test_without_the_opt_in_a_stage_refuses_in_one_line(downloaded, tmp_path):
    from tasks.graphs import architecture

    hf, _ = downloaded
    refused = shutil.copytree(hf, tmp_path / "hf")
    record = json.loads((refused / paths.SOURCE_FILE).read_text())
    (refused / paths.SOURCE_FILE).write_text(json.dumps(record | {"trust_remote_code": False}))
    assert not paths.remote_code_allowed(refused)
    with pytest.raises(StageError) as error:
        architecture.read(refused)
    assert "\n" not in str(error.value) and "trust_remote_code" in str(error.value)

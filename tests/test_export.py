"""export: a KV-cache graph with the standard names; unsupported input stops before torch loads."""

from __future__ import annotations

import json
import shutil

import pytest

from ortforge import names
from tasks import export, onnx_io
from tasks.params import ExportConfig
from tasks.stage import StageError


def test_run_writes_graph_with_standard_kv_names(built):
    graph = onnx_io.load(built["onnx"], with_weights=False)
    inputs = [i.name for i in graph.graph.input]
    outputs = [o.name for o in graph.graph.output]
    assert inputs == [names.INPUT_IDS, names.ATTENTION_MASK, names.POSITION_IDS, *names.past_names(2)]
    assert outputs == [names.LOGITS, *names.present_names(2)]
    dims = [d.dim_param for d in graph.graph.input[3].type.tensor_type.shape.dim]
    assert dims[0] == names.BATCH and dims[2] == names.PAST_SEQUENCE


def test_run_refuses_unsupported_architecture(built, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(built["hf"], hf)
    config = json.loads((hf / "config.json").read_text())
    config["model_type"] = "mystery-net"
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(StageError, match="model_type `mystery-net` .* cannot be exported with a KV cache"):
        export.run(ExportConfig(), hf, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_run_refuses_folder_without_config(tmp_path):
    with pytest.raises(StageError, match="has no config.json; run the download stage first"):
        export.run(ExportConfig(), tmp_path, tmp_path / "onnx")

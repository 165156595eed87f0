"""export: a KV-cache graph with the standard names from either exporter; unsupported input stops
before anything heavy loads."""

from __future__ import annotations

import json
import shutil

import pytest

from ortforge import names
from tasks import export, onnx_io
from tasks.params import ExportConfig
from tasks.stage import StageError


def test_optimum_graph_has_standard_kv_names(built_optimum):
    graph = onnx_io.load(built_optimum["onnx"], with_weights=False)
    inputs = [i.name for i in graph.graph.input]
    outputs = [o.name for o in graph.graph.output]
    assert inputs == [names.INPUT_IDS, names.ATTENTION_MASK, names.POSITION_IDS, *names.past_names(2)]
    assert outputs == [names.LOGITS, *names.present_names(2)]
    dims = [d.dim_param for d in graph.graph.input[3].type.tensor_type.shape.dim]
    assert dims[0] == names.BATCH and dims[2] == names.PAST_SEQUENCE


def test_genai_graph_has_standard_kv_names_and_fused_attention(built):
    graph = onnx_io.load(built["onnx"], with_weights=False)
    inputs = {i.name for i in graph.graph.input}
    outputs = {o.name for o in graph.graph.output}
    assert {names.INPUT_IDS, names.ATTENTION_MASK, *names.past_names(2)} == inputs
    assert outputs == {names.LOGITS, *names.present_names(2)}
    ops = onnx_io.op_counts(graph)
    assert ops["GroupQueryAttention"] == 2 and ops["SkipSimplifiedLayerNormalization"] >= 2
    assert sum(ops.values()) < 100  # a handful of nodes per layer, no shape arithmetic


def with_config(built, tmp_path, **changes):
    hf = tmp_path / "hf"
    shutil.copytree(built["hf"], hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | changes))
    return hf


@pytest.mark.parametrize("exporter", ["optimum", "genai"])
def test_run_refuses_unsupported_architecture(built, tmp_path, exporter):
    hf = with_config(built, tmp_path, model_type="mystery-net")
    with pytest.raises(StageError, match="model_type `mystery-net`"):
        export.run(ExportConfig(exporter=exporter), hf, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_genai_refuses_architecture_its_builder_lacks(built, tmp_path):
    hf = with_config(built, tmp_path, architectures=["BertForMaskedLM"])
    with pytest.raises(StageError, match=r"\(BertForMaskedLM\) .* or set export.exporter: optimum"):
        export.run(ExportConfig(exporter="genai"), hf, tmp_path / "onnx")


def test_run_refuses_folder_without_config(tmp_path):
    with pytest.raises(StageError, match="has no config.json; run the download stage first"):
        export.run(ExportConfig(), tmp_path, tmp_path / "onnx")

"""optimize: onnxruntime's fusions on optimum's graph, recorded as op counts before and after; a
fused graph kept as exported (genai's with its rotary tables computed at load), its weights linked,
not copied."""

from __future__ import annotations

import json

from onnx import numpy_helper

from tasks import optimize
from tasks.core.params import OptimizeConfig
from tasks.graphs import onnx_io


def test_fuse_records_fusions_and_op_counts(built_optimum, tmp_path):
    result = optimize.run(OptimizeConfig(model_type="gpt2"), built_optimum["onnx"], built_optimum["hf"], tmp_path / "o")
    assert result.fused.get("SkipSimplifiedLayerNormalization", 0) >= 2
    assert result.ops_after.get("SkipSimplifiedLayerNormalization") == result.fused["SkipSimplifiedLayerNormalization"]
    assert sum(result.ops_after.values()) < sum(result.ops_before.values())
    saved = onnx_io.op_counts(onnx_io.load(tmp_path / "o", with_weights=False))
    assert saved == result.ops_after
    summary = optimize.summary(result)
    assert summary["nodes_before"] > summary["nodes_after"]
    graph = onnx_io.load(tmp_path / "o", with_weights=False)
    assert "com.microsoft" in {opset.domain for opset in graph.opset_import}


def test_model_type_none_keeps_the_graph_but_computes_rotary_tables(built_genai, tmp_path):
    built = built_genai
    result = optimize.run(OptimizeConfig(model_type="none"), built["onnx"], built["hf"], tmp_path / "o")
    assert result.fused == {}
    computed = {"Range": 1, "Unsqueeze": 1, "Mul": 2, "Cos": 1, "Sin": 1}  # one table pair, from 8 frequencies
    assert result.ops_after == {op: result.ops_before.get(op, 0) + computed.get(op, 0) for op in result.ops_after}
    [pair] = result.rotary_computed
    assert pair["tables"] == ["cos_cache", "sin_cache"] and pair["max_abs_diff"] <= 1e-6
    graph = onnx_io.load(tmp_path / "o", with_weights=False)
    assert not {"cos_cache", "sin_cache"} & {t.name for t in graph.graph.initializer}


def test_model_type_none_links_the_weights_instead_of_copying_them(built, tmp_path):
    result = optimize.run(OptimizeConfig(model_type="none"), built["onnx"], built["hf"], tmp_path / "o")
    assert result.fused == {} and result.ops_after == result.ops_before and result.rotary_computed == []
    for path in built["onnx"].glob("*.safetensors"):  # ortforge's graph reads the checkpoint's own file
        assert (tmp_path / "o" / path.name).stat().st_ino == path.stat().st_ino


def test_rotary_tables_cut_to_model_context(built_optimum):
    graph = onnx_io.load(built_optimum["optimized"])
    context = json.loads((built_optimum["hf"] / "config.json").read_text())["max_position_embeddings"]
    tables = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer if t.name in ("cos_cache", "sin_cache")}
    assert set(tables) == {"cos_cache", "sin_cache"}
    assert all(table.shape[0] == context for table in tables.values())

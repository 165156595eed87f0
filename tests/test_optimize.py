"""optimize: fusions applied and recorded as op counts before and after."""

from __future__ import annotations

from tasks import onnx_io, optimize
from tasks.params import OptimizeConfig


def test_run_records_fusions_and_op_counts(built, tmp_path):
    result = optimize.run(OptimizeConfig(), built["onnx"], built["hf"], tmp_path / "opt")
    assert result.fused.get("SkipSimplifiedLayerNormalization", 0) >= 2
    assert result.ops_after.get("SkipSimplifiedLayerNormalization") == result.fused["SkipSimplifiedLayerNormalization"]
    assert sum(result.ops_after.values()) < sum(result.ops_before.values())
    saved = onnx_io.op_counts(onnx_io.load(tmp_path / "opt", with_weights=False))
    assert saved == result.ops_after
    summary = optimize.summary(result)
    assert summary["nodes_before"] > summary["nodes_after"]


def test_saved_graph_declares_microsoft_domain(built):
    graph = onnx_io.load(built["optimized"], with_weights=False)
    assert "com.microsoft" in {opset.domain for opset in graph.opset_import}


def test_rotary_tables_cut_to_model_context(built):
    import json

    from onnx import numpy_helper

    graph = onnx_io.load(built["optimized"])
    context = json.loads((built["hf"] / "config.json").read_text())["max_position_embeddings"]
    tables = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer if t.name in ("cos_cache", "sin_cache")}
    assert set(tables) == {"cos_cache", "sin_cache"}
    assert all(table.shape[0] == context for table in tables.values())

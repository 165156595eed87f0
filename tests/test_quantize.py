"""quantize: self-contained variant folders with a manifest that proves their content."""

from __future__ import annotations

import pytest

from ortforge import TextGenerator, names
from ortforge.manifest import mismatched_files, read_manifest
from tasks import onnx_io, quantize
from tasks.params import QuantizeConfig
from tasks.stage import StageError


@pytest.mark.parametrize("variant", ["fp32", "int8", "int4"])
def test_run_writes_self_contained_variant(built, variant):
    folder = built[variant]
    manifest = read_manifest(folder)
    assert manifest["variant"] == variant and manifest["source"]["kind"] == "local"
    assert manifest["tool_versions"]["onnxruntime"]
    assert {names.MODEL_FILE, "tokenizer.json", names.GENERATION_CONFIG_FILE} <= set(manifest["files"])
    assert mismatched_files(folder) == []
    assert TextGenerator(folder).generate("the", 3)  # runs on its own, from its folder alone


def test_variants_use_their_quantized_operators(built):
    ops = {v: onnx_io.op_counts(onnx_io.load(built[v], with_weights=False)) for v in ("fp32", "int8", "int4")}
    assert "MatMulNBits" in ops["int4"] and "MatMulNBits" not in ops["fp32"]
    assert "MatMulInteger" in ops["int8"] or "DynamicQuantizeMatMul" in ops["int8"]


def test_manifest_detects_a_modified_file(built, tmp_path):
    import shutil

    copy = tmp_path / "int4"
    shutil.copytree(built["int4"], copy)
    with open(copy / "tokenizer.json", "a", encoding="utf-8") as handle:
        handle.write(" ")
    assert mismatched_files(copy) == ["tokenizer.json"]


def test_fp16_variant_keeps_float32_interface(built, tmp_path):
    result = quantize.run(QuantizeConfig(method="fp16"), built["optimized"], built["hf"], tmp_path / "fp16", {})
    graph = onnx_io.load(result.out_dir, with_weights=False)
    assert graph.graph.input[3].type.tensor_type.elem_type == 1  # FLOAT
    assert TextGenerator(result.out_dir).generate("the", 3)


def test_run_requires_optimized_model(built, tmp_path):
    with pytest.raises(StageError, match="has no model.onnx; run the optimize stage first"):
        quantize.run(QuantizeConfig(method="fp32"), tmp_path, built["hf"], tmp_path / "out", {})
    assert not (tmp_path / "out").exists()

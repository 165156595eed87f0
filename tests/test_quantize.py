"""quantize: self-contained variant folders with a manifest that proves their content."""

from __future__ import annotations

import pytest

from ortforge import TextGenerator, names
from ortforge.manifest import mismatched_files, read_manifest
from tasks import quantize
from tasks.core.stage import StageError
from tasks.graphs import onnx_io
from tasks.quantization.configs import quantize_config


@pytest.mark.parametrize("variant", ["fp32", "int8", "int4"])
def test_run_writes_self_contained_variant(built, variant):
    folder = built[variant]
    manifest = read_manifest(folder)
    assert manifest["variant"] == variant and manifest["source"]["kind"] == "local"
    assert manifest["tool_versions"]["onnxruntime"]
    # weights in external data: onnxruntime reads them straight into place (a lower load peak)
    data = names.MODEL_FILE + ".data"
    assert {names.MODEL_FILE, data, "tokenizer.json", names.GENERATION_CONFIG_FILE} <= set(manifest["files"])
    assert (folder / data).stat().st_mode == (folder / names.MODEL_FILE).stat().st_mode
    assert mismatched_files(folder) == []
    assert TextGenerator(folder).generate("the", 3)  # runs on its own, from its folder alone


def test_variants_use_their_quantized_operators(built):
    ops = {v: onnx_io.op_counts(onnx_io.load(built[v], with_weights=False)) for v in ("fp32", "int8", "int4")}
    assert "MatMulNBits" in ops["int4"] and "MatMulNBits" not in ops["fp32"]
    graph = onnx_io.load(built["int8"], with_weights=False)
    assert {a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"} == {8}


@pytest.mark.parametrize(
    "cfg, operator",
    [
        (quantize_config(method="int8_dynamic"), "DynamicQuantizeMatMul"),
        (quantize_config(method="int8_static", calibrate="minmax"), "QuantizeLinear"),
        (
            quantize_config(
                method="int8_static", calibrate="percentile", keep_float=("down_proj",), max_float_share=0.5
            ),
            "QuantizeLinear",
        ),
    ],
    ids=["dynamic", "static-minmax", "static-percentile-keep-down"],
)
def test_onnxruntime_int8_recipes_build_running_variants(built, tmp_path, cfg, operator):
    from tasks.core.params import CalibrationConfig
    from tests.conftest import REPO

    calibration = CalibrationConfig(text=REPO / "data/calibration/python-docs.txt", samples=2, tokens=32)
    result = quantize.run(cfg, built["optimized"], built["hf"], tmp_path / "v", {}, calibration)
    graph = onnx_io.load(result.out_dir, with_weights=False)
    ops = onnx_io.op_counts(graph)
    assert operator in ops or "MatMulInteger" in ops
    producers = {out: n.op_type for n in graph.graph.node for out in n.output}

    def float_matmul(node):  # QDQ keeps the op a MatMul but feeds it dequantized weights
        return node.op_type == "MatMul" and producers.get(node.input[1]) != "DequantizeLinear"

    down = [n for n in graph.graph.node if "down_proj" in n.name and "MatMul" in n.op_type]
    assert down and all(float_matmul(n) for n in down) == bool(cfg.keep_float)
    assert TextGenerator(result.out_dir).generate("the", 3)


def test_run_checks_calibration_text_before_quantizing(built, tmp_path):
    from tasks.core.params import CalibrationConfig

    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(StageError, match="short.txt has .* tokens, fewer than samples x tokens"):
        quantize.run(
            quantize_config(method="int8_static"),
            built["optimized"],
            built["hf"],
            tmp_path / "v",
            {},
            CalibrationConfig(text=short),
        )
    assert not (tmp_path / "v").exists()


def test_manifest_detects_a_modified_file(built, tmp_path):
    import shutil

    copy = tmp_path / "int4"
    shutil.copytree(built["int4"], copy)
    with open(copy / "tokenizer.json", "a", encoding="utf-8") as handle:
        handle.write(" ")
    assert mismatched_files(copy) == ["tokenizer.json"]


def test_fp16_variant_keeps_float32_interface(built, tmp_path):
    result = quantize.run(quantize_config(method="fp16"), built["optimized"], built["hf"], tmp_path / "fp16", {})
    graph = onnx_io.load(result.out_dir, with_weights=False)
    assert graph.graph.input[3].type.tensor_type.elem_type == 1  # FLOAT
    assert TextGenerator(result.out_dir).generate("the", 3)


def test_run_requires_optimized_model(built, tmp_path):
    with pytest.raises(StageError, match="has no model.onnx; run the optimize stage first"):
        quantize.run(quantize_config(method="fp32"), tmp_path, built["hf"], tmp_path / "out", {})
    assert not (tmp_path / "out").exists()

"""A variant is what its name says: the precision of every weight matrix is read from the graph,
recorded by quantize, and checked by validate against what the variant's params asked; layers
the asked block size does not fit get one that does, or the model is refused before any work."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from ortforge.manifest import read_manifest
from tasks import quantize, validate
from tasks.core.params import CalibrationConfig
from tasks.core.stage import StageError
from tasks.graphs import onnx_io
from tasks.quantization import coverage, layers, weight_only
from tasks.quantization.configs import quantize_config
from tests import tiny_models
from tests.conftest import EVAL_TEXT, REPO, tiny_params

CALIBRATION = CalibrationConfig(text=REPO / "data/calibration/python-docs.txt", samples=2, tokens=32)


@pytest.mark.parametrize("variant, bits", [("fp32", 32), ("int8", 8), ("int4", 4)])
def test_manifest_records_every_matrix_at_the_variants_width(built, variant, bits):
    table = read_manifest(built[variant])["coverage"]
    assert set(table) == {"linear", "output", "embedding"}
    for role in table:
        assert set(table[role]) == {str(bits)}, role  # the tied embedding reads the output layer's codes
    found = coverage.weights(onnx_io.load(built[variant], with_weights=False))
    embedding = [w for w in found if w.role == "embedding"]
    assert len(embedding) == 1 and embedding[0].shared and embedding[0].stored_bytes == 0  # stored once


def test_int8_recipe_records_what_its_params_keep_float(built, params, tmp_path):
    cfg = quantize_config(method="int8_dynamic", keep_float=("down_proj",), max_float_share=0.5)
    result = quantize.run(cfg, built["optimized"], built["hf"], tmp_path / "v", {}, CALIBRATION)
    manifest = read_manifest(result.out_dir)
    assert manifest["kept_float"] and all("down_proj" in node for node in manifest["kept_float"])
    found = coverage.weights(onnx_io.load(result.out_dir, with_weights=False))
    checked = coverage.against_recipe(cfg, found, manifest["kept_float"])
    assert (checked["share_as_asked"], checked["not_as_asked"]) == (1.0, [])
    down = sum(w.parameters for w in found if "down_proj" in w.node)
    matmuls = sum(w.parameters for w in found if w.role != "embedding")
    assert set(checked["kept_float"]["matrices"]) == {w.node for w in found if "down_proj" in w.node}
    assert checked["kept_float"]["share"] == pytest.approx(down / matmuls)
    assert checked["quantized_share"] == pytest.approx(1 - down / matmuls)
    assert {w.bits for w in found if w.role == "linear" and "down_proj" not in w.node} == {8}
    # What a recipe keeps float is capped by its own max_float_share: above it, the variant fails.
    loose = params.thresholds("tiny", "int4").model_copy(update={"ppl_ratio": 10.0, "kl_divergence": 10.0})
    capped = validate.Asked(cfg.model_copy(update={"max_float_share": 0.01}), loose)
    with pytest.raises(validate.ValidationFailed, match=r"kept_float_share 0\.\d+ > 0\.01"):
        validate.run(params.validation.eval, capped, result.out_dir, built["reference"], tmp_path / "v.json", "x")


def test_a_linear_left_float_fails_validation_naming_it(built, params, tmp_path, monkeypatch):
    every = layers.linear_layers
    monkeypatch.setattr(weight_only, "linear_layers", lambda model: every(model)[1:])  # a quantizer that misses one
    skipped = every(onnx_io.load(built["optimized"], with_weights=False))[0].node.name
    out = tmp_path / "int4"
    quantize.run(params.variant("int4"), built["optimized"], built["hf"], out, {"model": "tiny"})
    loose = params.thresholds("tiny", "int4").model_copy(update={"ppl_ratio": 10.0, "kl_divergence": 10.0})
    with pytest.raises(validate.ValidationFailed) as error:
        asked = validate.Asked(params.variant("int4"), loose)
        validate.run(params.validation.eval, asked, out, built["reference"], tmp_path / "v.json", "int4")
    message = str(error.value)
    assert "coverage 0." in message and f"{skipped} (MatMul, 32-bit, asked 4)" in message


def optimized_model(tmp_path, **config):
    """A tiny LLaMA of the given dimensions through download, export and optimize."""
    from tasks import download, export, optimize
    from tasks.core.params import Params

    params = Params.model_validate(tiny_params(tiny_models.build_hf_model(tmp_path / "src", EVAL_TEXT, **config)))
    download.run(params.model("tiny"), tmp_path / "hf")
    export.run(params.export, "auto", tmp_path / "hf", tmp_path / "onnx")
    optimize.run(params.optimize, tmp_path / "onnx", tmp_path / "hf", tmp_path / "optimized")


def test_hidden_size_the_block_does_not_divide_gets_a_smaller_block(tmp_path):
    optimized_model(tmp_path, hidden_size=96, num_attention_heads=6, intermediate_size=128)
    cfg = quantize_config(method="weight_only", block_size=64)
    quantize.run(cfg, tmp_path / "optimized", tmp_path / "hf", tmp_path / "v", {"model": "odd"})
    manifest = read_manifest(tmp_path / "v")
    assert manifest["coverage"]["linear"] == {"4": manifest["coverage"]["linear"]["4"]}  # every linear at 4 bits
    assert any("block 32 (K=96 is not a multiple of 64)" in note for note in manifest["notes"])
    found = coverage.weights(onnx_io.load(tmp_path / "v", with_weights=False))
    checked = coverage.against_recipe(cfg, found, {})
    assert (checked["share_as_asked"], checked["not_as_asked"]) == (1.0, [])


def test_a_k_no_block_divides_is_refused_before_work(tmp_path):
    optimized_model(tmp_path, intermediate_size=72)  # down_proj reads 72 = 8 x 9 inputs
    with pytest.raises(StageError, match="has K=72 inputs, which no block of 16 or more divides"):
        quantize.run(quantize_config(method="weight_only"), tmp_path / "optimized", tmp_path / "hf", tmp_path / "v", {})
    assert not (tmp_path / "v").exists()


def test_a_tied_lookup_left_float_beside_int4_codes_fails_coverage(built, params, tmp_path):
    """The lookup counts: an int4 variant whose tied embedding is read from a float copy stores the
    vocabulary matrix twice, and validate names it, although every matmul is at 4 bits."""
    from onnx import helper, numpy_helper

    out = tmp_path / "int4"
    shutil.copytree(built["int4"], out)
    graph = onnx_io.load(out, with_weights=False)
    lookup = next(node for node in graph.graph.node if node.op_type == "GatherBlockQuantized")
    head = next(w.node for w in coverage.weights(graph) if w.role == "output")
    output = next(node for node in graph.graph.node if node.name == head)
    sizes = {a.name: a.i for a in output.attribute}
    table = np.zeros((sizes["N"], sizes["K"]), dtype=np.float32)
    graph.graph.initializer.append(numpy_helper.from_array(table, "embedding.float_copy"))
    float_lookup = helper.make_node(
        "Gather", ["embedding.float_copy", lookup.input[1]], list(lookup.output), name="float_lookup"
    )
    nodes = [float_lookup if node is lookup else node for node in graph.graph.node]
    del graph.graph.node[:]
    graph.graph.node.extend(nodes)
    onnx.save(graph, str(out / "model.onnx"))
    checked = validate.measure_coverage(out, params.variant("int4"))
    assert checked["share_as_asked"] < 1.0
    assert checked["not_as_asked"] == ["float_lookup (Gather, 32-bit, asked 4)"]
    assert validate.measure_coverage(built["int4"], params.variant("int4"))["not_as_asked"] == []


def test_a_dense_graph_has_no_routers_whatever_its_names(built):
    """Only a graph with MoE layers keeps its `gate` matmuls float as routers: in a dense graph a
    module that happens to be called `gate` is a linear like any other, quantized and asked so."""
    graph = onnx_io.load(built["fp32"], with_weights=False)
    node = next(n for n in graph.graph.node if n.op_type == "MatMul" and "/mlp/" in n.name)
    node.name = "/model/layers.0/mlp/gate/MatMul"
    assert coverage.routers(graph) == set()
    assert node.name in {linear.node.name for linear in layers.linear_layers(graph)}
    assert next(w for w in coverage.weights(graph) if w.node == node.name).role == "linear"

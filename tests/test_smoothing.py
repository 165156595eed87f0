"""SmoothQuant rescaling changes the weights, never the float model's function; outlier tokens are
measured per tensor; and the int8 recipe that uses both builds a running variant."""

from __future__ import annotations

import numpy as np
import pytest

from ortforge import Decoder, TextGenerator, create_session, names
from ortforge.manifest import read_manifest
from tasks import quantize
from tasks.core.params import CalibrationConfig
from tasks.evaluation.metrics import full_pass_logits
from tasks.graphs import architecture, onnx_io
from tasks.quantization import calibration, smoothing
from tasks.quantization.configs import needs_calibration, quantize_config
from tests.conftest import REPO

CALIBRATION = CalibrationConfig(text=REPO / "data/calibration/python-docs.txt", samples=2, tokens=32)


def logits_of(folder, ids, hf):
    """Full-pass logits of an unquantized graph, which carries no runtime metadata yet."""
    decoder = Decoder(create_session(folder), head_dim=architecture.read(hf).head_dim, layout=names.KV_SHARED)
    return full_pass_logits(decoder, ids)


@pytest.fixture(scope="module")
def float_dir(built, tmp_path_factory):
    """The optimized graph with plain float32 weights, as onnxruntime's int8 recipes get it
    (tasks.quantize.float_graph folds the checkpoint's tensors read through Transpose nodes)."""
    from tasks.graphs.weights import ExternalData

    folder = tmp_path_factory.mktemp("float")
    onnx_io.save_graph_only(quantize.float_graph(built["optimized"], ExternalData(folder, "model.onnx.data")), folder)
    return folder


def test_groups_cover_norm_and_gated_inputs_but_not_the_tied_output_layer(float_dir):
    model = onnx_io.load(float_dir, with_weights=False)
    groups = smoothing.smoothable_groups(model)
    layers = sum(1 for n in model.graph.node if n.op_type == "GroupQueryAttention")
    # per layer: the norm before q/k/v, the norm before gate/up, the gated product before down
    assert sum(g.producer_is_norm for g in groups) == 2 * layers
    assert sum(not g.producer_is_norm for g in groups) == layers
    consumers = {name for g in groups for name in g.consumers}
    assert not any("lm_head" in name for name in consumers)  # its weight is the embedding's too


def test_smoothing_keeps_the_float_model_equal(built, float_dir, tmp_path):
    from onnx.numpy_helper import to_array

    model = onnx_io.load(float_dir)
    widths = {t.name: t.dims[0] for t in model.graph.initializer if t.dims}
    rng = np.random.default_rng(0)  # channel ranges spread over three decades, like real outliers
    maxima = {g.activation: rng.uniform(0.05, 50, widths[g.consumers[0]]) for g in smoothing.smoothable_groups(model)}
    before = {t.name: to_array(t) for t in model.graph.initializer}
    assert smoothing.smooth(model, maxima, alpha=0.5) == len(maxima) > 0
    changed = [t.name for t in model.graph.initializer if not np.allclose(to_array(t), before[t.name])]
    assert len(changed) >= 2 * len(maxima)  # each group: its consumers and its producer
    folder = tmp_path / "smoothed"
    folder.mkdir()
    onnx_io.save(model, folder)
    ids = np.random.default_rng(1).integers(0, 384, 24)
    np.testing.assert_allclose(
        logits_of(folder, ids, built["hf"]), logits_of(built["optimized"], ids, built["hf"]), atol=2e-4
    )


def test_outlier_ratio_is_the_peak_token_against_the_median_token():
    ranges = calibration.Ranges(np.ones(4), np.array([1000.0, 1.0, 2.0, 1.0, 3.0]))
    assert ranges.outlier_ratio == pytest.approx(500.0)


def test_smoothed_int8_recipe_builds_a_running_variant(built, float_dir, tmp_path):
    cfg = quantize_config(
        method="int8_dynamic",
        weight_type="QInt8",
        per_channel=True,
        smooth_alpha=0.5,
        outlier_ratio=1.5,
        max_float_share=0.9,
    )
    assert needs_calibration(cfg)
    result = quantize.run(cfg, built["optimized"], built["hf"], tmp_path / "v", {}, CALIBRATION)
    graph = onnx_io.load(result.out_dir, with_weights=False)
    ops = onnx_io.op_counts(graph)
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops
    # A low ratio keeps float exactly the linears whose inputs carry outlier tokens, says why, and
    # quantizes every other linear.
    source = onnx_io.load(float_dir, with_weights=False)
    weights = {t.name for t in source.graph.initializer}
    linears = {n.name for n in source.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
    kept = read_manifest(result.out_dir)["kept_float"]
    assert kept and set(kept) < linears
    assert all("the median token's peak (above 1.5)" in why for why in kept.values())
    still_float = {n.name for n in graph.graph.node if n.op_type == "MatMul"}
    assert linears & still_float == set(kept)
    assert TextGenerator(result.out_dir).generate("the", 3)


def test_smoothing_options_belong_to_int8_methods():
    with pytest.raises(ValueError, match="`smooth_alpha` does not apply to method weight_only"):
        quantize_config(method="weight_only", smooth_alpha=0.5)
    with pytest.raises(ValueError, match="outlier_ratio"):
        quantize_config(method="int8_dynamic", outlier_ratio=0.5)
    with pytest.raises(ValueError, match="set max_float_share to the largest share of matmul weights"):
        quantize_config(method="int8_static", keep_float=("down_proj",))

"""weight_only: the codes reproduce what they claim, the graph computes exactly what the codes say
(offset rows, packed siblings and tied embedding included), and each algorithm and mixed precision
takes effect."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from onnx import numpy_helper

from ortforge import Decoder, create_session
from tasks.evaluation.metrics import full_pass_logits
from tasks.graphs import onnx_io
from tasks.graphs.weights import WeightStore
from tasks.quantization import codes as block_codes
from tasks.quantization import layers, weight_only
from tasks.quantization.configs import QuantizeConfig, quantize_config

IDS = np.array([5, 17, 99, 250, 3, 7, 11, 200, 42, 8])


def q4_1_grid(rng, k=64, n=48, block=32) -> np.ndarray:
    """Weights as a GGUF Q4_1 file holds them: per block, d * q + m with float16 d and m; like trained
    weights, each block holds values of both signs."""
    blocks = k // block
    d = rng.uniform(0.001, 0.05, (blocks, 1, n)).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(1, 14, (blocks, 1, n))).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (blocks, block, n))
    q[:, 0, :], q[:, 1, :] = 0, 15  # the quantizer puts each block's min and max on the ends
    return (d * q + m).reshape(k, n)


def test_float_zero_points_reproduce_a_q4_1_grid_exactly():
    weights = q4_1_grid(np.random.default_rng(0))
    codes = block_codes.round_to_nearest(weights, bits=4, block=32, zero_point="float")
    np.testing.assert_allclose(codes.dequantize(), weights, atol=1e-6)
    integer = block_codes.round_to_nearest(weights, bits=4, block=32, zero_point="integer")
    assert np.abs(integer.dequantize() - weights).max() > 1e-3  # what rounding the zero point costs


def effective_weights(codes: block_codes.BlockCodes) -> np.ndarray:
    """W that the graph multiplies by: float zero points go through offset rows on block sums."""
    if np.all(codes.zeros == codes.mid) or block_codes.is_integer_grid(codes):
        return codes.dequantize()
    k = codes.codes.shape[1]
    rows = block_codes.offset_rows(codes).dequantize()
    return rows[:k] + np.repeat(rows[k : k + k // codes.block], codes.block, axis=0)


def test_offset_rows_keep_float_zero_points_far_closer_than_rounding_them():
    rng = np.random.default_rng(1)
    weights = q4_1_grid(rng, k=128, n=64)
    codes = block_codes.round_to_nearest(weights, bits=4, block=32, zero_point="float")
    rounded = block_codes.BlockCodes(codes.codes, codes.scales, np.round(codes.zeros), 4, 32)
    x = rng.normal(size=(16, 128))
    exact = x @ weights
    with_rows = np.abs(x @ effective_weights(codes) - exact).mean()
    assert with_rows * 8 < np.abs(x @ rounded.dequantize() - exact).mean()


@pytest.mark.parametrize("zero_point", ["none", "integer", "float"])
@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_error_is_within_half_a_step(zero_point, bits):
    weights = np.random.default_rng(1).standard_normal((64, 40)).astype(np.float32)
    codes = block_codes.round_to_nearest(weights, bits=bits, block=32, zero_point=zero_point)
    step = np.abs(np.repeat(codes.scales, 32, axis=1).T)
    # Symmetric grids are one level short on one side ([-mid, mid - 1]), so values there clip; the
    # float16 scale adds up to 2**-11 of the code's distance from zero (0.07 step at 8 bits).
    allowed = step * ((1.0 if zero_point == "none" else 0.5) + 0.07)
    assert np.all(np.abs(codes.dequantize() - weights) <= allowed)
    assert codes.codes.max() < 2**bits


def test_scales_are_rounded_to_float16_as_numpy_rounds_them():
    rng = np.random.default_rng(3)
    values = rng.standard_normal(20_000) * 10.0 ** rng.integers(-9, 5, 20_000)
    edges = [65504.0, 65519.99, 65520.0, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 1 + 2.0**-11, 0.0]
    values = np.concatenate([values, edges, np.negative(edges)])
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).astype(np.float64)
    assert [block_codes._half(float(v)) for v in values] == expected.tolist()


def reference_round_to_nearest(weights: np.ndarray, bits: int, block: int, zero_point: str):
    """Min/max round-to-nearest written plainly in numpy, float64 throughout."""
    k, n = weights.shape
    blocks = weights.T.reshape(n, k // block, block).astype(np.float64)
    lo, hi, levels = blocks.min(-1), blocks.max(-1), 2**bits - 1
    if zero_point == "none":
        signed_max = np.where(-lo > hi, lo, hi)
        scales = np.where(signed_max != 0, signed_max / -(2 ** (bits - 1)), 1.0)
        zeros = np.full(lo.shape, 2.0 ** (bits - 1))
    else:
        if zero_point == "integer":
            lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
        scales = np.where(hi > lo, (hi - lo) / levels, 1.0)
        zeros = np.clip(np.round(-lo / scales), 0, levels) if zero_point == "integer" else -lo / scales
    scales = scales.astype(np.float16).astype(np.float64)
    codes = np.clip(np.round(blocks / scales[..., None] + zeros[..., None]), 0, levels).astype(np.uint8)
    return codes.reshape(n, k), scales.astype(np.float32), zeros


@pytest.mark.parametrize("zero_point", ["none", "integer", "float"])
@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_round_to_nearest_equals_the_plain_numpy_computation(zero_point, bits):
    rng = np.random.default_rng(4)
    weights = rng.standard_normal((128, 70)).astype(np.float32) * 0.02  # 70 columns: a partial tile
    weights[:, 5] = 0.0  # a block of zeros
    weights[:32, 6] = np.abs(weights[:32, 6])  # a block of one sign
    codes = block_codes.round_to_nearest(weights, bits, 32, zero_point)
    expected = reference_round_to_nearest(weights, bits, 32, zero_point)
    for got, want in zip((codes.codes, codes.scales, codes.zeros), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_importance_search_takes_the_range_with_the_least_weighted_error():
    rng = np.random.default_rng(5)
    weights = rng.standard_normal((64, 48)).astype(np.float32)
    importance = (rng.uniform(0.01, 1.0, 64) ** 4).astype(np.float32)
    searched = block_codes.importance_search(weights, importance, bits=4, block=32, zero_point="float")
    blocks = weights.T.reshape(48, 2, 32)
    h = importance.reshape(1, 2, 32)

    def error(codes) -> np.ndarray:
        dequantized = codes.dequantize().T.reshape(48, 2, 32)
        return (h * (dequantized - blocks) ** 2).sum(-1)

    best = error(searched)
    for shrink in np.linspace(1.0, 0.7, block_codes.SEARCH_STEPS + 1):
        lo, hi = blocks.min(-1) * shrink, blocks.max(-1) * shrink
        scales = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
        zeros = -lo / ((hi - lo) / 15)
        q = np.clip(np.round(blocks / scales[..., None] + zeros[..., None]), 0, 15)
        candidate = (h * ((q - zeros[..., None]) * scales[..., None] - blocks) ** 2).sum(-1)
        assert np.all(best <= candidate * (1 + 1e-5) + 1e-12)


def test_importance_search_lowers_weighted_error():
    rng = np.random.default_rng(2)
    weights = rng.standard_normal((64, 256)).astype(np.float32) * np.where(rng.random((64, 1)) < 0.1, 8.0, 1.0)
    importance = rng.uniform(0.01, 1.0, 64) ** 4
    plain = block_codes.round_to_nearest(weights, bits=4, block=32, zero_point="integer")
    searched = block_codes.importance_search(weights, importance, bits=4, block=32, zero_point="integer")

    def weighted_error(codes):
        return float((importance[:, None] * (codes.dequantize() - weights) ** 2).sum())

    assert weighted_error(searched) < weighted_error(plain)


def weights_swapped_for(model, cfg: QuantizeConfig):
    """The float model with every weight replaced by what its codes dequantize to (float32 graph:
    tasks.quantize.float_graph folds the checkpoint's bfloat16 [out, in] tensors)."""
    model = copy.deepcopy(model)
    store = WeightStore(model, None)
    initializers = {t.name: t for t in model.graph.initializer}
    for linear in layers.linear_layers(model):
        codes = block_codes.round_to_nearest(
            layers.weight_matrix(linear, store), cfg.bits, cfg.block_size, cfg.zero_point
        )
        swapped = effective_weights(codes)
        stored = swapped.T.copy() if linear.transposed else swapped
        initializers[linear.weight_name].CopyFrom(numpy_helper.from_array(stored, linear.weight_name))
    head = layers.output_layer(model)
    zero_point = "none" if cfg.zero_point == "none" else "integer"
    weight = head.weight(store)
    dequantized = block_codes.round_to_nearest(weight, cfg.output_bits, cfg.block_size, zero_point).dequantize()
    stored = initializers[head.weight_initializer]
    # A table stored [vocab, hidden] (read through a Transpose) or the output weight [hidden, vocab].
    array = dequantized if tuple(stored.dims) == dequantized.shape else dequantized.T.copy()
    stored.CopyFrom(numpy_helper.from_array(array, head.weight_initializer))
    return model


def quantize(model, cfg: QuantizeConfig, hessians=None):
    return weight_only.quantize_model(model, cfg, hessians)[0]


def logits_of(model, folder, hf):
    """Logits on IDS through the runtime, the model tagged as the quantize stage tags it."""
    from tasks.graphs import architecture
    from tasks.quantize import tag_for_runtime

    tag_for_runtime(model, architecture.read(hf))
    folder.mkdir()
    onnx_io.save(model, folder)
    return full_pass_logits(Decoder(create_session(folder)), IDS)


@pytest.mark.parametrize("zero_point", ["float", "integer", "none"])
def test_quantized_graph_computes_what_its_codes_say(built, tmp_path, zero_point):
    cfg = quantize_config(method="weight_only", zero_point=zero_point, accuracy_level=0)
    optimized = onnx_io.load(built["optimized"])
    quantized = quantize(copy.deepcopy(optimized), cfg)
    expected = logits_of(weights_swapped_for(optimized, cfg), tmp_path / "simulated", built["hf"])
    got = logits_of(quantized, tmp_path / "quantized", built["hf"])
    np.testing.assert_allclose(got, expected, atol=2e-3)
    assert np.abs(got - logits_of(optimized, tmp_path / "float", built["hf"])).max() > 1e-3  # it did quantize


def test_tied_vocabulary_is_stored_once(built):
    model = quantize(onnx_io.load(built["optimized"]), quantize_config(method="weight_only"))
    vocab, hidden = 384, 64
    vocab_sized = {t.name for t in model.graph.initializer if t.dims and t.dims[0] == vocab}
    assert vocab_sized == {"lm_head/q", "lm_head/scales_fp16", "lm_head/zero_points"}
    assert not [t for t in model.graph.initializer if np.prod(t.dims) >= vocab * hidden and t.name != "lm_head/q"]
    ops = {n.op_type for n in model.graph.node}
    assert {"GatherBlockQuantized", "MatMulNBits"} <= ops
    assert "/model/embed_tokens/Gather" not in {n.name for n in model.graph.node}
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    reshape = next(n for n in model.graph.node if n.output[0] == gather.input[0])
    assert reshape.input[0] == "lm_head/q"


def test_block_sums_only_for_float_zero_points(built):
    optimized = onnx_io.load(built["optimized"])
    for zero_point, offsets in (("float", True), ("integer", False), ("none", False)):
        model = quantize(copy.deepcopy(optimized), quantize_config(method="weight_only", zero_point=zero_point))
        concats = [n for n in model.graph.node if n.name.endswith("/block_sum32/Concat")]
        assert bool(concats) is offsets, zero_point
        assert "MatMul" not in {n.op_type for n in model.graph.node}  # the offsets ride in MatMulNBits


def test_eight_bit_blocks_and_output_bits(built):
    cfg = quantize_config(method="weight_only", output_bits=8, eight_bit_blocks=(0, -1))
    model = quantize(onnx_io.load(built["optimized"]), cfg)
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits")
        for n in model.graph.node
        if n.op_type == "MatMulNBits"
    }
    assert bits["lm_head/MatMulNBits"] == 8
    first = [b for name, b in bits.items() if "/layers.0/" in name]
    last = [b for name, b in bits.items() if "/layers.1/" in name]  # the tiny model has 2 blocks
    assert set(first) == {8} and set(last) == {8}


def test_output_bits_32_keeps_the_float_output_layer(built):
    model = quantize(onnx_io.load(built["optimized"]), quantize_config(method="weight_only", output_bits=32))
    logits = next(n for n in model.graph.node if n.output[0] == "logits")
    assert logits.op_type == "MatMul" and any(n.op_type == "Gather" for n in model.graph.node)


@pytest.mark.parametrize("algorithm, zero_point", [("hqq", "float"), ("gptq", "integer"), ("imatrix", "integer")])
def test_data_aware_and_hqq_algorithms_build_running_models(built, tmp_path, algorithm, zero_point):
    from tasks.core.params import CalibrationConfig
    from tasks.quantization import calibration
    from tests.conftest import REPO

    cfg = quantize_config(method="weight_only", algorithm=algorithm, zero_point=zero_point, output_algorithm="imatrix")
    model = onnx_io.load(built["optimized"])
    chunks = calibration.token_chunks(
        CalibrationConfig(text=REPO / "data/calibration/python-docs.txt", samples=2, tokens=32),
        built["hf"] / "tokenizer.json",
    )
    wanted = layers.calibrated_inputs(model, cfg)
    hessians = calibration.input_hessians(model, wanted, chunks, head_dim=16)
    for name, h in hessians.items():  # GPTQ takes H whole; imatrix its diagonal, sums of squares
        assert (h.shape[0] == h.shape[1]) if wanted[name] == calibration.FULL else h.ndim == 1
        assert np.all((np.diag(h) if h.ndim == 2 else h) >= 0)
    quantized = quantize(model, cfg, hessians)
    logits = logits_of(quantized, tmp_path / algorithm, built["hf"])
    assert np.isfinite(logits).all()


def test_linears_reading_one_input_become_one_matmul(built):
    optimized = onnx_io.load(built["optimized"])
    linears = layers.linear_layers(optimized)
    model = quantize(copy.deepcopy(optimized), quantize_config(method="weight_only"))
    splits = [n for n in model.graph.node if n.op_type == "Split"]
    readers = [n.input[0] for n in model.graph.node if n.op_type == "MatMulNBits" and n.name != "lm_head/MatMulNBits"]
    assert len(readers) == len(set(readers)) == len({linear.node.input[0] for linear in linears}) < len(linears)
    assert {out for split in splits for out in split.output} == {
        linear.node.output[0]
        for group in layers.sibling_groups(linears, layers.layer_blocks(linears, 32)[0])
        if len(group) > 1
        for linear in group
    }


def matmul_attributes(model) -> list[tuple[int, int]]:
    """(bits, accuracy_level) of each MatMulNBits."""
    return [
        (onnx_io.attribute(n, "bits", 4), onnx_io.attribute(n, "accuracy_level", 0))
        for n in model.graph.node
        if n.op_type == "MatMulNBits"
    ]


@pytest.mark.parametrize("bits, zero_point", [(8, "none"), (8, "integer"), (4, "integer")])
def test_float_compute_computes_the_same_weights_in_float32(built, tmp_path, bits, zero_point):
    """Validate's float compute: 8-bit nodes become two 4-bit ones over the same values (onnxruntime's
    8-bit float kernel widens the whole matrix every run), the rest accuracy_level 0; the logits are
    those of the variant computed at accuracy_level 0 (the slow 8-bit kernel), to float rounding."""
    cfg = quantize_config(method="weight_only", bits=bits, zero_point=zero_point, output_bits=8, accuracy_level=4)
    variant = quantize(onnx_io.load(built["optimized"]), cfg)
    exact = quantize(onnx_io.load(built["optimized"]), cfg.model_copy(update={"accuracy_level": 0}))
    nodes = len(matmul_attributes(variant))
    eight_bit = sum(b == 8 for b, _ in matmul_attributes(variant))

    computed = copy.deepcopy(variant)
    assert weight_only.float_compute(computed, WeightStore(computed, None)) == nodes
    assert set(matmul_attributes(computed)) == {(4, 0)}
    assert len(matmul_attributes(computed)) == nodes + eight_bit  # each 8-bit node as two
    planned = weight_only.float_compute_bytes(variant)
    written = sum(t.ByteSize() for t in computed.graph.initializer if "/float_compute/" in t.name)
    assert 0.9 * planned < written < 1.1 * planned + 4096
    got = logits_of(computed, tmp_path / "float_compute", built["hf"])
    expected = logits_of(exact, tmp_path / "accuracy_level_0", built["hf"])
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert np.abs(logits_of(variant, tmp_path / "variant", built["hf"]) - expected).max() > 1e-4  # level 4 differs

"""Per-token int8 (W8A8): every matmul and the tied lookup become integer codes, a token computes
the same logits alone, batched beside any other rows, or in any piece of a prompt (where
onnxruntime's one-scale-per-run dynamic int8 does not), SmoothQuant read weight by weight keeps
the float model's function, and validate's float-compute twin reads the same int8 weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from ortforge import BatchDecoder, Decoder, create_session, names
from ortforge.manifest import read_manifest, validation_stamp
from tasks import quantize, validate
from tasks.core.errors import StageError
from tasks.core.params import CalibrationConfig
from tasks.evaluation.metrics import full_pass_logits
from tasks.graphs import architecture, onnx_io
from tasks.graphs.weights import DATA_SUFFIX, ExternalData, WeightStore, copy_into, fold_chains
from tasks.quantization import per_token, smoothing, writer
from tasks.quantization.configs import quantize_config
from tests.conftest import REPO

CALIBRATION = CalibrationConfig(text=REPO / "data/calibration/python-docs.txt", samples=2, tokens=32)


def quantized(built, tmp_path_factory, **recipe):
    out = tmp_path_factory.mktemp("variant") / "v"
    quantize.run(quantize_config(**recipe), built["optimized"], built["hf"], out, {}, CALIBRATION)
    return out


@pytest.fixture(scope="module")
def w8a8(built, tmp_path_factory):
    return quantized(built, tmp_path_factory, method="int8_per_token")


@pytest.fixture(scope="module")
def run_scaled(built, tmp_path_factory):
    """onnxruntime's quantize_dynamic: one activation scale per run."""
    return quantized(built, tmp_path_factory, method="int8_dynamic")


def test_channel_codes_keep_each_column_within_half_a_step():
    weights = np.random.default_rng(0).standard_normal((64, 24)).astype(np.float32) * np.arange(1, 25)
    weights[:, 3] = 0
    codes, scales = per_token.channel_codes(weights)
    assert codes.dtype == np.int8 and np.abs(codes.astype(int)).max() == per_token.LEVELS
    assert scales[3] == 1 and not codes[:, 3].any()  # a zero column: codes 0, any scale
    assert np.all(np.abs(codes * scales - weights) <= scales / 2 + 1e-7)


def test_channel_codes_by_blocks_are_those_of_the_whole_matrix(monkeypatch):
    """Coded a few columns at a time (the float64 temporaries of a block, not of an output layer),
    every code and scale is the one the whole matrix gives, on a transposed view too (a tied
    output layer is the embedding table's transpose)."""
    table = np.random.default_rng(1).standard_normal((50, 16)).astype(np.float32)
    whole = per_token.channel_codes(table.T)
    monkeypatch.setattr(per_token, "CODE_COLUMNS", 7)  # 50 columns: blocks of 7, the last of 1
    blocks = per_token.channel_codes(table.T)
    assert np.array_equal(blocks[0], whole[0]) and np.array_equal(blocks[1], whole[1])
    assert blocks[0].shape == (16, 50) and blocks[1].dtype == np.float32


def test_every_matmul_and_the_tied_lookup_are_int8_codes(w8a8):
    graph = onnx.load(str(w8a8 / "model.onnx"), load_external_data=False)
    ops = onnx_io.op_counts(graph)
    assert "MatMul" not in ops and "MatMulNBits" not in ops
    assert ops[per_token.MATMUL] > 0 and "DynamicQuantizeLinear" not in ops and "MatMulInteger" not in ops
    # each activation's codes: one blocked QuantizeLinear (and one for its zero point), no float rounding
    assert "Round" not in ops and ops["QuantizeLinear"] == 2 * len(
        {node.input[0] for node in graph.graph.node if node.op_type == per_token.MATMUL}
    )
    assert {o.domain: o.version for o in graph.opset_import}[""] == writer.BLOCKED_QUANTIZE_OPSET
    coverage = read_manifest(w8a8)["coverage"]
    assert {role: list(rows) for role, rows in coverage.items()} == {
        "linear": ["8"],
        "output": ["8"],
        "embedding": ["8"],
    }
    assert coverage["embedding"]["8"]["bytes"] == 0  # it reads the output layer's codes: stored once


def test_per_token_variant_stays_close_to_the_float_model(built, w8a8):
    ids = np.random.default_rng(3).integers(0, 384, 24)
    reference = full_pass_logits(Decoder(create_session(built["fp32"])), ids)
    logits = full_pass_logits(Decoder(create_session(w8a8)), ids)
    assert np.abs(logits - reference).max() < 0.05 * np.ptp(reference)
    assert np.mean(logits.argmax(-1) == reference.argmax(-1)) >= 0.9


def rows_logits(folder, neighbour: list[int]) -> np.ndarray:
    """Row 0's logits over 4 steps while row 1 holds `neighbour`."""
    batch = BatchDecoder(create_session(folder), 2)
    prompt = [5, 17, 42, 7, 99, 3, 250, 11]
    found = [batch.prefill(0, prompt)]
    batch.prefill(1, neighbour)
    for token in (8, 13, 21, 34):
        found.append(batch.step({0: token, 1: 1})[0])
    return np.array(found)


def test_a_row_is_the_same_whatever_its_neighbours_hold(w8a8, run_scaled):
    quiet, loud = [1, 2, 3], list(range(300, 364))
    assert np.array_equal(rows_logits(w8a8, quiet), rows_logits(w8a8, loud))
    # one scale per run: the same row moves with what the other row holds
    assert not np.allclose(rows_logits(run_scaled, quiet), rows_logits(run_scaled, loud), atol=1e-4)


def last_logits(folder, ids: list[int], chunk: int) -> np.ndarray:
    decoder = Decoder(create_session(folder), prefill_chunk=chunk)
    return decoder.forward(ids, decoder.empty_cache(), last_only=True)[0][-1]


def test_a_prompt_in_pieces_gives_the_whole_prompts_logits(w8a8):
    ids = np.random.default_rng(5).integers(0, 384, 40).tolist()
    whole, cut = last_logits(w8a8, ids, 0), last_logits(w8a8, ids, 7)
    np.testing.assert_allclose(cut, whole, atol=0.1)  # only float rounding moving a code's edge differs
    assert np.argmax(cut) == np.argmax(whole)


def float_computed(w8a8, folder):
    """w8a8's graph with per_token.float_compute, saved runnable in folder; how many matmuls changed
    and the bytes it wrote."""
    from tasks.core.files import link_or_copy
    from tasks.graphs.weights import external_files

    graph = onnx.load(str(w8a8 / "model.onnx"), load_external_data=False)
    weights = folder.with_name(folder.name + "-weights")  # as validate keeps them: w8a8's linked, and the new
    weights.mkdir()
    for file in external_files(graph):
        link_or_copy(w8a8 / file, weights / file)
    data = ExternalData(weights, "float_compute" + DATA_SUFFIX)
    count = per_token.float_compute(graph, WeightStore(graph, w8a8), data)
    folder.mkdir()
    onnx_io.save_runnable(graph, weights, folder)
    return count, data.size


def widened_per_run(w8a8, folder):
    """The float compute this replaced, as an independent reference: each int8 matrix widened by
    DequantizeLinear on every run, then MatMul and the column scales."""
    from onnx import TensorProto, helper

    graph = onnx.load(str(w8a8 / "model.onnx"), load_external_data=False)
    consumers = {name: node for node in graph.graph.node for name in node.input}
    graph.graph.initializer.extend(
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]), helper.make_tensor("zero", TensorProto.INT8, [], [0])]
    )
    for node in [n for n in graph.graph.node if n.op_type == per_token.MATMUL]:
        x, weight, column_scale, out = (
            node.input[0][: -len(per_token.CODES)],
            node.input[1],
            node.input[3],
            node.output[0],
        )
        consumers[out].input[1] = "one"  # the row scale
        graph.graph.node.remove(node)
        graph.graph.node.extend(
            [
                helper.make_node("DequantizeLinear", [weight, "one", "zero"], [weight + "/f"]),
                helper.make_node("MatMul", [x, weight + "/f"], [out + "/f"]),
                helper.make_node("Mul", [out + "/f", column_scale], [out]),
            ]
        )
    from onnxruntime.transformers.onnx_model import OnnxModel

    OnnxModel(graph).topological_sort()
    folder.mkdir()
    onnx_io.save_runnable(graph, w8a8, folder)
    return folder


def optimized_graph(folder):
    """The graph onnxruntime runs for the model in folder (graph level all)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(folder.with_name(folder.name + "-optimized.onnx"))
    ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath, load_external_data=False)


def float_bytes(graph) -> int:
    return sum(4 * int(np.prod(t.dims)) for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)


def test_float_compute_holds_no_float_copy_of_the_weights(w8a8, tmp_path):
    """Each int8 matrix becomes two 4-bit MatMulNBits at accuracy level 0 over the same codes, so
    the session holds no float32 copy of the weights (onnxruntime folds a Cast of a constant into
    one: 5.2 GB at the Llama 3.2 1B shape), only their scales, and nothing widens codes per run
    (DequantizeLinear did: a 1B w8a8's validate peaked at 5.45 GB)."""
    count, _ = float_computed(w8a8, tmp_path / "float")
    optimized = optimized_graph(tmp_path / "float")
    ops = onnx_io.op_counts(optimized)
    assert ops["MatMulNBits"] == 2 * count and "DequantizeLinear" not in ops and per_token.MATMUL not in ops
    levels = {(a.name, a.i) for n in optimized.graph.node if n.op_type == "MatMulNBits" for a in n.attribute}
    assert ("bits", 4) in levels and ("accuracy_level", 0) in levels and ("accuracy_level", 4) not in levels
    codes = sum(
        int(np.prod(t.dims)) for t in validate.structure(w8a8).graph.initializer if t.data_type == onnx.TensorProto.INT8
    )
    assert float_bytes(optimized) - float_bytes(optimized_graph(w8a8)) < codes / 2  # a float copy: 4x codes


def test_validate_budgets_the_codes_float_compute_writes(w8a8, tmp_path):
    _, written = float_computed(w8a8, tmp_path / "float")
    planned = validate.float_compute_bytes(validate.structure(w8a8))
    assert abs(written - planned) < 0.1 * planned  # small zero points stay inline; tensors start aligned


def test_float_compute_reads_the_same_codes_in_float(w8a8, tmp_path):
    count = onnx_io.op_counts(validate.structure(w8a8))[per_token.MATMUL]
    assert float_computed(w8a8, tmp_path / "float")[0] == count
    ids = np.random.default_rng(4).integers(0, 384, 24)
    floats = full_pass_logits(Decoder(create_session(tmp_path / "float")), ids)
    widened = full_pass_logits(Decoder(create_session(widened_per_run(w8a8, tmp_path / "widened"))), ids)
    np.testing.assert_allclose(floats, widened, atol=1e-4)  # the same float product, to rounding
    codes = full_pass_logits(Decoder(create_session(w8a8)), ids)
    assert np.abs(floats - codes).max() < 0.05 * np.ptp(codes)  # the activations' rounding apart
    decoder = Decoder(create_session(tmp_path / "float"))  # float compute: cached decode is a full pass
    logits, cache = decoder.forward(ids[:16].tolist(), decoder.empty_cache())
    for position in range(16, 24):
        step, cache = decoder.forward([int(ids[position])], cache)
        np.testing.assert_allclose(step[-1], floats[position], atol=1e-4)


@pytest.mark.parametrize("exporter", ["ortforge", "genai"])
def test_smoothing_read_weight_by_weight_keeps_the_model_equal(built, built_genai, exporter, tmp_path):
    """SmoothedStore smooths each weight as a streamed stage reads it, with no second copy of the
    model: the checkpoint's own tensors read through Transpose (ortforge's graph), and plain ones
    with the norms' small gammas inline in the graph (genai's: 256 bytes, which copy_into leaves
    where they are)."""
    source = built["optimized"] if exporter == "ortforge" else built_genai["optimized"]
    graph = onnx_io.load(source, with_weights=False)
    store = WeightStore(graph, source)
    groups = smoothing.smoothable_groups(graph)
    assert groups and any(group.transposed for group in groups) == (exporter == "ortforge")
    widths = {g.activation: store.array(g.consumers[0]).shape[g.consumers[0] in g.transposed] for g in groups}
    rng = np.random.default_rng(0)
    maxima = {activation: rng.uniform(0.05, 50, width) for activation, width in widths.items()}
    smoothed = smoothing.SmoothedStore(store, smoothing.plan(graph, maxima, 0.5, store.array))
    smoothed.settle_inline()
    data = ExternalData(tmp_path, "model.onnx" + DATA_SUFFIX)
    fold_chains(graph, smoothed, data)
    copy_into(graph, smoothed, data)
    onnx_io.save_graph_only(graph, tmp_path)
    ids = np.random.default_rng(1).integers(0, 384, 24)
    before = full_pass_logits(Decoder(create_session(built["fp32"])), ids)
    head_dim = architecture.read(built["hf"]).head_dim
    after = full_pass_logits(Decoder(create_session(tmp_path), head_dim=head_dim, layout=names.KV_SHARED), ids)
    np.testing.assert_allclose(after, before, atol=2e-4)


def test_mixture_of_experts_layers_take_8_bit_experts_beside_per_token_linears(tmp_path):
    """A Qwen2-MoE-style model (shared expert, top-k of many): its attention and shared expert per
    token, its routed experts 8-bit QMoE (QMoE takes no activation codes), its routers float; it
    validates, and a row is the same, to float rounding, whatever its neighbours hold."""
    from tests import families

    limits = {
        "ppl_ratio": 1.1,
        "kl_divergence": 0.1,
        "top1_agreement": 0.8,
        "greedy_agreement": 0.0,
        "kv_max_prob_diff": 0.1,
    }
    built = families.through_every_stage(
        "qwen2_moe", tmp_path, variants=("w8a8",), recipes={"w8a8": ({"method": "int8_per_token"}, limits)}
    )
    folder = built["folders"]["w8a8"]
    ops = onnx_io.op_counts(onnx.load(str(folder / "model.onnx"), load_external_data=False))
    assert ops["QMoE"] > 0 and ops[per_token.MATMUL] > 0 and "MoE" not in ops
    coverage = read_manifest(folder)["coverage"]
    assert list(coverage["experts"]) == ["8"] and list(coverage["linear"]) == ["8"]
    assert list(coverage["router"]) == ["32"]
    assert validation_stamp(folder).is_file()  # validate passed it (a failure raises)
    # QMoE groups a run's tokens by expert: float rounding apart, a row is what it is alone
    np.testing.assert_allclose(rows_logits(folder, [1, 2, 3]), rows_logits(folder, list(range(300, 364))), atol=1e-4)


def opset_graph(version: int, op: str = "ReduceMax"):
    node = onnx.helper.make_node(op, ["x"], ["y"])
    graph = onnx.helper.make_graph([node], "g", [], [])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", version)])


def test_the_opset_is_raised_only_where_every_op_keeps_its_meaning():
    model = opset_graph(18)
    writer.GraphWriter(model).raise_opset(21)
    assert model.opset_import[0].version == 21
    # below 18 the Reduce ops take their axes as an attribute: relabelled, the graph would not load
    with pytest.raises(StageError, match="export.opset to 18"):
        writer.GraphWriter(opset_graph(17)).raise_opset(21)
    with pytest.raises(StageError, match="GroupNormalization"):
        writer.GraphWriter(opset_graph(18, "GroupNormalization")).raise_opset(21)

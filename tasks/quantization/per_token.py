"""Int8 weights per output channel, int8 activations per token (W8A8): every linear layer, the
output layer and a tied embedding lookup become onnxruntime's integer matmul, with each
activation row quantized in the graph by its own largest magnitude; mixture-of-experts layers
become 8-bit QMoE.

Why per token: onnxruntime's dynamic quantization (DynamicQuantizeLinear, DynamicQuantizeMatMul)
takes one scale for the whole run, so a row's result depends on the other rows of the run and on
where a prompt is cut into pieces (a batched server row moved by 4.4% of the logits' range on
SmolLM2). A scale per row (ReduceMax over the hidden axis) makes every row's codes its own: the
same token gives the same logits alone, in a batch, or in any piece of a prompt.

Why onnxruntime's integer matmul (MatMulIntegerToFloat: u8 x s8 products, times each column's
scale): it reads each weight once for all the rows of a run (a decode step of 8 rows costs
x1.2-1.4 one row, where MatMulNBits costs x2.3-2.7) and runs its u8 x s8 products on VNNI / AMX,
so a prompt prefills several times faster (benchmarks/kernels.py).

Activations are uint8 codes around 128 (the integer matmul takes a scalar zero point; its fast
kernels are u8 x s8): q = round(x * 127 / max|x|) + 128, in 1..255. Weights are symmetric int8 in
-127..127 per output column. y = (q - 128) . W * (max|x| / 127) * scale[n]. A row's codes are one
blocked QuantizeLinear (opset 21) whose one block is the whole row: on SmolLM2 the graph has 1,228
nodes where a Div, Add, Round and Cast per activation made 1,470, and the batched decode step's
elementwise ops over every activation row go with them. On CPUs without VNNI,
onnxruntime's u8 x s8 kernel adds pairs of products in 16 bits, which may saturate: validate
measures the variant on the machine that will run it, and fails it there if so.
"""

from __future__ import annotations

import logging

import numpy as np

from tasks.graphs.weights import ExternalData, WeightStore, prune
from tasks.quantization.layers import linear_layers, output_layer, sibling_groups, weight_matrix
from tasks.quantization.writer import (
    BLOCKED_QUANTIZE_OPSET,
    GraphWriter,
    float_halves_bytes,
    group_bias,
    packed_names,
    split_back,
    write_float_halves,
)

log = logging.getLogger(__name__)

LEVELS = 127  # symmetric int8 codes, weights and activations alike
ACTIVATION_ZERO = 128  # uint8 activation codes are centred here
CODES = "/per_token/codes"  # suffix of an activation's codes: <activation>/per_token/codes
MATMUL, MS = "MatMulIntegerToFloat", "com.microsoft"
CODE_OFFSET = 128  # float compute's weight codes: int8 + 128 as uint8, with this zero point


CODE_COLUMNS = 4096  # columns coded at a time: each column's codes are its own


def channel_codes(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] float -> int8 codes [K, N] and a float32 scale per column [N] (symmetric, round to
    nearest). A column of zeros gets scale 1 (its codes are 0 whatever the scale). A block of
    columns at a time, so the float64 temporaries are a block's: over a whole output layer
    (Llama 3.2 1B's is [2048, 128256]) they took 4.2 GB and the stage 6.2 GB."""
    codes = np.empty(weights.shape, dtype=np.int8)
    scales = np.empty(weights.shape[1], dtype=np.float32)
    for start in range(0, weights.shape[1], CODE_COLUMNS):
        block = slice(start, start + CODE_COLUMNS)
        codes[:, block], scales[block] = _block_codes(weights[:, block])
    return codes, scales


def _block_codes(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    peak = np.abs(weights).max(axis=0).astype(np.float64)
    scales = np.where(peak > 0, peak / LEVELS, 1.0)
    codes = np.clip(np.rint(weights / scales), -LEVELS, LEVELS).astype(np.int8)
    return codes, scales.astype(np.float32)


class TokenQuantizer:
    """Adds to a graph, once per activation tensor, the nodes that turn it into uint8 codes and a
    scale per row: codes [..., K] and scale [..., 1]."""

    def __init__(self, writer: GraphWriter):
        writer.raise_opset(BLOCKED_QUANTIZE_OPSET)
        self.writer = writer
        self.done: dict[str, tuple[str, str]] = {}
        consts = {
            "axes": np.array([-1], dtype=np.int64),
            "levels": np.array(LEVELS, dtype=np.float32),
            "tiny": np.array(np.finfo(np.float32).tiny, dtype=np.float32),  # an all-zero row: codes 128
            # quantizing a row's scale (at most float32's max / 127) at this step gives code 0 plus
            # the zero point: a zero point per row, the shape blocked QuantizeLinear asks of it
            "huge": np.array(2.0**100, dtype=np.float32),
            "zero_code": np.array(ACTIVATION_ZERO, dtype=np.uint8),
            "one": np.array(1.0, dtype=np.float32),
        }
        self.const = {key: writer.constant(f"/per_token/{key}", value) for key, value in consts.items()}

    def codes(self, x: str, width: int) -> tuple[str, str]:
        """(codes, scale) of activation x, whose rows are width wide, computed once however many
        matmuls read it."""
        if x not in self.done:
            c, stem = self.const, x + CODES.rsplit("/", 1)[0]
            self.writer.model.graph.node.extend(
                [
                    _node("Abs", [x], stem + "/abs"),
                    _node("ReduceMax", [stem + "/abs", c["axes"]], stem + "/peak", keepdims=1),
                    _node("Max", [stem + "/peak", c["tiny"]], stem + "/range"),
                    _node("Div", [stem + "/range", c["levels"]], stem + "/scale"),
                    _node("QuantizeLinear", [stem + "/scale", c["huge"], c["zero_code"]], stem + "/zeros"),
                    _node(
                        "QuantizeLinear", [x, stem + "/scale", stem + "/zeros"], x + CODES, axis=-1, block_size=width
                    ),
                ]
            )
            self.done[x] = (x + CODES, stem + "/scale")
        return self.done[x]


def write_integer_matmul(
    writer: GraphWriter, tokens: TokenQuantizer, x: str, output: str, stem: str, weights: np.ndarray, bias: str = ""
) -> str:
    """output = x . weights (+ bias) on x's per-token codes: onnxruntime's MatMulIntegerToFloat
    (the integer product times each column's scale, in one node), then each row's scale. Returns
    the name of the int8 codes [K, N] it stored."""
    codes, scales = channel_codes(weights)
    stored = writer.constant(stem + "/codes", codes)
    column_scale = writer.constant(stem + "/scales", scales)
    x_codes, x_scale = tokens.codes(x, weights.shape[0])
    scaled = stem + "/scaled" if bias else output
    c = tokens.const
    nodes = [
        _node(MATMUL, [x_codes, stored, c["one"], column_scale, c["zero_code"]], stem + "/columns", domain=MS),
        _node("Mul", [stem + "/columns", x_scale], scaled),
    ]
    if bias:
        nodes.append(_node("Add", [scaled, bias], output))
    writer.model.graph.node.extend(nodes)
    return stored


def write_embedding_lookup(writer: GraphWriter, gather, codes: str, scales: str) -> None:
    """The tied lookup reading the output layer's codes [K, vocab]: column id of the codes, times
    that column's scale, is the token's embedding."""
    from onnx import TensorProto

    stem, ids = gather.name or "embedding", gather.input[1]
    rank = 2  # input_ids [batch, sequence]
    axes = writer.constant(stem + "/per_token/axes", np.array([-1], dtype=np.int64))
    writer.model.graph.node.extend(
        [
            _node("Gather", [codes, ids], stem + "/columns", axis=1),
            _node("Transpose", [stem + "/columns"], stem + "/rows", perm=[*range(1, rank + 1), 0]),
            _node("Cast", [stem + "/rows"], stem + "/float", to=TensorProto.FLOAT),
            _node("Gather", [scales, ids], stem + "/scale", axis=0),
            _node("Unsqueeze", [stem + "/scale", axes], stem + "/scale_column"),
            _node("Mul", [stem + "/float", stem + "/scale_column"], gather.output[0]),
        ]
    )


def _node(op: str, inputs: list[str], output: str, **attrs):
    """A node named after its output and op (writer output names are unique)."""
    from onnx import helper

    return helper.make_node(op, inputs, [output], name=f"{output}/{op}", **attrs)


def quantize_model(model, output_float: bool, store: WeightStore, data: ExternalData | None = None):
    """Rewrite model in place: every linear (siblings reading one input packed into one matmul and
    split back) and, unless output_float, the output layer and a tied lookup, to per-token int8;
    mixture-of-experts layers to onnxruntime's QMoE at 8 bits (its experts' weights int8, its
    activations float: QMoE takes no activation codes). One group of weights is in memory at a
    time. Returns model and notes for the manifest."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    from tasks.quantization.configs import quantize_config
    from tasks.quantization.experts import quantize_experts

    writer = GraphWriter(model, data)
    tokens = TokenQuantizer(writer)
    linears = linear_layers(model)
    for group in sibling_groups(linears, dict.fromkeys((linear.node.name for linear in linears), 0)):
        first = group[0]
        weights = np.concatenate([weight_matrix(linear, store) for linear in group], axis=1)
        stem = first.node.name or first.weight_name
        bias = group_bias(writer, store, group, stem)
        if len(group) == 1:
            write_integer_matmul(writer, tokens, first.node.input[0], first.node.output[0], stem, weights, bias)
        else:
            stem, packed = packed_names(group)
            write_integer_matmul(writer, tokens, first.node.input[0], packed, stem, weights, bias)
            split_back(writer, group, packed, stem)
        del weights
        for linear in group:
            model.graph.node.remove(linear.node)
    log.info("quantized %d linear layers to per-token int8", len(linears))
    num_layers = 1 + max((linear.layer for linear in linears if linear.layer is not None), default=0)
    experts = quantize_config(method="weight_only", bits=8, zero_point="none")  # QMoE's codes are symmetric
    notes = quantize_experts(writer, store, experts, num_layers)
    head = output_layer(model)
    if head is not None and not output_float:
        stem = "lm_head"
        stored = write_integer_matmul(writer, tokens, head.node.input[0], head.node.output[0], stem, head.weight(store))
        model.graph.node.remove(head.node)
        if head.gather is not None:
            write_embedding_lookup(writer, head.gather, stored, stem + "/scales")
            model.graph.node.remove(head.gather)
    prune(model)  # the float weights (and Cast/Transpose nodes) nothing reads any more
    OnnxModel(model).topological_sort()
    return model, notes


def float_compute(model, store: WeightStore, data: ExternalData | None = None) -> int:
    """Make every per-token integer matmul of model (in place) compute in float32 from the same
    int8 weights: x . codes times the column scales, with no activation codes. Validate's cache
    check runs this: the codes of one token run alone and in a many-token run differ where float
    rounding moves a value across a code's edge, which would hide the cache's own behaviour.
    Returns how many matmuls changed.

    Each becomes two 4-bit MatMulNBits at accuracy_level 0 (writer.write_float_halves: the codes
    plus 128 as 8-bit ones, every block of a column at its column's scale), written to data
    (inline when None), one matrix at a time. Widening the int8 codes per run instead
    (DequantizeLinear + MatMul) held a float32 copy of the largest matrix during each run: a
    random-weight Llama 3.2 1B's w8a8 validate peaked at 5.45 GB against its 4.7 GB estimate."""
    from onnx import helper

    from tasks.graphs.weights import GraphIndex

    index = GraphIndex(model)
    writer = GraphWriter(model, data)
    one = writer.constant("/per_token/float_compute/one", np.array(1.0, dtype=np.float32))
    changed = 0
    for node in [n for n in model.graph.node if n.op_type == MATMUL and n.input[0].endswith(CODES)]:
        (row_scale,) = index.consumers[node.output[0]]
        x, weight, column_scale = node.input[0][: -len(CODES)], node.input[1], node.input[3]
        k, n = store.tensor(weight).dims
        block = float_block(k)
        codes = _offset_codes(store.raw(weight), block)
        blocks = codes.shape[1] // block
        stem = f"{node.name or node.output[0]}/float_compute"
        scales, shape = stem + "/scales", writer.constant(stem + "/scales/shape", np.array([n, blocks], np.int64))
        model.graph.node.remove(node)
        model.graph.node.extend(
            [  # the column scales [N] across each column's blocks [N, blocks], folded at load
                helper.make_node("Unsqueeze", [column_scale, writer.constant(stem + "/axes", np.array([1]))],
                                 [stem + "/column"], name=stem + "/Unsqueeze"),
                helper.make_node("Expand", [stem + "/column", shape], [scales], name=stem + "/Expand"),
                *write_float_halves(
                    writer, x, node.output[0], stem, codes, np.full((n, blocks), CODE_OFFSET, np.uint8), k, scales
                ),
            ]
        )  # fmt: skip
        row_scale.input[1] = one
        changed += 1
    if changed:
        from onnxruntime.transformers.onnx_model import OnnxModel

        prune(model)  # the activation codes nothing reads now
        OnnxModel(model).topological_sort()
    return changed


def float_compute_bytes(model) -> int:
    """The bytes float_compute writes for model's per-token matmuls (for a preflight, which has no
    weights)."""
    initializers = {t.name: t for t in model.graph.initializer}
    shapes = [
        initializers[n.input[1]].dims for n in model.graph.node if n.op_type == MATMUL and n.input[0].endswith(CODES)
    ]
    return sum(float_halves_bytes(n, k, float_block(k)) for k, n in shapes)


def float_block(k: int) -> int:
    """The block float_compute gives a matrix of K rows: its codes share one scale per column, so
    the largest block MatMulNBits takes that divides K (fewest scales), else 16 with K padded."""
    return next((block for block in (256, 128, 64, 32) if k % block == 0), 16)


def _offset_codes(codes: np.ndarray, block: int) -> np.ndarray:
    """int8 codes [K, N] -> uint8 codes + 128 [N, K padded to whole blocks] (a padded row adds 0)."""
    k = codes.shape[0]
    shifted = np.full((codes.shape[1], -(-k // block) * block), CODE_OFFSET, dtype=np.uint8)
    shifted[:, :k] = (codes.T.astype(np.int16) + CODE_OFFSET).astype(np.uint8)
    return shifted

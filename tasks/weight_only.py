"""Weight-only block quantization: a decoder's linear layers become onnxruntime MatMulNBits nodes,
and a tied output layer and token embedding share one set of codes (MatMulNBits for the logits,
GatherBlockQuantized for the embedding lookup), so the vocabulary matrix is stored once.

Why a rewrite of our own around onnxruntime's operators and algorithms: onnxruntime's quantizer
rounds asymmetric zero points to integers (on SmolLM2 that alone costs +17% perplexity), its float
zero points (HQQ) have no fast CPU kernel (10x slower decode here), and it stores a tied vocabulary
matrix twice. A float zero point z is written as the integer round(z) plus a per-block remainder:
w = s*(q - round(z)) + s*(round(z) - z), and x.W = x.W_int + blocksum(x) . R with
R[b, n] = s*(round(z) - z). The block sums are appended to the layer's input and R's codes to the
weight's, so one MatMulNBits computes both (see offset_rows). On weights that came from a GGUF
Q4_1 file (the default model) this keeps the file's values to about a fifteenth of what rounding
the zero points would cost; integer zero points remain available (slightly faster, lossier).

Codes come from round-to-nearest, an importance-weighted range search (imatrix, with activation
statistics from calibration text), onnxruntime's HQQ solver, or onnxruntime's GPTQ (with Hessians
from calibration text). Scales are stored as float16 and cast to float32 in the graph
(folded at session load), which halves their size on disk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from tasks import onnx_io
from tasks.coverage import layer_of
from tasks.errors import StageError
from tasks.params import QuantizeConfig

log = logging.getLogger(__name__)

MIN_BLOCK = 16  # MatMulNBits' smallest block


@dataclass(frozen=True)
class BlockCodes:
    """W [K, N] as codes q [N, K], scales s and zero points z [N, K // block]: w = s * (q - z)."""

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    block: int

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        q = self.codes.reshape(n, k // self.block, self.block).astype(np.float64)
        w = (q - self.zeros[..., None]) * self.scales[..., None].astype(np.float64)
        return w.reshape(n, k).T.astype(np.float32)

    @property
    def mid(self) -> int:
        return 2 ** (self.bits - 1)


def _blocks(weights: np.ndarray, block: int) -> np.ndarray:
    """[K, N] -> [N, K // block, block] in float64."""
    k, n = weights.shape
    return weights.T.reshape(n, k // block, block).astype(np.float64)


def _codes(blocks: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int) -> np.ndarray:
    q = np.round(blocks / scales[..., None] + zeros[..., None])
    return np.clip(q, 0, 2**bits - 1).astype(np.uint8).reshape(blocks.shape[0], -1)


def _grid_fit(lo: np.ndarray, hi: np.ndarray, bits: int, zero_point: str) -> tuple[np.ndarray, np.ndarray]:
    """Scales and zero points that put [lo, hi] on the grid.

    none: onnxruntime's symmetric convention, the largest magnitude maps to -mid exactly;
    integer: the range widened to hold zero, zero point rounded; float: the range exactly.
    """
    levels = 2**bits - 1
    if zero_point == "none":
        signed_max = np.where(-lo > hi, lo, hi)
        scales = np.where(signed_max != 0, signed_max / -(2 ** (bits - 1)), 1.0)
        return scales, np.full_like(scales, 2 ** (bits - 1))
    if zero_point == "integer":
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)  # zero must be representable
        scales = np.where(hi > lo, (hi - lo) / levels, 1.0)
        return scales, np.clip(np.round(-lo / scales), 0, levels)
    scales = np.where(hi > lo, (hi - lo) / levels, 1.0)
    return scales, -lo / scales


def round_to_nearest(weights: np.ndarray, bits: int, block: int, zero_point: str) -> BlockCodes:
    """Min/max round-to-nearest. zero_point: none (symmetric), integer, or float (exact range)."""
    blocks = _blocks(weights, block)
    scales, zeros = _grid_fit(blocks.min(-1), blocks.max(-1), bits, zero_point)
    scales = scales.astype(np.float16).astype(np.float64)  # stored as float16; quantize against that
    return BlockCodes(_codes(blocks, scales, zeros, bits), scales.astype(np.float32), zeros, bits, block)


def importance_search(
    weights: np.ndarray, importance: np.ndarray, bits: int, block: int, zero_point: str, steps: int = 20
) -> BlockCodes:
    """Per block, shrink the quantization range to minimize sum(importance_k * (w_k - q_k)^2).

    importance is the mean squared activation of each input channel on calibration text (llama.cpp's
    "importance matrix"): errors on channels that carry large activations cost more. Columns are
    processed in slices to bound memory on vocabulary-sized matrices.
    """
    k, n = weights.shape
    codes, scales, zeros = np.empty((n, k), np.uint8), np.empty((n, k // block)), np.empty((n, k // block))
    h = importance.reshape(1, k // block, block)
    for start in range(0, n, 4096):
        blocks = _blocks(weights[:, start : start + 4096], block)
        lo0, hi0 = blocks.min(-1), blocks.max(-1)
        best = np.full(lo0.shape, np.inf)
        for shrink in np.linspace(1.0, 0.7, steps + 1):
            s, z = _grid_fit(lo0 * shrink, hi0 * shrink, bits, zero_point)
            s = s.astype(np.float16).astype(np.float64)
            q = np.clip(np.round(blocks / s[..., None] + z[..., None]), 0, 2**bits - 1)
            err = (h * ((q - z[..., None]) * s[..., None] - blocks) ** 2).sum(-1)
            better = err < best
            best = np.where(better, err, best)
            end = start + blocks.shape[0]
            scales[start:end] = np.where(better, s, scales[start:end])
            zeros[start:end] = np.where(better, z, zeros[start:end])
            codes[start:end] = np.where(np.repeat(better, block, -1), q.reshape(q.shape[0], -1), codes[start:end])
    return BlockCodes(codes, scales.astype(np.float32), zeros, bits, block)


def half_quadratic(weights: np.ndarray, bits: int, block: int) -> BlockCodes:
    """onnxruntime's HQQ solver (float zero points)."""
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    solver = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=block, bits=bits))
    codes, scales, zeros = solver.quantize_internal(
        torch.from_numpy(np.ascontiguousarray(weights.T)), bits=bits, group_size=block, round_zero=False
    )
    return BlockCodes(
        codes.numpy().astype(np.uint8), scales.numpy().astype(np.float32), zeros.numpy().astype(np.float64), bits, block
    )


def gptq(weights: np.ndarray, hessian: np.ndarray, bits: int, block: int, zero_point: str) -> BlockCodes:
    """onnxruntime's GPTQ; its fake-quantized result is re-expressed as codes on the same kind of grid."""
    from onnxruntime.quantization.neural_compressor.weight_only import gptq as ort_gptq

    scheme = "sym" if zero_point == "none" else "asym"
    adjusted = ort_gptq(weights.copy(), hessian.copy(), num_bits=bits, group_size=block, scheme=scheme)
    return round_to_nearest(np.asarray(adjusted, dtype=np.float32), bits, block, zero_point)


@dataclass(frozen=True)
class Linear:
    node: object  # the MatMul or Gemm NodeProto
    weight_name: str
    layer: int | None
    k: int  # input features
    width: int  # N, output columns
    transposed: bool  # the weight is stored [N, K] (Gemm with transB, as GPT-2's Conv1D exports)
    bias: str | None  # Gemm's C, added by MatMulNBits itself


def _gemm_as_linear(node) -> tuple[bool, bool]:
    """(can be a MatMulNBits, transB) for a Gemm: only y = x.B (+ C) with alpha = beta = 1."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)
    return plain, bool(attrs.get("transB", 0))


def linear_layers(model) -> list[Linear]:
    """MatMuls and Gemms with a constant 2-D weight, except the output layer."""
    initializers = {t.name: t for t in model.graph.initializer}
    head = onnx_io.output_matmul(model)
    found = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node is head:
            continue
        weight = initializers.get(node.input[1])
        if weight is None or len(weight.dims) != 2:
            continue
        plain, transposed = _gemm_as_linear(node) if node.op_type == "Gemm" else (True, False)
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
        if not plain or (bias is not None and bias not in initializers):
            continue
        k, n = (weight.dims[1], weight.dims[0]) if transposed else (weight.dims[0], weight.dims[1])
        found.append(Linear(node, weight.name, layer_of(node.name), k, n, transposed, bias))
    return found


def layer_block(k: int, block: int) -> int | None:
    """The block a layer with K inputs uses: the asked size, or the largest smaller power of two
    (at least 16) that divides K; None when none does."""
    size = block
    while size >= MIN_BLOCK and k % size:
        size //= 2
    return size if size >= MIN_BLOCK else None


def weight_matrix(linear: Linear, initializers: dict) -> np.ndarray:
    """The layer's weight as [K, N] float32."""
    from onnx import numpy_helper

    weight = numpy_helper.to_array(initializers[linear.weight_name])
    return np.ascontiguousarray(weight.T if linear.transposed else weight).astype(np.float32)


class GraphWriter:
    """Adds initializers and nodes to a model, naming them uniquely after their origin."""

    def __init__(self, model):
        self.model = model
        self.block_sums: dict[tuple[str, int], str] = {}

    def constant(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def half_constant(self, name: str, array: np.ndarray) -> str:
        """A float32 value stored as float16 and cast back (folded into a float32 initializer at load)."""
        from onnx import TensorProto, helper

        stored = self.constant(name + "_fp16", np.asarray(array, dtype=np.float16))
        self.model.graph.node.append(
            helper.make_node("Cast", [stored], [name], to=TensorProto.FLOAT, name=name + "/Cast")
        )
        return name

    def with_block_sums(self, x: str, blocks: int, block: int, rank: int) -> str:
        """[..., K] -> [..., K + K // block]: x (of the given rank) and its sums over each block of K,
        computed once per input."""
        from onnx import helper

        key = (x, block)
        if key not in self.block_sums:
            stem = f"{x}/block_sum{block}"
            leading = [0] * (rank - 1)  # Reshape copies a 0 dimension from x
            shape = self.constant(stem + "/shape", np.array([*leading, blocks, block], dtype=np.int64))
            axes = self.constant(stem + "/axes", np.array([-1], dtype=np.int64))
            self.model.graph.node.extend(
                [
                    helper.make_node("Reshape", [x, shape], [stem + "/blocks"], name=stem + "/Reshape"),
                    helper.make_node(
                        "ReduceSum", [stem + "/blocks", axes], [stem], keepdims=0, name=stem + "/ReduceSum"
                    ),
                    helper.make_node("Concat", [x, stem], [stem + "/appended"], axis=-1, name=stem + "/Concat"),
                ]
            )
            self.block_sums[key] = stem + "/appended"
        return self.block_sums[key]


def pack(codes: np.ndarray, bits: int, block: int) -> np.ndarray:
    """[N, K] codes -> MatMulNBits' B layout [N, K // block, block * bits // 8] (two 4-bit codes a byte)."""
    n, k = codes.shape
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.reshape(n, k // block, block * bits // 8).astype(np.uint8)


def pack_zero_points(zeros: np.ndarray, bits: int) -> np.ndarray:
    z = np.round(zeros).astype(np.uint8)
    if bits == 4:
        if z.shape[1] % 2:
            z = np.pad(z, ((0, 0), (0, 1)), constant_values=8)
        z = z[:, 0::2] | (z[:, 1::2] << 4)
    return z


def is_integer_grid(codes: BlockCodes) -> bool:
    """Zero points MatMulNBits can store as unsigned integers of `bits` bits."""
    zeros = codes.zeros
    return bool(np.all(zeros == np.round(zeros)) and np.all((zeros >= 0) & (zeros < 2**codes.bits)))


@dataclass(frozen=True)
class StoredCodes:
    """Names of the tensors holding a weight's codes, scales and (optional) zero points."""

    packed: str
    scales: str
    zero_points: str | None


def offset_rows(codes: BlockCodes) -> BlockCodes:
    """Float zero points as integer ones plus K rows that MatMulNBits multiplies with block sums.

    w = s*(q - round(z)) + s*(round(z) - z): the second term is one value per block and column,
    R[b, n], so x.W = x.W_int + blocksum(x).R. Appending the block sums to x and R's codes to the
    weight's lets one MatMulNBits compute both. R has its own grid per column (bits wide); as
    |R| <= s/2 where z lies within the grid, its rounding costs about a fifteenth of what rounding
    z would (a block whose values all share one sign has z outside the grid, a larger R, and
    coarsens its column's R grid; trained weights rarely have such blocks, SmolLM2 none).
    """
    n, k = codes.codes.shape
    levels = 2**codes.bits - 1
    zeros = np.clip(np.round(codes.zeros), 0, levels)
    blocks = k // codes.block
    rows = np.zeros((-(-blocks // codes.block) * codes.block, n))
    rows[:blocks] = (codes.scales * (zeros - codes.zeros)).T
    extra = round_to_nearest(rows, codes.bits, codes.block, "integer")
    return BlockCodes(
        np.concatenate([codes.codes, extra.codes], axis=1),
        np.concatenate([codes.scales, extra.scales], axis=1),
        np.concatenate([zeros, extra.zeros], axis=1),
        codes.bits,
        codes.block,
    )


def write_matmul(
    writer: GraphWriter,
    x: str,
    output: str,
    stem: str,
    codes: BlockCodes,
    accuracy_level: int,
    bias: str = "",
    rank: int = 3,
) -> StoredCodes:
    """MatMulNBits for x.W (+ bias) into output; float zero points read x (of the given rank) with
    its block sums appended."""
    from onnx import helper

    k = codes.codes.shape[1]
    symmetric = bool(np.all(codes.zeros == codes.mid))
    if not symmetric and not is_integer_grid(codes):
        blocks = k // codes.block
        x, k, codes = writer.with_block_sums(x, blocks, codes.block, rank), k + blocks, offset_rows(codes)
    packed = writer.constant(stem + "/q", pack(codes.codes, codes.bits, codes.block))
    scales = writer.half_constant(stem + "/scales", codes.scales)
    inputs = [x, packed, scales]
    zero_points = None
    if not symmetric:
        zero_points = writer.constant(stem + "/zero_points", pack_zero_points(codes.zeros, codes.bits))
    if zero_points or bias:
        inputs.append(zero_points or "")
    if bias:
        inputs += ["", bias]  # no g_idx
    n = codes.codes.shape[0]
    attrs = {"K": k, "N": n, "bits": codes.bits, "block_size": codes.block, "accuracy_level": accuracy_level}
    node = helper.make_node("MatMulNBits", inputs, [output], stem + "/MatMulNBits", domain="com.microsoft", **attrs)
    writer.model.graph.node.append(node)
    return StoredCodes(packed, scales, zero_points)


@dataclass(frozen=True)
class OutputLayer:
    """The logits MatMul and its weight [K, vocab]; when tied, the embedding table and its Gather."""

    node: object
    weight: np.ndarray
    weight_initializer: str  # the table (tied) or the output layer's own weight
    transpose: object | None  # optimum's run-time Transpose of a tied table
    gather: object | None  # the embedding lookup sharing the table


def output_layer(model) -> OutputLayer | None:
    """Find the output layer and, if the embedding shares its matrix, the lookup.

    Two tied layouts occur: optimum computes the output weight at run time as Transpose(table) of
    the embedding table; onnxruntime-genai's builder stores the output weight and computes the
    table as Transpose(weight).
    """
    from onnx import numpy_helper

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {t.name: t for t in graph.initializer}
    logits = onnx_io.output_matmul(model)
    if logits is None or logits.op_type != "MatMul":
        return None

    def transposes_of(name: str):
        return [n for n in graph.node if n.op_type == "Transpose" and n.input[0] == name]

    def gather_of(table: str):
        return next((n for n in graph.node if n.op_type == "Gather" and n.input[0] == table), None)

    source = producers.get(logits.input[1])
    if source is not None and source.op_type == "Transpose" and source.input[0] in initializers:
        table = source.input[0]  # optimum: logits = x . Transpose(table)
        weight = numpy_helper.to_array(initializers[table]).T
        return OutputLayer(logits, np.ascontiguousarray(weight), table, source, gather_of(table))
    if logits.input[1] not in initializers:
        return None
    weight_name = logits.input[1]
    weight = numpy_helper.to_array(initializers[weight_name])
    for transpose in transposes_of(weight_name):  # genai: table = Transpose(weight)
        gather = gather_of(transpose.output[0])
        if gather is not None:
            return OutputLayer(logits, weight, weight_name, transpose, gather)
    return OutputLayer(logits, weight, weight_name, None, None)


def write_embedding(writer: GraphWriter, gather, stored: StoredCodes, codes: BlockCodes) -> None:
    """GatherBlockQuantized reading the output layer's codes: rows of the vocab matrix are embeddings."""
    from onnx import helper

    n, k = codes.codes.shape
    stem = gather.name or "embedding"
    shape = writer.constant(stem + "/rows_shape", np.array([n, k * codes.bits // 8], dtype=np.int64))
    inputs = [stem + "/rows", gather.input[1], stored.scales] + ([stored.zero_points] if stored.zero_points else [])
    writer.model.graph.node.extend(
        [
            helper.make_node("Reshape", [stored.packed, shape], [stem + "/rows"], name=stem + "/Reshape"),
            helper.make_node(
                "GatherBlockQuantized",
                inputs,
                list(gather.output),
                domain="com.microsoft",
                name=stem + "/GatherBlockQuantized",
                gather_axis=0,
                quantize_axis=1,
                block_size=codes.block,
                bits=codes.bits,
            ),
        ]
    )


def layer_bits(cfg: QuantizeConfig, layer: int | None, num_layers: int) -> int:
    eight_bit = {i % num_layers for i in cfg.eight_bit_blocks}
    return 8 if layer is not None and layer in eight_bit else cfg.bits


def quantize_codes(
    algorithm: str, weights: np.ndarray, bits: int, block: int, zero_point: str, hessian: np.ndarray | None
) -> BlockCodes:
    if algorithm == "hqq":
        return half_quadratic(weights, bits, block)
    if algorithm == "gptq":
        return gptq(weights, hessian, bits, block, zero_point)
    if algorithm == "imatrix":
        return importance_search(weights, np.diag(hessian), bits, block, zero_point)
    return round_to_nearest(weights, bits, block, zero_point)


def vocabulary_block(k: int, block: int, what: str) -> tuple[int, list[str]]:
    size = layer_block(k, block)
    if size is None:
        raise StageError(
            f"the {what} has hidden size {k}, which no block of {MIN_BLOCK} or more divides; set output_bits: 32"
        )
    return size, [f"{what}: block {size} (hidden size {k} is not a multiple of {block})"] if size != block else []


def quantize_output_layer(
    writer: GraphWriter, head: OutputLayer, cfg: QuantizeConfig, hessian: np.ndarray | None
) -> list[str]:
    # GatherBlockQuantized takes integer zero points only, so the shared codes use them.
    zero_point = "none" if cfg.zero_point == "none" else "integer"
    block, notes = vocabulary_block(head.weight.shape[0], cfg.block_size, "output layer")
    codes = quantize_codes(cfg.output_algorithm, head.weight, cfg.output_bits, block, zero_point, hessian)
    stored = write_matmul(writer, head.node.input[0], head.node.output[0], "lm_head", codes, cfg.accuracy_level)
    graph = writer.model.graph
    graph.node.remove(head.node)
    if head.transpose is not None:
        graph.node.remove(head.transpose)
    if head.gather is not None:
        write_embedding(writer, head.gather, stored, codes)
        graph.node.remove(head.gather)
    graph.initializer.remove(next(t for t in graph.initializer if t.name == head.weight_initializer))
    return notes


def token_embedding(model):
    """The Gather that looks token ids up in a float table of its own, or None (tied, or already quantized)."""
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        table = initializers.get(node.input[0]) if node.op_type == "Gather" else None
        if table is not None and len(table.dims) == 2 and node.input[1] == "input_ids" and table.data_type == 1:
            return node, table
    return None


def quantize_untied_embedding(writer: GraphWriter, cfg: QuantizeConfig) -> list[str]:
    """An embedding table the output layer does not share, to GatherBlockQuantized codes at the
    output layer's width (llama.cpp quantizes token_embd too): at fp32 it would be the largest
    part of a small model's int4 artifact."""
    from onnx import numpy_helper

    found = token_embedding(writer.model)
    if found is None:
        return []
    gather, table = found
    rows = numpy_helper.to_array(table)
    block, notes = vocabulary_block(rows.shape[1], cfg.block_size, "token embedding")
    codes = round_to_nearest(rows.T, cfg.output_bits, block, "none" if cfg.zero_point == "none" else "integer")
    stem = gather.name or "embedding"
    packed = writer.constant(stem + "/q", pack(codes.codes, codes.bits, codes.block))
    scales = writer.half_constant(stem + "/scales", codes.scales)
    symmetric = bool(np.all(codes.zeros == codes.mid))
    zero_points = (
        None if symmetric else writer.constant(stem + "/zero_points", pack_zero_points(codes.zeros, codes.bits))
    )
    write_embedding(writer, gather, StoredCodes(packed, scales, zero_points), codes)
    writer.model.graph.node.remove(gather)
    writer.model.graph.initializer.remove(table)
    return notes


def calibrated_inputs(model, cfg: QuantizeConfig) -> list[str]:
    """The layer inputs whose statistics (H = sum x x^T) the chosen algorithms need."""
    wanted = []
    if cfg.algorithm in ("gptq", "imatrix"):
        wanted += [linear.node.input[0] for linear in linear_layers(model)]
    head = output_layer(model)
    if head is not None and cfg.output_algorithm == "imatrix":
        wanted.append(head.node.input[0])
    return sorted(set(wanted))


def sibling_groups(linears: list[Linear], blocks: dict[str, int]) -> list[list[Linear]]:
    """Linears grouped by the input they read (and their block size), in graph order.

    One MatMulNBits per group reads the input once and a Split hands each linear its columns: on
    SmolLM2 gate and up become one node (q, k and v in optimum's graph), one call instead of two,
    7% faster int4 decode in an A/B run. Codes are per column, so packing changes no value.
    """
    groups: dict[tuple[str, int], list[Linear]] = {}
    for linear in linears:
        groups.setdefault((linear.node.input[0], blocks[linear.node.name]), []).append(linear)
    return list(groups.values())


def group_bias(writer: GraphWriter, group: list[Linear], stem: str) -> str:
    """The group's biases side by side ("" when none has one)."""
    from onnx import numpy_helper

    if not any(linear.bias for linear in group):
        return ""
    initializers = {t.name: t for t in writer.model.graph.initializer}
    parts = [
        numpy_helper.to_array(initializers[linear.bias]).reshape(-1) if linear.bias else np.zeros(linear.width)
        for linear in group
    ]
    return writer.constant(stem + "/bias", np.concatenate(parts).astype(np.float32))


def write_linears(writer: GraphWriter, group: list[Linear], codes: BlockCodes, accuracy_level: int) -> None:
    """The group's MatMulNBits (codes hold its weights side by side), split back into each output."""
    from onnx import helper

    first = group[0]
    stem = first.node.name or first.weight_name
    rank = 2 if first.node.op_type == "Gemm" else 3  # Gemm reads a matrix; the exporters' MatMuls [batch, seq, K]
    if len(group) == 1:
        bias = group_bias(writer, group, stem)
        write_matmul(writer, first.node.input[0], first.node.output[0], stem, codes, accuracy_level, bias, rank)
        return
    stem, packed = f"{stem}/packed{len(group)}", f"{first.node.output[0]}/packed{len(group)}"
    bias = group_bias(writer, group, stem)
    write_matmul(writer, first.node.input[0], packed, stem, codes, accuracy_level, bias, rank)
    widths = writer.constant(stem + "/widths", np.array([g.width for g in group], dtype=np.int64))
    outputs = [linear.node.output[0] for linear in group]
    writer.model.graph.node.append(helper.make_node("Split", [packed, widths], outputs, axis=-1, name=stem + "/Split"))


def layer_blocks(linears: list[Linear], block: int) -> tuple[dict[str, int], list[str]]:
    """Each linear's block size, and a note for each that cannot use the asked one; StageError
    (before any weight is quantized) when no block of 16 or more divides a layer's K."""
    blocks, notes = {}, []
    for linear in linears:
        size = layer_block(linear.k, block)
        if size is None:
            raise StageError(
                f"linear layer {linear.node.name} has K={linear.k} inputs, which no block of {MIN_BLOCK} or more "
                f"divides (MatMulNBits stores whole blocks); quantize this model with method int8_dynamic or fp16"
            )
        if size != block:
            notes.append(f"{linear.node.name}: block {size} (K={linear.k} is not a multiple of {block})")
        blocks[linear.node.name] = size
    return blocks, notes


def quantize_model(
    model, cfg: QuantizeConfig, hessians: dict[str, np.ndarray] | None = None, only_blocks: set[int] | None = None
):
    """Rewrite model in place: linears to MatMulNBits (siblings packed); unless output_bits is 32,
    the output layer (and a tied embedding) to codes shared by MatMulNBits and GatherBlockQuantized.
    Returns model and notes on layers that could not use the asked block size.

    hessians maps each name from calibrated_inputs() to its H; only_blocks (None: all) limits the
    linears quantized to those decoder blocks, leaving the others float (mixed_precision measures
    one block at a time)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    hessians = hessians or {}
    writer = GraphWriter(model)
    linears = linear_layers(model)
    if only_blocks is not None:
        linears = [linear for linear in linears if linear.layer in only_blocks]
    blocks, notes = layer_blocks(linears, cfg.block_size)
    num_layers = 1 + max((lin.layer for lin in linears if lin.layer is not None), default=0)
    initializers = {t.name: t for t in model.graph.initializer}
    done = 0
    for group in sibling_groups(linears, blocks):
        weights = np.concatenate([weight_matrix(lin, initializers) for lin in group], axis=1)
        bits, block = layer_bits(cfg, group[0].layer, num_layers), blocks[group[0].node.name]
        hessian = hessians.get(group[0].node.input[0])
        codes = quantize_codes(cfg.algorithm, weights, bits, block, cfg.zero_point, hessian)
        write_linears(writer, group, codes, cfg.accuracy_level)
        for linear in group:
            model.graph.node.remove(linear.node)
            model.graph.initializer.remove(initializers[linear.weight_name])
            if linear.bias:
                model.graph.initializer.remove(initializers[linear.bias])
        done, before = done + len(group), done
        if done // 30 > before // 30 or done == len(linears):
            log.info("quantized %d/%d linear layers", done, len(linears))
    head = output_layer(model)
    if head is not None and cfg.output_bits != 32:
        notes += quantize_output_layer(writer, head, cfg, hessians.get(head.node.input[0]))
        notes += quantize_untied_embedding(writer, cfg)
    OnnxModel(model).topological_sort()
    return model, notes

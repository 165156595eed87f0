"""Writing block codes into a graph: MatMulNBits for a linear (or a group of siblings reading one
input, split back into each output), with the block sums float zero points need appended to its
input, and GatherBlockQuantized for an embedding lookup reading the same codes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.core.errors import StageError
from tasks.graphs.weights import ExternalData, WeightStore
from tasks.quantization.codes import BlockCodes, is_integer_grid, offset_rows, pack, pack_zero_points
from tasks.quantization.layers import Linear, weight_matrix

BLOCKED_QUANTIZE_OPSET = 21  # QuantizeLinear with block_size
RAISABLE_FROM = 18  # below it, ReduceMax and others take their axes as an attribute, not an input
# Ops whose meaning changed between opset 18 and 21 (GroupNormalization's scale is per channel from
# 21, GridSample's modes were renamed in 20): a graph holding one is not raised, since relabelling
# it would change what it computes.
CHANGED_SINCE_18 = frozenset({"GroupNormalization", "GridSample"})


class GraphWriter:
    """Adds initializers and nodes to a model, naming them uniquely after their origin. With data
    (an ExternalData file), each constant's bytes go to disk as it is made, so the codes of a
    whole model are never in memory together."""

    def __init__(self, model, data: ExternalData | None = None):
        self.model = model
        self.data = data
        self.block_sums: dict[tuple[str, int], str] = {}

    def constant(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        array = np.ascontiguousarray(array)
        tensor = self.data.tensor(array, name) if self.data is not None and array.nbytes >= 1024 else None
        self.model.graph.initializer.append(tensor or numpy_helper.from_array(array, name))
        return name

    def raise_opset(self, version: int) -> None:
        """Declare the standard ops at opset version at least, so nodes of that opset can be added.
        Every op the graph holds keeps its meaning from RAISABLE_FROM on, but those of
        CHANGED_SINCE_18; a graph from below it, or holding one of those, is refused in one line."""
        standard = next((o for o in self.model.opset_import if o.domain in ("", "ai.onnx")), None)
        if standard is None:
            self.model.opset_import.add(domain="", version=version)
            return
        if standard.version >= version:
            return
        if standard.version < RAISABLE_FROM:
            raise StageError(
                f"this variant writes opset {version} nodes and the exported graph is opset {standard.version}, "
                f"which cannot be raised: set params.yaml export.opset to {RAISABLE_FROM} or above and export again"
            )
        changed = sorted(CHANGED_SINCE_18 & {node.op_type for node in self.model.graph.node})
        if changed:
            raise StageError(
                f"this variant writes opset {version} nodes and the graph holds {', '.join(changed)}, whose meaning "
                f"changed after opset {standard.version}: choose a variant without int8_per_token for this model"
            )
        standard.version = version

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


@dataclass(frozen=True)
class StoredCodes:
    """Names of the tensors holding a weight's codes, scales and (optional) zero points."""

    packed: str
    scales: str
    zero_points: str | None


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


def group_bias(writer: GraphWriter, store: WeightStore, group: list[Linear], stem: str) -> str:
    """The group's biases side by side ("" when none has one)."""
    if not any(linear.bias for linear in group):
        return ""
    parts = [store.array(linear.bias).reshape(-1) if linear.bias else np.zeros(linear.width) for linear in group]
    return writer.constant(stem + "/bias", np.concatenate(parts).astype(np.float32))


def write_linears(
    writer: GraphWriter, store: WeightStore, group: list[Linear], codes: BlockCodes, accuracy_level: int
) -> None:
    """The group's MatMulNBits (codes hold its weights side by side), split back into each output."""
    first = group[0]
    stem = first.node.name or first.weight_name
    rank = 2 if first.node.op_type == "Gemm" else 3  # Gemm reads a matrix; the exporters' MatMuls [batch, seq, K]
    if len(group) == 1:
        bias = group_bias(writer, store, group, stem)
        write_matmul(writer, first.node.input[0], first.node.output[0], stem, codes, accuracy_level, bias, rank)
        return
    stem, packed = packed_names(group)
    bias = group_bias(writer, store, group, stem)
    write_matmul(writer, first.node.input[0], packed, stem, codes, accuracy_level, bias, rank)
    split_back(writer, group, packed, stem)


def packed_names(group: list[Linear]) -> tuple[str, str]:
    """The stem and output names of one matmul computing a group of linears side by side."""
    first = group[0]
    stem = first.node.name or first.weight_name
    return f"{stem}/packed{len(group)}", f"{first.node.output[0]}/packed{len(group)}"


def split_back(writer: GraphWriter, group: list[Linear], packed: str, stem: str) -> None:
    """Split a group's packed output back into each linear's own output."""
    from onnx import helper

    widths = writer.constant(stem + "/widths", np.array([linear.width for linear in group], dtype=np.int64))
    outputs = [linear.node.output[0] for linear in group]
    writer.model.graph.node.append(helper.make_node("Split", [packed, widths], outputs, axis=-1, name=stem + "/Split"))


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


def write_float_linears(writer: GraphWriter, store: WeightStore, group: list[Linear]) -> None:
    """Linears reading one input as one float MatMul over their weights side by side, split back
    into each output."""
    from onnx import helper

    stem, packed = packed_names(group)
    weights = writer.constant(stem + "/weight", np.concatenate([weight_matrix(lin, store) for lin in group], axis=1))
    graph = writer.model.graph
    graph.node.append(helper.make_node("MatMul", [group[0].node.input[0], weights], [packed], name=stem))
    split_back(writer, group, packed, stem)
    for linear in group:
        graph.node.remove(linear.node)


def write_float_halves(
    writer: GraphWriter, x: str, output: str, stem: str, codes: np.ndarray, zeros: np.ndarray, k: int, scales: str
) -> list:
    """Nodes computing output = x . W in float32 from 8-bit codes [N, blocks x block] (uint8, K
    padded to whole blocks) with zero points [N, blocks] and float32 scales [N, blocks] (the name of
    a tensor): two 4-bit MatMulNBits at accuracy_level 0 and their sum. With c = 16 hi + lo and
    z = 16 zh + zl, s (c - z) = 16 s (hi - zh) + s (lo - zl), exact in float32 (16 s is s times a
    power of two). The halves' codes go to the writer (the same bytes as the 8-bit codes); the
    caller places the nodes. Validate's float compute: onnxruntime (1.32) has no float kernel for 8
    bits, and the one at accuracy_level 0 widens the whole matrix to float32 on every run (65-130 ms
    for a [2048 x 8192] matrix, one row or 64, against 3 ms for the 4-bit kernel)."""
    from onnx import helper

    n, padded = codes.shape
    block = padded // zeros.shape[1]
    sixteen = writer.constant(stem + "/sixteen", np.array(16.0, dtype=np.float32))
    high_scales = stem + "/high/scales"  # folded into a float32 initializer at load
    nodes = [helper.make_node("Mul", [scales, sixteen], [high_scales], name=high_scales + "/Mul")]
    attrs = {"K": k, "N": n, "bits": 4, "block_size": block, "accuracy_level": 0}
    for half, part, zero, scale in (
        ("high", codes >> 4, zeros >> 4, high_scales),
        ("low", codes & 15, zeros & 15, scales),
    ):
        packed = writer.constant(f"{stem}/{half}/q", pack(part, 4, block))
        zero_points = writer.constant(f"{stem}/{half}/zero_points", pack_zero_points(zero, 4))
        node = helper.make_node(
            "MatMulNBits", [x, packed, scale, zero_points], [f"{stem}/{half}"], f"{stem}/{half}/MatMulNBits",
            domain="com.microsoft", **attrs,
        )  # fmt: skip
        nodes.append(node)
    nodes.append(helper.make_node("Add", [f"{stem}/high", f"{stem}/low"], [output], name=stem + "/Add"))
    return nodes


def float_halves_bytes(n: int, k: int, block: int) -> int:
    """The bytes write_float_halves writes for an [N, K] matrix in blocks of block: both halves'
    codes (one byte per weight together) and zero points."""
    blocks = -(-k // block)
    return n * (blocks * block + 2 * -(-blocks // 2))

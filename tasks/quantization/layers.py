"""Which parts of a decoder graph weight-only quantization rewrites: its linear layers (MatMul or
Gemm with a constant 2-D weight, grouped by the input they read), the output layer (found behind
bias, scale and softcapping), and the token embedding; each layer's block size and width."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.core.errors import StageError
from tasks.graphs import onnx_io
from tasks.quantization.codes import MIN_BLOCK, layer_block
from tasks.quantization.configs import QuantizeConfig
from tasks.quantization.coverage import layer_of


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


def weight_matrix(linear: Linear, initializers: dict) -> np.ndarray:
    """The layer's weight as [K, N] float32."""
    from onnx import numpy_helper

    weight = numpy_helper.to_array(initializers[linear.weight_name])
    return np.ascontiguousarray(weight.T if linear.transposed else weight).astype(np.float32)


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


def layer_bits(cfg: QuantizeConfig, layer: int | None, num_layers: int) -> int:
    eight_bit = {i % num_layers for i in cfg.eight_bit_blocks}
    return 8 if layer is not None and layer in eight_bit else cfg.bits


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


def token_embedding(model):
    """The Gather that looks token ids up in a float table of its own, or None (tied, or already quantized)."""
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        table = initializers.get(node.input[0]) if node.op_type == "Gather" else None
        if table is not None and len(table.dims) == 2 and node.input[1] == "input_ids" and table.data_type == 1:
            return node, table
    return None


def calibrated_inputs(model, cfg: QuantizeConfig) -> list[str]:
    """The layer inputs whose statistics (H = sum x x^T) the chosen algorithms need."""
    wanted = []
    if cfg.algorithm in ("gptq", "imatrix"):
        wanted += [linear.node.input[0] for linear in linear_layers(model)]
    head = output_layer(model)
    if head is not None and cfg.output_algorithm == "imatrix":
        wanted.append(head.node.input[0])
    return sorted(set(wanted))

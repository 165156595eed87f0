"""Which parts of a decoder graph weight-only quantization rewrites: its linear layers (MatMul or
Gemm with a constant 2-D weight, grouped by the input they read), the output layer (found behind
bias, scale and softcapping), and the token embedding; each layer's block size and width.

A constant weight is an initializer, or one read through Cast and Transpose nodes (the
checkpoint's own bfloat16 [out, in] tensor: tasks/graphs/weights.py); weights are read one at a
time from a WeightStore, never all at once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.core.errors import StageError
from tasks.graphs import onnx_io
from tasks.graphs.weights import Chain, GraphIndex, WeightStore
from tasks.quantization.calibration import DIAGONAL, FULL
from tasks.quantization.codes import MIN_BLOCK, layer_block
from tasks.quantization.configs import QuantizeConfig
from tasks.quantization.coverage import layer_of, routers


@dataclass(frozen=True)
class Linear:
    node: object  # the MatMul or Gemm NodeProto
    weight_name: str  # the initializer holding it
    layer: int | None
    k: int  # input features
    width: int  # N, output columns
    transposed: bool  # the weight is stored [N, K] (Gemm with transB; a Transpose in front of a MatMul)
    bias: str | None  # Gemm's C, added by MatMulNBits itself


def _gemm_as_linear(node) -> tuple[bool, bool]:
    """(can be a MatMulNBits, transB) for a Gemm: only y = x.B (+ C) with alpha = beta = 1."""
    attrs = onnx_io.attributes(node)
    plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)
    return plain, bool(attrs.get("transB", 0))


def linear_layers(model) -> list[Linear]:
    """MatMuls and Gemms with a constant 2-D weight, except the output layer and MoE routers
    (kept float: their rounding would change which experts a token reaches)."""
    index = GraphIndex(model)
    head = onnx_io.output_matmul(model)
    kept_float = routers(model)
    found = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node is head or node.name in kept_float:
            continue
        chain = index.chain(node.input[1])
        if chain is None or len(index.initializers[chain.initializer].dims) != 2:
            continue
        plain, transposed_b = _gemm_as_linear(node) if node.op_type == "Gemm" else (True, False)
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
        if not plain or (bias is not None and bias not in index.initializers):
            continue
        stored = index.initializers[chain.initializer].dims
        transposed = transposed_b != chain.transposed
        k, n = (stored[1], stored[0]) if transposed else (stored[0], stored[1])
        found.append(Linear(node, chain.initializer, layer_of(node.name), k, n, transposed, bias))
    return found


def weight_matrix(linear: Linear, store: WeightStore) -> np.ndarray:
    """The layer's weight as [K, N] float32: a transposed view of a weight stored [N, K] (the codes
    are computed row by row of N, so its rows need no copy)."""
    weight = store.array(linear.weight_name)
    return weight.T if linear.transposed else weight


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


# What may stand between a projection and the attention that reads it: a bias, Qwen3's head norm.
TOWARD_ATTENTION = frozenset({"Add", "Reshape", "SimplifiedLayerNormalization"})


def feed_one_attention(model, group: list[Linear]) -> bool:
    """Whether the group's outputs all reach one GroupQueryAttention node (its q, k and v)."""
    index = GraphIndex(model)

    def attention_of(name: str):
        frontier = [name]
        for _ in range(4):
            readers = [node for value in frontier for node in index.consumers.get(value, [])]
            found = {node.name for node in readers if node.op_type == "GroupQueryAttention"}
            if found:
                return found
            frontier = [out for node in readers if node.op_type in TOWARD_ATTENTION for out in node.output]
        return set()

    reached = [attention_of(linear.node.output[0]) for linear in group]
    return all(len(found) == 1 for found in reached) and len(set.union(*reached)) == 1


def layer_bits(cfg: QuantizeConfig, layer: int | None, num_layers: int) -> int:
    eight_bit = {i % num_layers for i in cfg.eight_bit_blocks}
    return 8 if layer is not None and layer in eight_bit else cfg.bits


@dataclass(frozen=True)
class OutputLayer:
    """The logits MatMul, the chain its weight [K, vocab] is read through, and, when the token
    embedding shares that matrix, the lookup."""

    node: object
    chain: Chain
    k: int  # hidden size
    gather: object | None  # the embedding lookup sharing the table

    @property
    def weight_initializer(self) -> str:
        return self.chain.initializer

    def weight(self, store: WeightStore) -> np.ndarray:
        return store.value(self.chain)


def output_layer(model) -> OutputLayer | None:
    """Find the output layer and, if the embedding shares its matrix, the lookup.

    Tied layouts: optimum (and ortforge's exporter) compute the output weight at run time as
    Transpose(table) of the embedding table; onnxruntime-genai's builder stores the output weight
    and computes the table as Transpose(weight). Either way the lookup reads the same initializer.
    """
    index = GraphIndex(model)
    logits = onnx_io.output_matmul(model)
    if logits is None or logits.op_type != "MatMul":
        return None
    chain = index.chain(logits.input[1])
    if chain is None:
        return None
    stored = index.initializers[chain.initializer].dims
    gather = next(
        (
            node
            for node in model.graph.node
            if node.op_type == "Gather"
            and (table := index.chain(node.input[0])) is not None
            and table.initializer == chain.initializer
        ),
        None,
    )
    return OutputLayer(logits, chain, stored[1] if chain.transposed else stored[0], gather)


def token_embedding(model) -> tuple[object, Chain] | None:
    """The Gather that looks token ids up in a float table of its own, and the chain it reads the
    table [vocab, hidden] through; None when tied (or already quantized)."""
    index = GraphIndex(model)
    head = output_layer(model)
    for node in model.graph.node:
        if node.op_type != "Gather" or node.input[1] != "input_ids":
            continue
        chain = index.chain(node.input[0])
        if chain is None or chain.transposed or (head is not None and chain.initializer == head.weight_initializer):
            continue
        table = index.initializers[chain.initializer]
        if len(table.dims) == 2 and table.data_type in (1, 10, 16):
            return node, chain
    return None


def input_readers(model) -> dict[str, object]:
    """The first linear (or the output layer) reading each layer input, by input tensor name."""
    readers: dict[str, object] = {}
    head = output_layer(model)
    for node in [linear.node for linear in linear_layers(model)] + ([head.node] if head is not None else []):
        readers.setdefault(node.input[0], node)
    return readers


def calibrated_inputs(model, cfg: QuantizeConfig) -> dict[str, str]:
    """The layer inputs whose statistics the chosen algorithms need, and which: GPTQ's H = sum x x^T
    (FULL), or only its diagonal (imatrix weighs each input channel by its mean square)."""
    wanted: dict[str, str] = {}
    if cfg.algorithm in ("gptq", "imatrix"):
        kind = FULL if cfg.algorithm == "gptq" else DIAGONAL
        wanted |= {linear.node.input[0]: kind for linear in linear_layers(model)}
    head = output_layer(model)
    if head is not None and cfg.output_algorithm == "imatrix":
        wanted.setdefault(head.node.input[0], DIAGONAL)
    return dict(sorted(wanted.items()))

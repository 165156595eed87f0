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

import numpy as np

from tasks.core.errors import StageError
from tasks.graphs.onnx_io import attribute
from tasks.graphs.weights import ExternalData, WeightStore, prune
from tasks.quantization.codes import MIN_BLOCK, layer_block, pack, pack_zero_points, quantize_codes, round_to_nearest
from tasks.quantization.configs import QuantizeConfig
from tasks.quantization.experts import quantize_experts
from tasks.quantization.layers import (
    OutputLayer,
    layer_bits,
    layer_blocks,
    linear_layers,
    output_layer,
    sibling_groups,
    token_embedding,
    weight_matrix,
)
from tasks.quantization.writer import (
    GraphWriter,
    StoredCodes,
    float_halves_bytes,
    write_embedding,
    write_float_halves,
    write_linears,
    write_matmul,
)

log = logging.getLogger(__name__)


def vocabulary_block(k: int, block: int, what: str) -> tuple[int, list[str]]:
    size = layer_block(k, block)
    if size is None:
        raise StageError(
            f"the {what} has hidden size {k}, which no block of {MIN_BLOCK} or more divides; set output_bits: 32"
        )
    return size, [f"{what}: block {size} (hidden size {k} is not a multiple of {block})"] if size != block else []


def quantize_output_layer(
    writer: GraphWriter, store: WeightStore, head: OutputLayer, cfg: QuantizeConfig, hessian: np.ndarray | None
) -> list[str]:
    # GatherBlockQuantized takes integer zero points only, so the shared codes use them.
    zero_point = "none" if cfg.zero_point == "none" else "integer"
    block, notes = vocabulary_block(head.k, cfg.block_size, "output layer")
    codes = quantize_codes(cfg.output_algorithm, head.weight(store), cfg.output_bits, block, zero_point, hessian)
    stored = write_matmul(writer, head.node.input[0], head.node.output[0], "lm_head", codes, cfg.accuracy_level)
    writer.model.graph.node.remove(head.node)
    if head.gather is not None:
        write_embedding(writer, head.gather, stored, codes)
        writer.model.graph.node.remove(head.gather)
    return notes  # the float matrix and the nodes that read it go with prune()


def quantize_untied_embedding(writer: GraphWriter, store: WeightStore, cfg: QuantizeConfig) -> list[str]:
    """An embedding table the output layer does not share, to GatherBlockQuantized codes at the
    output layer's width (llama.cpp quantizes token_embd too): at fp32 it would be the largest
    part of a small model's int4 artifact."""
    found = token_embedding(writer.model)
    if found is None:
        return []
    gather, chain = found
    rows = store.value(chain)
    block, notes = vocabulary_block(rows.shape[1], cfg.block_size, "token embedding")
    codes = round_to_nearest(rows.T, cfg.output_bits, block, "none" if cfg.zero_point == "none" else "integer")
    del rows
    stem = gather.name or "embedding"
    packed = writer.constant(stem + "/q", pack(codes.codes, codes.bits, codes.block))
    scales = writer.half_constant(stem + "/scales", codes.scales)
    symmetric = bool(np.all(codes.zeros == codes.mid))
    zero_points = (
        None if symmetric else writer.constant(stem + "/zero_points", pack_zero_points(codes.zeros, codes.bits))
    )
    write_embedding(writer, gather, StoredCodes(packed, scales, zero_points), codes)
    writer.model.graph.node.remove(gather)
    return notes


def quantize_model(
    model,
    cfg: QuantizeConfig,
    hessians: dict[str, np.ndarray] | None = None,
    only_blocks: set[int] | None = None,
    store: WeightStore | None = None,
    data: ExternalData | None = None,
):
    """Rewrite model in place: linears to MatMulNBits (siblings packed), MoE experts to QMoE; unless output_bits is 32,
    the output layer (and a tied embedding) to codes shared by MatMulNBits and GatherBlockQuantized.
    Returns model and notes on layers that could not use the asked block size.

    hessians maps each name from calibrated_inputs() to its statistics (H, or its diagonal);
    only_blocks (None: all) limits the linears quantized to those decoder blocks, leaving the
    others float (mixed_precision measures one block at a time). store reads the float weights
    (default: the model's own, loaded); with data, the codes are written there as they are made.
    One group of weights is in memory at a time."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    hessians = hessians or {}
    store = store or WeightStore(model, None)
    writer = GraphWriter(model, data)
    linears = linear_layers(model)
    if only_blocks is not None:
        linears = [linear for linear in linears if linear.layer in only_blocks]
    blocks, notes = layer_blocks(linears, cfg.block_size)
    num_layers = 1 + max((lin.layer for lin in linears if lin.layer is not None), default=0)
    done = 0
    for group in sibling_groups(linears, blocks):
        # Side by side as [K, N]; joined as rows [N, K], where a weight stored [N, K] is contiguous.
        weights = np.concatenate([weight_matrix(lin, store).T for lin in group], axis=0).T
        bits, block = layer_bits(cfg, group[0].layer, num_layers), blocks[group[0].node.name]
        hessian = hessians.get(group[0].node.input[0])
        codes = quantize_codes(cfg.algorithm, weights, bits, block, cfg.zero_point, hessian)
        del weights
        write_linears(writer, store, group, codes, cfg.accuracy_level)
        for linear in group:
            model.graph.node.remove(linear.node)
        done, before = done + len(group), done
        if done // 30 > before // 30 or done == len(linears):
            log.info("quantized %d/%d linear layers", done, len(linears))
    notes += quantize_experts(writer, store, cfg, num_layers, only_blocks)
    head = output_layer(model)
    if head is not None and cfg.output_bits != 32:
        notes += quantize_output_layer(writer, store, head, cfg, hessians.get(head.node.input[0]))
        notes += quantize_untied_embedding(writer, store, cfg)
    prune(model)  # the float weights (and Cast/Transpose nodes) nothing reads any more
    OnnxModel(model).topological_sort()
    return model, notes


def float_compute(model, store: WeightStore, data: ExternalData | None = None) -> int:
    """Make every MatMulNBits of model (in place) compute in float32 from the same weights; return
    how many changed. Accuracy level 4 quantizes activations to int8, and its kernels round a
    one-token run differently from a many-token run (SmolLM2 int8: up to 1.9 logits apart, each
    about as far from PyTorch), so validate compares cached decode with a full pass, and proves its
    deployment, with float compute on both sides.

    Below 8 bits that is accuracy_level 0; an 8-bit node becomes two 4-bit ones at accuracy_level
    0 over the same values (writer.write_float_halves: onnxruntime's 8-bit float kernel widens the
    whole matrix on every run, which made validating an int8 Llama 3.2 1B take 16 minutes), their
    codes read from store one matrix at a time and written to data (inline when None)."""
    writer = GraphWriter(model, data)
    nodes, changed = [], 0
    for node in model.graph.node:
        bits = attribute(node, "bits", 4)
        if node.op_type != "MatMulNBits" or (attribute(node, "accuracy_level", 0) == 0 and bits != 8):
            nodes.append(node)
            continue
        changed += 1
        if bits == 8:
            nodes += _as_float_halves(writer, store, node)
            continue
        for setting in node.attribute:
            if setting.name == "accuracy_level":
                setting.i = 0
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return changed


def float_compute_bytes(model) -> int:
    """The bytes float_compute writes for model's 8-bit MatMulNBits (for a preflight, which has no
    weights)."""
    return sum(
        float_halves_bytes(attribute(node, "N"), attribute(node, "K"), attribute(node, "block_size"))
        for node in model.graph.node
        if node.op_type == "MatMulNBits" and attribute(node, "bits", 4) == 8
    )


def _as_float_halves(writer: GraphWriter, store: WeightStore, node) -> list:
    """An 8-bit MatMulNBits as writer.write_float_halves' nodes, with its bias added after."""
    from onnx import helper

    x, weight, scales, zero_points, g_idx, bias = (list(node.input) + [""] * 6)[:6]
    if g_idx:
        raise StageError(f"{node.name}: MatMulNBits with g_idx has no float compute here; quantize writes none")
    n, k = attribute(node, "N"), attribute(node, "K")
    codes = store.raw(weight).reshape(n, -1)  # [N, blocks x block], K padded to whole blocks
    blocks = codes.shape[1] // attribute(node, "block_size")
    if zero_points:
        zeros = store.raw(zero_points)
        if zeros.dtype != np.uint8:
            raise StageError(f"{node.name}: float zero points at 8 bits have no float compute here")
        zeros = zeros.reshape(n, -1)[:, :blocks]
    else:
        zeros = np.full((n, blocks), 128, dtype=np.uint8)  # MatMulNBits' default: 2^(bits - 1)
    stem = f"{node.name or node.output[0]}/float_compute"
    product = stem + "/product" if bias else node.output[0]
    nodes = write_float_halves(writer, x, product, stem, codes, zeros, k, scales)
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], name=stem + "/bias"))
    return nodes

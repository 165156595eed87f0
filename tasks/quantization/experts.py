"""Mixture-of-experts layers to onnxruntime's QMoE: each expert's weights as symmetric block codes.

ortforge's exporter writes a MoE layer as onnxruntime's float MoE operator reading the experts'
weights stacked in the graph ([experts, 2 * inter, hidden] with gate and up rows interleaved, and
[experts, hidden, inter]). Here each expert's matrices are read one at a time, rounded to the
nearest point of a symmetric grid (QMoE's CPU kernel takes codes centred on 8 or 128 and no zero
points, the layout MatMulNBits uses: [rows, K * bits / 8] per expert), and the layer becomes one
QMoE node. Only the routed experts' weights are read per token, so on CPU this is where
weight-only int4 pays most.

4-bit codes get a scale per block of K, like the other linears; 8-bit codes one per row
(block_size 0), because onnxruntime 1.32 runs block-wise 8-bit experts only with int8-quantized
activations (1.3% of the output's range off on a test layer), and per-row codes in float. Experts
compute with float activations (accuracy_level 0) whatever the variant asks of MatMulNBits: at
level 4, onnxruntime 1.32's QMoE gave a row decoded beside others other logits than the same row
alone (0.006 apart on a tiny Mixtral), so continuous batching would change what a request gets.

Routers stay float (tasks/quantization/coverage.py's role `router`): a few thousand weights whose
rounding would change which experts a token reaches. Experts are rounded to nearest whatever
`algorithm` asks of the other linears: GPTQ, HQQ and imatrix statistics are gathered per layer
input, and an expert sees only the tokens routed to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from onnx import helper

from tasks.core.errors import StageError
from tasks.graphs import onnx_io
from tasks.graphs.weights import Chain, GraphIndex, WeightStore
from tasks.quantization.codes import MIN_BLOCK, layer_block, pack, round_to_nearest
from tasks.quantization.configs import QuantizeConfig
from tasks.quantization.coverage import EXPERT_WEIGHTS, EXPERTS_OP, QUANTIZED_EXPERTS_OP, layer_of, stacked_parts
from tasks.quantization.layers import layer_bits
from tasks.quantization.writer import GraphWriter

log = logging.getLogger(__name__)

FC1, FC2 = EXPERT_WEIGHTS[EXPERTS_OP]  # where MoE reads its stacked fc1 and fc2 weights
FLOAT_ACTIVATIONS = 0  # QMoE's accuracy_level: see the module's docstring


@dataclass(frozen=True)
class ExpertLayer:
    node: object  # the float MoE NodeProto
    fc1: list[tuple[Chain, Chain]]  # per expert: its gate and up weights, [inter, hidden] each
    fc2: list[Chain]  # per expert: its down weight, [hidden, inter]


def expert_layers(model) -> list[ExpertLayer]:
    """The float MoE nodes and the per-expert weights their stacked inputs are built from."""
    index = GraphIndex(model)
    found = []
    for node in model.graph.node:
        if node.op_type != EXPERTS_OP:
            continue
        fc1 = stacked_parts(index.producers, node.input[FC1], index.chain)
        fc2 = stacked_parts(index.producers, node.input[FC2], index.chain)
        if not fc2 or len(fc1) != 2 * len(fc2):
            raise StageError(
                f"MoE node {node.name}: its expert weights are not stacked from one gate, up and down matrix per "
                f"expert as ortforge's exporter writes them; export with exporter: ortforge"
            )
        found.append(ExpertLayer(node, list(zip(fc1[0::2], fc1[1::2], strict=True)), fc2))
    return found


def _block(k: int, asked: int, node) -> int:
    size = layer_block(k, asked)
    if size is None:
        raise StageError(
            f"MoE node {node.name} has experts with K={k} inputs, which no block of {MIN_BLOCK} or more divides; "
            f"quantize this model with method fp16"
        )
    return size


def _codes(rows: list[np.ndarray], bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Experts' [N, K] weights -> QMoE's codes [experts, N, K * bits / 8] and scales [experts, N, K / block]
    (block 0: one scale per row, [experts, N])."""
    codes, scales = [], []
    for weight in rows:
        size = block or weight.shape[1]
        found = round_to_nearest(weight.T, bits, size, "none")
        codes.append(pack(found.codes, bits, size).reshape(weight.shape[0], -1))
        scales.append(found.scales if block else found.scales[:, 0])
    return np.stack(codes), np.stack(scales)


def _write(writer: GraphWriter, layer: ExpertLayer, store: WeightStore, bits: int, cfg: QuantizeConfig) -> None:
    """The layer's QMoE in place of its float MoE (the float weights go with prune())."""
    node, stem = layer.node, layer.node.name
    hidden, inter = store.value(layer.fc2[0]).shape  # down: [hidden, inter]
    # QMoE takes one block size for both matrices; 0 means one scale per row.
    block = 0 if bits == 8 else min(_block(hidden, cfg.block_size, node), _block(inter, cfg.block_size, node))
    interleaved = [  # gate_0, up_0, gate_1, up_1, ... rows, as the float MoE reads them
        np.stack([store.value(gate), store.value(up)], axis=1).reshape(2 * inter, hidden) for gate, up in layer.fc1
    ]
    fc1_codes, fc1_scales = _codes(interleaved, bits, block)
    del interleaved
    fc2_codes, fc2_scales = _codes([store.value(down) for down in layer.fc2], bits, block)
    inputs = [
        node.input[0],
        node.input[1],
        writer.constant(f"{stem}/fc1/q", fc1_codes),
        writer.half_constant(f"{stem}/fc1/scales", fc1_scales),
        "",
        writer.constant(f"{stem}/fc2/q", fc2_codes),
        writer.half_constant(f"{stem}/fc2/scales", fc2_scales),
    ]
    attrs = onnx_io.attributes(node)
    attrs |= {"expert_weight_bits": bits, "block_size": block, "accuracy_level": FLOAT_ACTIVATIONS}
    quantized = helper.make_node(
        QUANTIZED_EXPERTS_OP, inputs, list(node.output), f"{stem}/Q{bits}", domain="com.microsoft", **attrs
    )
    writer.model.graph.node.append(quantized)
    writer.model.graph.node.remove(node)


def quantize_experts(
    writer: GraphWriter, store: WeightStore, cfg: QuantizeConfig, num_layers: int, only_blocks: set[int] | None = None
) -> list[str]:
    """Every float MoE node (of the given decoder blocks; None: all) to QMoE at the width layer_bits
    gives its layer; notes for the manifest."""
    layers = expert_layers(writer.model)
    if only_blocks is not None:
        layers = [layer for layer in layers if layer_of(layer.node.name) in only_blocks]
    for done, layer in enumerate(layers, 1):
        _write(writer, layer, store, layer_bits(cfg, layer_of(layer.node.name), num_layers), cfg)
        log.info("quantized the experts of %d/%d MoE layers", done, len(layers))
    if not layers or (cfg.algorithm, cfg.zero_point) == ("rtn", "none"):
        return []
    return [
        f"experts of {len(layers)} MoE layers: symmetric round-to-nearest codes (QMoE takes no zero points), "
        f"not algorithm {cfg.algorithm} with zero_point {cfg.zero_point}"
    ]

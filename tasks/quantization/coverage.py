"""What precision each weight matrix of a variant is stored at, read from the graph itself.

quantize records it in the manifest, and validate reads the graph again and compares it with what
the variant's params asked: a variant called int4 whose linear layers stayed float (GPT-2's
Conv1D layers export as Gemm, which a MatMul-only quantizer skips) fails instead of passing on a
perplexity that float weights made easy.

Roles: `linear` (a layer's matmul), `output` (the matmul that produces the logits), `embedding`
(the token lookup), and in mixture-of-experts layers `experts` (one MoE or QMoE node: every
expert's matrices of the layer) and `router` (the matmul whose logits pick the experts, and
Qwen2-MoE's shared-expert gate; kept float). A matrix read twice (a tied vocabulary matrix: the
output layer and the lookup) counts its stored bytes once, at its first reader; the second is
`shared`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from ortforge import names
from tasks.graphs.onnx_io import TOWARD_LOGITS, attribute
from tasks.quantization.configs import QuantizeConfig, kept_float_patterns

LAYER_INDEX = re.compile(r"/layers\.(\d+)/|/h\.(\d+)/")  # LLaMA-style and GPT-2 node names
# Nodes a weight passes through from its initializer to the matmul that reads it, and the width
# they imply: DequantizeLinear (static QDQ) reads 8-bit codes.
WEIGHT_PATH = {"Cast", "Transpose", "Reshape", "DequantizeLinear"}
INTEGER_MATMULS = {"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}  # int8 codes, whatever their type
MATMULS = {"MatMul", "Gemm", "FusedMatMul", *INTEGER_MATMULS}
BITS_OF_TYPE = {1: 32, 10: 16, 16: 16, 2: 8, 3: 8, 21: 4, 22: 4}  # float, (b)float16, (u)int8, (u)int4
EXPERTS_OP, QUANTIZED_EXPERTS_OP = "MoE", "QMoE"  # onnxruntime's mixture-of-experts operators
# Where their expert weights are: MoE's fc1 and fc2 inputs; QMoE's codes and scales of each.
EXPERT_WEIGHTS = {EXPERTS_OP: (2, 4), QUANTIZED_EXPERTS_OP: (2, 3, 5, 6)}
# Nodes that stack per-expert matrices into one MoE input (tasks/graphs/decoder_graph.py).
STACKING = {"Concat", "Unsqueeze", "Reshape"}
# A MoE layer's router (mlp.gate, block_sparse_moe.gate) and Qwen2-MoE's shared-expert gate.
ROUTER = re.compile(r"/(gate|shared_expert_gate)/MatMul$")


@dataclass(frozen=True)
class Weight:
    node: str
    op: str
    role: str  # linear, output, embedding
    bits: int
    parameters: int  # weights in the matrix (K x N, or rows x columns)
    stored_bytes: int  # 0 when shared
    layer: int | None
    shared: bool = False


def layer_of(name: str) -> int | None:
    match = LAYER_INDEX.search(name)
    return int(next(group for group in match.groups() if group is not None)) if match else None


def routers(model) -> set[str]:
    """The router matmuls of a graph with MoE layers (none in a dense graph, whatever its names)."""
    if not any(node.op_type in EXPERT_WEIGHTS for node in model.graph.node):
        return set()
    return {node.name for node in model.graph.node if node.op_type == "MatMul" and ROUTER.search(node.name)}


def stacked_parts(producers: dict, name: str, leaf) -> list:
    """What a stacked expert input is built from, in stacking order: leaf(value) for each value
    that leaf recognises (a weight), found through Concat, Unsqueeze and Reshape nodes (their first
    input: the others are axes and shapes)."""
    found = leaf(name)
    if found is not None:
        return [found]
    node = producers.get(name)
    if node is None or node.op_type not in STACKING:
        return []
    inputs = node.input if node.op_type == "Concat" else node.input[:1]
    return [part for value in inputs for part in stacked_parts(producers, value, leaf)]


class _Graph:
    def __init__(self, model):
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.producers = {out: node for node in model.graph.node for out in node.output}
        self.consumers = defaultdict(list)
        for node in model.graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.counted: set[str] = set()
        self.routers = routers(model)

    def source(self, name: str):
        """(initializer, bits) a weight input is read from, or None when it is an activation."""
        bits = None
        for _ in range(4):
            if name in self.initializers:
                tensor = self.initializers[name]
                return tensor, bits or BITS_OF_TYPE.get(tensor.data_type, 32)
            node = self.producers.get(name)
            if node is None or node.op_type not in WEIGHT_PATH:
                return None
            if node.op_type == "DequantizeLinear":
                bits = (
                    BITS_OF_TYPE.get(self.initializers[node.input[0]].data_type, 8)
                    if node.input[0] in self.initializers
                    else 8
                )
            name = node.input[0]
        return None

    def feeds_logits(self, name: str) -> bool:
        frontier = [name]
        for _ in range(6):
            if names.LOGITS in frontier:
                return True
            frontier = [
                out
                for value in frontier
                for n in self.consumers[value]
                if n.op_type in TOWARD_LOGITS
                for out in n.output
            ]
        return False

    def store(self, inputs) -> tuple[int, bool]:
        """Bytes of the initializers behind inputs not counted before, and whether all were."""
        tensors = [found[0] for found in (self.source(name) for name in inputs if name) if found is not None]
        fresh = [t for t in tensors if t.name not in self.counted]
        self.counted |= {t.name for t in fresh}
        size = sum(int(np.prod(t.dims)) * max(BITS_OF_TYPE.get(t.data_type, 32), 8) // 8 for t in fresh)
        return size, bool(tensors) and not fresh


def weights(model) -> list[Weight]:
    """Every weight matrix the graph multiplies by or looks up, with its stored precision.

    Matmuls first, so a tied matrix's bytes count at the output layer and the lookup is `shared`."""
    graph = _Graph(model)
    nodes = sorted(model.graph.node, key=lambda node: node.op_type in ("Gather", "GatherBlockQuantized"))
    return [weight for node in nodes if (weight := _matrix(graph, node)) is not None]


def _experts(graph: _Graph, node) -> Weight:
    """All the experts' matrices of one MoE layer (float stacked, or QMoE's codes)."""
    if node.op_type == QUANTIZED_EXPERTS_OP:
        bits = attribute(node, "expert_weight_bits")
        codes = [graph.initializers[node.input[i]] for i in EXPERT_WEIGHTS[node.op_type][::2]]
        parameters = sum(int(np.prod(tensor.dims)) * 8 // bits for tensor in codes)
        size, shared = graph.store([node.input[i] for i in EXPERT_WEIGHTS[node.op_type]])
    else:
        parts = [
            found
            for i in EXPERT_WEIGHTS[node.op_type]
            for found in stacked_parts(graph.producers, node.input[i], graph.source)
        ]
        bits = max(part_bits for _, part_bits in parts)
        parameters = sum(int(np.prod(tensor.dims)) for tensor, _ in parts)
        size, shared = graph.store([tensor.name for tensor, _ in parts])
    return Weight(node.name, node.op_type, "experts", bits, parameters, size, layer_of(node.name), shared)


def _matrix(graph: _Graph, node) -> Weight | None:
    op, layer = node.op_type, layer_of(node.name)
    if op in EXPERT_WEIGHTS:
        return _experts(graph, node)
    if op == "MatMulNBits":
        size, shared = graph.store(node.input[1:4])
        role = "output" if graph.feeds_logits(node.output[0]) else "linear"
        parameters = attribute(node, "K") * attribute(node, "N")
        return Weight(node.name, op, role, attribute(node, "bits"), parameters, size, layer, shared)
    if op == "GatherBlockQuantized":
        bits = attribute(node, "bits")
        codes = graph.source(node.input[0])[0]
        size, shared = graph.store([node.input[0], *node.input[2:]])
        return Weight(node.name, op, "embedding", bits, int(np.prod(codes.dims)) * 8 // bits, size, layer, shared)
    weight_input = {"Gather": 0}.get(op, 1 if op in MATMULS else None)
    if weight_input is None:
        return None
    found = graph.source(node.input[weight_input])
    if found is None or len(found[0].dims) != 2:
        return None
    tensor, bits = found
    if op in INTEGER_MATMULS:
        bits = 8
    if op == "Gather":
        role = "embedding"
    elif graph.feeds_logits(node.output[0]):
        role = "output"
    else:
        role = "router" if node.name in graph.routers else "linear"
    size, shared = graph.store([node.input[weight_input]])
    return Weight(node.name, op, role, bits, int(np.prod(tensor.dims)), size, layer, shared)


def summary(found: list[Weight]) -> dict:
    """Per role and bit width: matrices, weights, stored bytes, and the share of the role's weights."""
    table: dict[str, dict[str, dict]] = {}
    for weight in found:
        row = table.setdefault(weight.role, {}).setdefault(
            str(weight.bits), {"matrices": 0, "parameters": 0, "bytes": 0}
        )
        row["matrices"] += 1
        row["parameters"] += weight.parameters
        row["bytes"] += weight.stored_bytes
    for rows in table.values():
        total = sum(row["parameters"] for row in rows.values())
        for row in rows.values():
            row["share"] = row["parameters"] / total
    return table


def describe(table: dict) -> str:
    """One line: each role's widths and shares, e.g. `linear 4-bit 100%; output 4-bit 100%`."""
    return "; ".join(
        f"{role} "
        + ", ".join(f"{bits}-bit {row['share']:.0%}" for bits, row in sorted(rows.items(), key=lambda r: int(r[0])))
        for role, rows in table.items()
    )


def as_records(found: list[Weight]) -> list[dict]:
    return [asdict(weight) for weight in found]


def asked_bits(params: QuantizeConfig, weight: Weight, num_layers: int, kept_float: set[str], vocabulary: dict) -> int:
    """The width the variant's params ask of one matrix. vocabulary: the output layer's size, and
    whether the graph's token lookup reads the output layer's matrix."""
    if weight.role == "embedding":
        if not weight.shared and weight.parameters != vocabulary["parameters"]:  # GPT-2's positions: float
            return 16 if params.method == "fp16" else 32
        return _lookup_bits(params, vocabulary["shared"])
    if weight.role == "router":  # kept float by every method that keeps any float
        return 16 if params.method == "fp16" else 32
    if weight.node in kept_float or any(pattern in weight.node for pattern in kept_float_patterns(params)):
        return 32
    if params.method == "weight_only":
        if weight.role == "output":
            return params.output_bits
        eight_bit = {index % num_layers for index in params.eight_bit_blocks}
        return 8 if weight.layer in eight_bit else params.bits
    if params.method == "int8_per_token" and weight.role == "output":
        return params.output_bits
    return {"fp32": 32, "fp16": 16}.get(params.method, 8)  # the int8 methods quantize every matmul


def _lookup_bits(params: QuantizeConfig, shared: bool) -> int:
    """weight_only writes every lookup at the output layer's width (a tied one reads the output's
    codes, an untied one gets its own), int8_per_token only a tied one (an untied table stays
    float), fp32 and fp16 keep theirs; onnxruntime's int8 tools decide for themselves whether the
    lookup shares the output layer's codes (quantize_dynamic leaves a float copy), so theirs is
    asked what the graph shows."""
    if params.method == "weight_only":
        return params.output_bits
    if params.method == "int8_per_token":
        return params.output_bits if shared else 32
    if params.method in ("fp32", "fp16"):
        return {"fp32": 32, "fp16": 16}[params.method]
    return 8 if shared else 32


def against_recipe(params: QuantizeConfig, found: list[Weight], kept_float: dict[str, str]) -> dict:
    """The graph's widths against what the recipe asks of each matrix, lookups included.

    kept_float: matrices the recipe's measurement chose to keep float (outlier inputs), with why;
    with those matching its keep_float patterns they are listed and their share of the matmul
    weights is what max_float_share caps."""
    num_layers = 1 + max((w.layer for w in found if w.layer is not None), default=0)
    patterns = kept_float_patterns(params)
    chosen = {node: why for node, why in kept_float.items() if getattr(params, "outlier_ratio", None) is not None}
    kept = {
        w.node: chosen.get(w.node) or f"matches keep_float `{next(p for p in patterns if p in w.node)}`"
        for w in found
        if w.role != "embedding" and (w.node in chosen or any(p in w.node for p in patterns))
    }
    output = next((w.parameters for w in found if w.role == "output"), None)
    vocabulary = {"parameters": output, "shared": any(w.shared for w in found if w.role == "embedding")}
    asked = [(weight, asked_bits(params, weight, num_layers, set(kept), vocabulary)) for weight in found]
    total = sum(weight.parameters for weight, _ in asked)
    wrong = [(weight, bits) for weight, bits in asked if weight.bits != bits]
    matmuls = [weight for weight in found if weight.role != "embedding"]
    matmul_total = sum(weight.parameters for weight in matmuls) or 1
    return {
        "share_as_asked": 1.0 - sum(w.parameters for w, _ in wrong) / total if total else 0.0,
        "not_as_asked": [f"{w.node} ({w.op}, {w.bits}-bit, asked {bits})" for w, bits in wrong],
        # Below 16 bits: what the variant's name promises of its matmuls, whatever the recipe exempts.
        "quantized_share": sum(w.parameters for w in matmuls if w.bits < 16) / matmul_total,
        "kept_float": {
            "matrices": kept,
            "share": sum(w.parameters for w in matmuls if w.node in kept) / matmul_total,
            "limit": getattr(params, "max_float_share", 0.0),
        },
    }

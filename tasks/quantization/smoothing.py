"""SmoothQuant: move activation outliers into the weights before int8 with per-tensor activations.

onnxruntime's dynamic int8 quantizes each MatMul input with one scale for the whole tensor, and a
few input channels of a transformer carry values 100x the rest, so every other channel loses its
precision (SmolLM2: perplexity x1.22). For an input channel j, dividing the activation by s_j and
multiplying row j of every consuming weight by s_j leaves the product unchanged in exact arithmetic;
s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) evens out the ranges both quantizers see (Xiao et al.,
2023). The division is folded into whatever produces the activation, so the graph gains no node:
- the RMSNorm in front of q/k/v and gate/up: its gamma is divided by s;
- the gated product in front of down_proj: up_proj's output columns are divided by s (the product
  gate_act * up is linear in up).

A group is only smoothed when every weight it touches belongs to it alone (a weight tied to the
embedding, like the output layer's, is left as it is).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

NORMS = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}  # op -> gamma input
SCALE_RANGE = (1e-2, 1e2)  # keeps a dead channel (max 0) from producing an infinite or zero scale


@dataclass(frozen=True)
class Group:
    """One activation, the weights that consume it (rows scaled up), and the producer's weight
    (divided): a norm gamma [K], or up_proj's weight [*, K] whose columns are divided."""

    activation: str
    consumers: tuple[str, ...]
    producer_weight: str
    producer_is_norm: bool


def smoothable_groups(model) -> list[Group]:
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    uses = Counter(name for node in graph.node for name in node.input)
    consumers: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in initializers:
            consumers.setdefault(node.input[0], []).append(node.input[1])
    groups = []
    for activation, weights in consumers.items():
        producer = producers.get(activation)
        if producer is None or uses[activation] != len(weights):
            continue  # something besides these MatMuls reads the activation: it must stay as it is
        if producer.op_type in NORMS and producer.output[0] == activation:
            group = Group(activation, tuple(weights), producer.input[NORMS[producer.op_type]], True)
        elif producer.op_type == "Mul":
            up = [producers.get(i) for i in producer.input]
            linear = [n for n in up if n is not None and n.op_type == "MatMul" and n.input[1] in initializers]
            if len(linear) != 1:
                continue
            group = Group(activation, tuple(weights), linear[0].input[1], False)
        else:
            continue
        if all(uses[w] == 1 for w in (*group.consumers, group.producer_weight)):
            groups.append(group)
    return groups


def smoothing_scales(activation_max: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    weight_max = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    tiny = np.finfo(np.float32).tiny
    scales = np.maximum(activation_max, tiny) ** alpha / np.maximum(weight_max, tiny) ** (1 - alpha)
    return np.clip(scales, *SCALE_RANGE)


def smooth(model, activation_max: dict[str, np.ndarray], alpha: float) -> int:
    """Rescale the model's weights in place; returns how many activations were smoothed."""
    from onnx import numpy_helper

    tensors = {t.name: t for t in model.graph.initializer}

    def read(name: str) -> np.ndarray:
        return numpy_helper.to_array(tensors[name]).astype(np.float64)

    def write(name: str, value: np.ndarray) -> None:
        tensors[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))

    groups = [g for g in smoothable_groups(model) if g.activation in activation_max]
    for group in groups:
        weights = [read(name) for name in group.consumers]
        scales = smoothing_scales(activation_max[group.activation], weights, alpha)
        for name, weight in zip(group.consumers, weights, strict=True):
            write(name, weight * scales[:, None])
        producer = read(group.producer_weight)
        write(group.producer_weight, producer / scales if group.producer_is_norm else producer / scales[None, :])
    log.info("smoothed %d activations (alpha %.2f)", len(groups), alpha)
    return len(groups)

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

from tasks.graphs.weights import WeightStore

log = logging.getLogger(__name__)

NORMS = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}  # op -> gamma input
FLOAT32 = 1  # onnx.TensorProto.FLOAT
SCALE_RANGE = (1e-2, 1e2)  # keeps a dead channel (max 0) from producing an infinite or zero scale


@dataclass(frozen=True)
class Group:
    """One activation, the weights that consume it (rows scaled up), and the producer's weight
    (divided): a norm gamma [K], or up_proj's weight [*, K] whose columns are divided. Weights are
    initializer names; those in `transposed` are stored [N, K] and read through a Transpose (the
    checkpoint's own layout, tasks/graphs/weights.py)."""

    activation: str
    consumers: tuple[str, ...]
    producer_weight: str
    producer_is_norm: bool
    transposed: frozenset[str] = frozenset()


def smoothable_groups(model) -> list[Group]:
    from tasks.graphs.weights import GraphIndex

    index = GraphIndex(model)
    uses = Counter(name for node in model.graph.node for name in node.input)

    def weight_of(node):
        """The chain behind a MatMul's weight, when that weight is a constant read by it alone."""
        chain = index.chain(node.input[1]) if node.op_type == "MatMul" else None
        alone = chain is not None and uses[chain.output] == 1 and all(uses[n.output[0]] == 1 for n in chain.nodes)
        return chain if alone and uses[chain.initializer] == 1 else None

    consumers: dict[str, list] = {}
    for node in model.graph.node:
        if (chain := weight_of(node)) is not None:
            consumers.setdefault(node.input[0], []).append(chain)
    groups = []
    for activation, chains in consumers.items():
        producer = index.producers.get(activation)
        if producer is None or uses[activation] != len(chains):
            continue  # something besides these MatMuls reads the activation: it must stay as it is
        if producer.op_type in NORMS and producer.output[0] == activation:
            gamma = index.chain(producer.input[NORMS[producer.op_type]])
            if gamma is None or uses[gamma.initializer] != 1:
                continue
            made, is_norm = gamma, True
        elif producer.op_type == "Mul":
            up = [index.producers.get(i) for i in producer.input]
            linear = [found for n in up if n is not None and (found := weight_of(n)) is not None]
            if len(linear) != 1:
                continue
            made, is_norm = linear[0], False
        else:
            continue
        transposed = frozenset(c.initializer for c in (*chains, made) if c.transposed)
        consumer_names = tuple(c.initializer for c in chains)
        groups.append(Group(activation, consumer_names, made.initializer, is_norm, transposed))
    return groups


def smoothing_scales(activation_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """s_j from input channel j's largest activation and largest weight (over its consumers)."""
    tiny = np.finfo(np.float32).tiny
    scales = np.maximum(activation_max, tiny) ** alpha / np.maximum(weight_max, tiny) ** (1 - alpha)
    return np.clip(scales, *SCALE_RANGE)


@dataclass(frozen=True)
class Rescaling:
    """What SmoothQuant does to each weight it touches: rows[name] multiplies the rows (input
    channels) of a consumer [K, N]; divided[name] divides a producer: a norm gamma [K], or the
    columns of up_proj's weight [*, K]."""

    rows: dict[str, np.ndarray]
    divided: dict[str, np.ndarray]
    groups: int
    transposed: frozenset[str] = frozenset()  # initializers stored [N, K]

    def apply(self, name: str, stored: np.ndarray) -> np.ndarray:
        """The initializer's values (as stored) smoothed, or as they are when untouched. up_proj is
        both: its rows take its own input's scales, its columns divide by down_proj's input's."""
        weight = stored.T if name in self.transposed else stored  # [K, N], or a gamma [K]
        if name in self.rows:
            # stored as float32 before the division, as smoothing group by group wrote it: the same
            # bits as before this was streamed (int8_smooth sits within a rounding of its gates)
            weight = (weight * self.rows[name][:, None]).astype(np.float32).astype(np.float64)
        if name in self.divided:
            weight = weight / self.divided[name]  # a gamma [K], or columns [*, K]: both divide the last axis
        return weight.T if name in self.transposed else weight


class SmoothedStore(WeightStore):
    """A WeightStore that reads the initializers a Rescaling touches as smoothed, so a streamed
    quantizer smooths each weight as it reads it, with no second copy of the model: float32 ones
    through raw() (what copy_into writes), others (bfloat16) through array()."""

    def __init__(self, store: WeightStore, rescaling: Rescaling):
        super().__init__(store.model, store.folder)
        self.rescaling = rescaling
        self.touched = {*rescaling.rows, *rescaling.divided}

    def raw(self, name: str) -> np.ndarray:
        values = super().raw(name)
        if name in self.touched and self.tensor(name).data_type == FLOAT32:
            return self.rescaling.apply(name, values.astype(np.float64)).astype(np.float32)
        return values

    def array(self, name: str) -> np.ndarray:
        values = super().array(name)  # a float32 initializer comes smoothed from raw()
        if name in self.touched and self.tensor(name).data_type != FLOAT32:
            return self.rescaling.apply(name, values.astype(np.float64)).astype(np.float32)
        return values

    def settle_inline(self) -> None:
        """Write the smoothed values of the touched initializers the graph holds inline (a norm's
        gamma, mostly) into the graph itself, and read them as they are from then on: copy_into
        leaves a small inline tensor where it is, unsmoothed (a 64-wide gamma is 256 bytes)."""
        from onnx import numpy_helper

        for tensor in self.model.graph.initializer:
            if tensor.name in self.touched and tensor.data_location != 1:
                smoothed = self.array(tensor.name)
                tensor.CopyFrom(numpy_helper.from_array(smoothed.astype(np.float32), tensor.name))
                self.touched.discard(tensor.name)


def plan(model, activation_max: dict[str, np.ndarray], alpha: float, read) -> Rescaling:
    """The scales for every smoothable activation of model that activation_max covers; read(name)
    gives a weight's values (one at a time: a graph's weights need not be in memory)."""
    rows, divided = {}, {}
    groups = [g for g in smoothable_groups(model) if g.activation in activation_max]
    transposed = frozenset().union(*(g.transposed for g in groups))
    for group in groups:
        peak = np.max([np.abs(read(name)).max(axis=0 if name in transposed else 1) for name in group.consumers], axis=0)
        scales = smoothing_scales(activation_max[group.activation], peak, alpha)
        rows |= dict.fromkeys(group.consumers, scales)
        divided[group.producer_weight] = scales
    log.info("smoothing %d activations (alpha %.2f)", len(groups), alpha)
    return Rescaling(rows, divided, len(groups), transposed)


def smooth(model, activation_max: dict[str, np.ndarray], alpha: float) -> int:
    """Rescale the model's weights (held in the graph) in place; returns how many activations were
    smoothed."""
    from onnx import numpy_helper

    tensors = {t.name: t for t in model.graph.initializer}

    def read(name: str) -> np.ndarray:
        return numpy_helper.to_array(tensors[name]).astype(np.float64)

    rescaling = plan(model, activation_max, alpha, read)
    for name in {**rescaling.rows, **rescaling.divided}:  # up_proj is in both: rescaled once
        smoothed = rescaling.apply(name, read(name)).astype(np.float32)
        tensors[name].CopyFrom(numpy_helper.from_array(smoothed, name))
    return rescaling.groups

"""ortforge's own exporter for LLaMA-style decoders: the graph written straight from the checkpoint.

The graph is the one onnxruntime-genai's builder writes (GroupQueryAttention with rotary embedding
and a cache updated in place, SkipSimplifiedLayerNormalization, MatMul linears), built from the
config alone. Its weights are the checkpoint's own bytes: each initializer is an external-data
reference into a safetensors file (offset, length, dtype and [out, in] shape as stored), converted
in the graph by Cast (bfloat16 -> float32) and Transpose nodes that onnxruntime folds at load and
the quantize stage reads through (tasks/graphs/weights.py). Nothing is loaded or written per
weight, so exporting takes the same memory for a 135M model as for an 8B one, and the float
graph costs no disk beyond links to the checkpoint.

Initializers keep the checkpoint's tensor names and linear nodes are named after the modules
(`/model/layers.3/mlp/down_proj/MatMul`), so statistics gathered on the PyTorch model map onto the
graph by name (tasks/quantization/calibration.py). Rotary tables are computed at load from the
frequencies transformers derives from the config (default, linear, llama3 and yarn scaling).

Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE) become onnxruntime's MoE operator: the
router stays a float MatMul whose logits the operator turns into top-k weights, and each expert's
gate and up rows are interleaved into one [experts, 2 * inter, hidden] input (swiglu_fusion=1, the
only SwiGLU layout onnxruntime's CPU kernel takes), stacked in the graph from the checkpoint's
per-expert tensors, so they too stay links until onnxruntime folds them at load. Qwen2-MoE's shared
expert is a plain MLP scaled by its sigmoid gate.

Families: Llama, Mistral, Qwen2 and Qwen3, and the MoE families above (and configs of their
shape); anything else is refused with the reason, and export falls back to onnxruntime-genai's
builder or optimum.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from ortforge import names
from tasks.sources.checkpoint import Checkpoint, StoredTensor

OPSET = 21
WEIGHTS_FROM_CHECKPOINT = "checkpoint"  # the value of names.WEIGHTS_SOURCE_KEY in these graphs
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The mixture-of-experts forms of those decoders (Mixtral is Mistral's). Refusals name FAMILIES
# only: export.json records the refusal, and a longer list would change every refused model's
# artifact (Gemma 3's) without changing its graph.
EXPERT_FAMILIES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
Q_K_NORM = ("qwen3", "qwen3_moe")  # an RMS norm over each head of q and k
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies that do not depend on the sequence


class Unsupported(Exception):
    """The config asks for something this exporter does not write; the message says what."""


@dataclass(frozen=True)
class Experts:
    """A family's mixture-of-experts layers, as its config and checkpoint spell them."""

    count: int
    top_k: int
    normalize: bool  # the top-k weights renormalized to sum to 1 (Mixtral; Qwen's norm_topk_prob)
    sparse: tuple[bool, ...]  # per layer: experts, or a dense MLP (Qwen's mlp_only_layers, decoder_sparse_step)
    block: str  # the layer's module holding router and experts: block_sparse_moe or mlp
    projections: tuple[str, str, str]  # each expert's gate, up and down modules
    shared: bool  # Qwen2-MoE: a shared expert scaled by sigmoid(shared_expert_gate(x))


@dataclass(frozen=True)
class Shape:
    """What the graph needs from the config."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    positions: int
    eps: float
    tied: bool
    q_k_norm: bool
    windows: tuple[int, ...]  # per layer: GroupQueryAttention's local_window_size (-1: all)
    experts: Experts | None = None


def node_stem(module: str) -> str:
    """The name a module's nodes start with, as onnxruntime-genai's builder names them:
    model.layers.3.mlp.down_proj -> /model/layers.3/mlp/down_proj (the layer index stays with
    `layers`, where tasks/quantization/coverage.py reads it)."""
    return "/" + re.sub(r"\.(?!\d)", "/", module)


def module_of(node_name: str) -> str:
    """The module a linear node of these graphs is named after (node_stem's inverse):
    /model/layers.3/mlp/down_proj/MatMul -> model.layers.3.mlp.down_proj."""
    return node_name.strip("/").rsplit("/", 1)[0].replace("/", ".")


def rope_type(config) -> str:
    scaling = getattr(config, "rope_scaling", None) or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_supported(config) -> None:
    """Unsupported with the reason unless this exporter writes the config's model faithfully."""
    if config.model_type not in FAMILIES | EXPERT_FAMILIES:
        raise Unsupported(f"it writes {', '.join(FAMILIES)} decoders, not model_type `{config.model_type}`")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise Unsupported(f"activation `{config.hidden_act}` (it writes SiLU MLPs)")
    if rope_type(config) not in STATIC_ROPE:
        raise Unsupported(f"rope scaling `{rope_type(config)}` changes with the sequence length")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported("a rotary embedding over part of each head")
    if getattr(config, "mlp_bias", False):
        raise Unsupported("biased MLP projections")


def read_shape(config) -> Shape:
    from tasks.graphs.architecture import expected_windows, from_config

    check_supported(config)
    arch = from_config(config, config)
    return Shape(
        model_type=config.model_type,
        layers=arch.num_layers,
        hidden=arch.hidden_size,
        heads=arch.num_heads,
        kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab=arch.vocab_size,
        positions=arch.context_length,
        eps=float(config.rms_norm_eps),
        tied=arch.tied_embeddings,
        q_k_norm=config.model_type in Q_K_NORM,
        windows=tuple(expected_windows(arch)),
        experts=read_experts(config, arch.num_layers),
    )


def read_experts(config, layers: int) -> Experts | None:
    """The config's mixture-of-experts layout, or None for a dense model."""
    if config.model_type == "mixtral":
        return Experts(
            count=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            normalize=True,  # softmax, top-k, then divided by their sum
            sparse=(True,) * layers,
            block="block_sparse_moe",
            projections=("w1", "w3", "w2"),
            shared=False,
        )
    if config.model_type in ("qwen2_moe", "qwen3_moe"):
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
        return Experts(
            count=config.num_experts,
            top_k=config.num_experts_per_tok,
            normalize=bool(config.norm_topk_prob),
            sparse=tuple(i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(layers)),
            block="mlp",
            projections=("gate_proj", "up_proj", "down_proj"),
            shared=config.model_type == "qwen2_moe",
        )
    return None


def rotary_frequencies(config) -> tuple[np.ndarray, float]:
    """inv_freq [head_dim / 2] and the attention scaling transformers applies to cos and sin."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type(config)](config, torch.device("cpu"))
    return inv_freq.float().numpy(), float(scaling)


class GraphBuilder:
    """Collects nodes, initializers and the checkpoint files they point into."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.nodes: list = []
        self.initializers: dict[str, object] = {}
        self.floats: dict[str, str] = {}  # checkpoint tensor -> its float32 value in the graph

    def node(self, op: str, inputs: list[str], outputs: list[str] | int, name: str, domain: str = "", **attrs):
        from onnx import helper

        if isinstance(outputs, int):
            outputs = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def constant(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.setdefault(name, numpy_helper.from_array(np.asarray(value), name))
        return name

    def stored(self, tensor: StoredTensor) -> str:
        """The checkpoint tensor as an initializer whose bytes stay in the checkpoint's file."""
        from onnx import TensorProto

        if tensor.name not in self.initializers:
            proto = TensorProto(name=tensor.name, data_type=tensor.onnx_type, dims=tensor.shape)
            proto.data_location = TensorProto.EXTERNAL
            for key, value in (("location", tensor.file), ("offset", tensor.offset), ("length", tensor.length)):
                proto.external_data.add(key=key, value=str(value))
            self.initializers[tensor.name] = proto
        return tensor.name

    def weight(self, name: str) -> str:
        """A checkpoint tensor as float32, as stored ([out, in] for a linear)."""
        if name not in self.floats:
            tensor = self.checkpoint.stored(name)
            stored = self.stored(tensor)
            self.floats[name] = (
                stored
                if tensor.dtype == "F32"
                else self.node("Cast", [stored], [f"{name}/float"], f"{name}/Cast", to=1)
            )
        return self.floats[name]

    def matrix(self, name: str) -> str:
        """A linear's weight as MatMul's [in, out]."""
        return self.node("Transpose", [self.weight(name)], [f"{name}/kn"], f"{name}/Transpose", perm=[1, 0])

    def linear(self, x: str, module: str, source: str) -> str:
        """x . W (+ b): module names the node (the model's module path), source the checkpoint's tensors."""
        stem = node_stem(module)
        out = self.node("MatMul", [x, self.matrix(f"{source}.weight")], 1, f"{stem}/MatMul")
        if f"{source}.bias" in self.checkpoint:
            out = self.node("Add", [out, self.weight(f"{source}.bias")], 1, f"{stem}/Add")
        return out


def _rms_norm(b: GraphBuilder, x: str, weight: str, eps: float, name: str) -> str:
    return b.node("SimplifiedLayerNormalization", [x, b.weight(weight)], 1, name, epsilon=eps, axis=-1, stash_type=1)


def _skip_rms_norm(b: GraphBuilder, x: str, skip: str, weight: str, eps: float, stem: str) -> tuple[str, str]:
    """(norm(x + skip), x + skip)"""
    name = f"{stem}/SkipLayerNorm"
    outputs = [f"{name}/output_0", "", "", f"{name}/output_3"]
    b.node(
        "SkipSimplifiedLayerNormalization",
        [x, skip, b.weight(weight)],
        outputs,
        name,
        domain="com.microsoft",
        epsilon=eps,
    )
    return outputs[0], outputs[3]


def _head_norm(b: GraphBuilder, x: str, weight: str, shape: Shape, name: str) -> str:
    """Qwen3's RMS norm over each head of q or k, before the rotary embedding."""
    split = b.constant("/model/constants/heads_shape", np.array([0, 0, -1, shape.head_dim], np.int64))
    merge = b.constant("/model/constants/merged_shape", np.array([0, 0, -1], np.int64))
    heads = b.node("Reshape", [x, split], 1, f"{name}/Reshape")
    normed = _rms_norm(b, heads, weight, shape.eps, f"{name}/LayerNorm")
    return b.node("Reshape", [normed, merge], 1, f"{name}/Reshape_1")


def _rotary_tables(b: GraphBuilder, config, shape: Shape) -> tuple[str, str]:
    """cos and sin [positions, head_dim / 2], computed by onnxruntime at load from inv_freq."""
    inv_freq, scaling = rotary_frequencies(config)
    stem = "/model/rotary"
    limit = b.constant(f"{stem}/limit", np.array(shape.positions, np.float32))
    start, delta = (
        b.constant(f"{stem}/start", np.array(0, np.float32)),
        b.constant(f"{stem}/delta", np.array(1, np.float32)),
    )
    axes = b.constant(f"{stem}/axes", np.array([1], np.int64))
    t = b.node("Range", [start, limit, delta], 1, f"{stem}/Range")
    column = b.node("Unsqueeze", [t, axes], 1, f"{stem}/Unsqueeze")
    angles = b.node("Mul", [column, b.constant(f"{stem}/inv_freq", inv_freq.reshape(1, -1))], 1, f"{stem}/Mul")
    tables = []
    for op in ("Cos", "Sin"):
        table = b.node(op, [angles], 1, f"{stem}/{op}")
        if scaling != 1.0:
            table = b.node(
                "Mul", [table, b.constant(f"{stem}/scaling", np.array(scaling, np.float32))], 1, f"{stem}/{op}/Mul"
            )
        tables.append(table)
    return tables[0], tables[1]


def _sequence_inputs(b: GraphBuilder) -> tuple[str, str]:
    """GroupQueryAttention's seqlens_k (tokens per row - 1) and total_sequence_length, from the mask."""
    stem = "/model/attn_mask_reformat"
    one = b.constant("/model/constants/one", np.array([1], np.int64))
    total = b.node("ReduceSum", [names.ATTENTION_MASK, one], 1, f"{stem}/ReduceSum", keepdims=0)
    seqlens = b.node("Cast", [b.node("Sub", [total, one], 1, f"{stem}/Sub")], 1, f"{stem}/Sub/Cast", to=6)
    width = b.node(
        "Gather",
        [
            b.node("Shape", [names.ATTENTION_MASK], 1, f"{stem}/Shape"),
            b.constant("/model/constants/index1", np.array(1, np.int64)),
        ],
        1,
        f"{stem}/Gather",
        axis=0,
    )
    return seqlens, b.node("Cast", [width], 1, f"{stem}/Gather/Cast", to=6)


def _attention(b, x, index, source, shape, sequence, tables) -> str:
    module = f"model.layers.{index}.self_attn"
    q, k, v = (b.linear(x, f"{module}.{p}_proj", f"{source}.self_attn.{p}_proj") for p in "qkv")
    if shape.q_k_norm:
        q = _head_norm(b, q, f"{source}.self_attn.q_norm.weight", shape, f"{node_stem(module)}/q_norm")
        k = _head_norm(b, k, f"{source}.self_attn.k_norm.weight", shape, f"{node_stem(module)}/k_norm")
    outputs = [
        f"{node_stem(module)}/GroupQueryAttention/output_0",
        names.present_key(index),
        names.present_value(index),
    ]
    b.node(
        "GroupQueryAttention",
        [q, k, v, names.past_key(index), names.past_value(index), *sequence, *tables],
        outputs,
        f"{node_stem(module)}/GroupQueryAttention",
        domain="com.microsoft",
        num_heads=shape.heads,
        kv_num_heads=shape.kv_heads,
        scale=1.0 / math.sqrt(shape.head_dim),
        local_window_size=shape.windows[index],
        softcap=0.0,
        do_rotary=1,
        rotary_interleaved=0,
    )
    return b.linear(outputs[0], f"{module}.o_proj", f"{source}.self_attn.o_proj")


def _mlp(b: GraphBuilder, x: str, module: str, source: str) -> str:
    """SwiGLU MLP: module names the nodes (model.layers.3.mlp), source the checkpoint's tensors."""
    gate = b.linear(x, f"{module}.gate_proj", f"{source}.gate_proj")
    up = b.linear(x, f"{module}.up_proj", f"{source}.up_proj")
    stem = node_stem(module)
    silu = b.node("Mul", [gate, b.node("Sigmoid", [gate], 1, f"{stem}/act_fn/Sigmoid")], 1, f"{stem}/act_fn/Mul")
    return b.linear(b.node("Mul", [silu, up], 1, f"{stem}/Mul"), f"{module}.down_proj", f"{source}.down_proj")


def _stacked(b: GraphBuilder, parts: list[str], axis: int, name: str) -> str:
    """Concat of the parts, each given a new axis there (onnxruntime folds it at load)."""
    axes = b.constant(f"/model/constants/axis{axis}", np.array([axis], np.int64))
    unsqueezed = [b.node("Unsqueeze", [part, axes], 1, f"{name}/Unsqueeze_{i}") for i, part in enumerate(parts)]
    return b.node("Concat", unsqueezed, 1, f"{name}/Concat", axis=axis)


def _experts(b: GraphBuilder, x: str, index: int, source: str, shape: Shape) -> str:
    """onnxruntime's MoE over the layer's experts, routed by the float router's logits; Qwen2-MoE's
    shared expert added, scaled by its gate."""
    e = shape.experts
    module, held = f"model.layers.{index}.{e.block}", f"{source}.{e.block}"
    stem = node_stem(module)
    logits = b.linear(x, f"{module}.gate", f"{held}.gate")
    rows = b.constant(f"/model/constants/router_rows{e.count}", np.array([-1, e.count], np.int64))
    router = b.node("Reshape", [logits, rows], 1, f"{stem}/router/Reshape")
    gate, up, down = e.projections
    experts = [f"{held}.experts.{i}" for i in range(e.count)]
    # Interleaved rows (gate_0, up_0, gate_1, up_1, ...): [experts, inter, 2, hidden] -> [experts, 2 * inter, hidden].
    pairs = [
        _stacked(
            b, [b.weight(f"{held_by}.{gate}.weight"), b.weight(f"{held_by}.{up}.weight")], 1, f"{stem}/experts.{i}/fc1"
        )
        for i, held_by in enumerate(experts)
    ]
    inter = b.checkpoint.stored(f"{experts[0]}.{gate}.weight").shape[0]
    fc1_shape = b.constant(f"/model/constants/fc1_shape{inter}", np.array([e.count, 2 * inter, shape.hidden], np.int64))
    fc1 = b.node("Reshape", [_stacked(b, pairs, 0, f"{stem}/experts/fc1"), fc1_shape], 1, f"{stem}/experts/fc1/Reshape")
    fc2 = _stacked(b, [b.weight(f"{held_by}.{down}.weight") for held_by in experts], 0, f"{stem}/experts/fc2")
    out = b.node(
        "MoE",
        [x, router, fc1, "", fc2],
        1,
        f"{stem}/experts/MoE",
        domain="com.microsoft",
        k=e.top_k,
        activation_type="swiglu",
        swiglu_fusion=1,  # interleaved gate and up rows
        activation_alpha=1.0,  # silu(gate) * (up + beta): plain SwiGLU
        activation_beta=0.0,
        normalize_routing_weights=int(e.normalize),
    )
    if not e.shared:
        return out
    shared = _mlp(b, x, f"{module}.shared_expert", f"{held}.shared_expert")
    scale = b.node(
        "Sigmoid",
        [b.linear(x, f"{module}.shared_expert_gate", f"{held}.shared_expert_gate")],
        1,
        f"{stem}/shared_expert_gate/Sigmoid",
    )
    gated = b.node("Mul", [scale, shared], 1, f"{stem}/shared_expert/Mul_gate")
    return b.node("Add", [out, gated], 1, f"{stem}/experts/Add")


def _feed_forward(b: GraphBuilder, x: str, index: int, layer: int, source: str, shape: Shape) -> str:
    """The layer's MLP: experts where the config puts them, else a dense SwiGLU MLP."""
    if shape.experts is not None and shape.experts.sparse[layer]:
        return _experts(b, x, index, source, shape)
    return _mlp(b, x, f"model.layers.{index}.mlp", f"{source}.mlp")


def build(config, checkpoint: Checkpoint, layers: list[int] | None = None):
    """The graph of the model (or of only the given decoder layers, renumbered from 0, for a
    parity check on a model too large to run whole); external data points at the checkpoint's
    files by name, so the graph must be saved beside them (links)."""
    from onnx import TensorProto, helper

    shape = read_shape(config)
    chosen = list(range(shape.layers)) if layers is None else list(layers)
    shape = replace(shape, layers=len(chosen), windows=tuple(shape.windows[i] for i in chosen))
    b = GraphBuilder(checkpoint)
    sequence, tables = _sequence_inputs(b), _rotary_tables(b, config, shape)
    residual = b.node(
        "Gather", [b.weight("model.embed_tokens.weight"), names.INPUT_IDS], 1, "/model/embed_tokens/Gather"
    )
    first_norm = f"model.layers.{chosen[0]}.input_layernorm.weight"
    x = _rms_norm(b, residual, first_norm, shape.eps, "/model/layers.0/input_layernorm/LayerNorm")
    for index, layer in enumerate(chosen):
        source, stem = f"model.layers.{layer}", f"/model/layers.{index}"
        attention = _attention(b, x, index, source, shape, sequence, tables)
        post_norm = f"{source}.post_attention_layernorm.weight"
        x, residual = _skip_rms_norm(b, residual, attention, post_norm, shape.eps, f"{stem}/post_attention_layernorm")
        mlp_out = _feed_forward(b, x, index, layer, source, shape)
        # The residual sum after the MLP is normed by the next layer's input norm (the last: the final norm).
        if index + 1 < len(chosen):
            next_norm, name = (
                f"model.layers.{chosen[index + 1]}.input_layernorm.weight",
                f"/model/layers.{index + 1}/input_layernorm",
            )
        else:
            next_norm, name = "model.norm.weight", "/model/norm"
        x, residual = _skip_rms_norm(b, residual, mlp_out, next_norm, shape.eps, name)
    head = "model.embed_tokens.weight" if shape.tied or "lm_head.weight" not in checkpoint else "lm_head.weight"
    b.node("MatMul", [x, b.matrix(head)], [names.LOGITS], "/lm_head/MatMul")

    def value(name, dtype, dims):
        return helper.make_tensor_value_info(name, dtype, dims)

    # The head's last dimension stays symbolic, as genai's builder leaves it: a 4-bit quantized
    # cache stores half as many bytes per head (tasks/quantization/kv_cache.py).
    kv_past = [names.BATCH, shape.kv_heads, names.PAST_SEQUENCE, "kv_cache_dim"]
    kv_total = [names.BATCH, shape.kv_heads, "total_sequence_length", "kv_cache_dim"]
    inputs = [
        value(names.INPUT_IDS, TensorProto.INT64, [names.BATCH, "sequence_length"]),
        value(names.ATTENTION_MASK, TensorProto.INT64, [names.BATCH, "total_sequence_length"]),
    ] + [value(name, TensorProto.FLOAT, kv_past) for name in names.past_names(len(chosen))]
    outputs = [value(names.LOGITS, TensorProto.FLOAT, [names.BATCH, "sequence_length", shape.vocab])]
    outputs += [value(name, TensorProto.FLOAT, kv_total) for name in names.present_names(len(chosen))]
    graph = helper.make_graph(b.nodes, "decoder", inputs, outputs, list(b.initializers.values()))
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="ortforge",
    )
    helper.set_model_props(model, {names.WEIGHTS_SOURCE_KEY: WEIGHTS_FROM_CHECKPOINT})
    return model

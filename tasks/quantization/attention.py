"""A variant's attention on ortforge's own kernel (recipe key `attention: ortforge`).

Its com.microsoft GroupQueryAttention nodes move to ai.ortforge (ortforge/custom_ops.py), whose
kernel takes the same inputs, outputs and attributes and computes the same function (within float
rounding: tests/test_custom_ops.py holds it to onnxruntime's on every path), faster on this
project's CPUs (README, "A hand-written attention kernel"). The variant is then validated like any
other against the original model: int8 activations quantized per token round a 1e-7 difference
into another code now and then, so the gates, not a comparison with the onnxruntime-kernel twin,
say whether it holds.

The kernel implements what onnxruntime-genai's builder writes: nine inputs (no attention bias,
position ids or sinks), rotary inside and not interleaved, no smooth softmax, a head size that is a
multiple of 16; and the int8 cache tasks/quantization/kv_cache.py writes (inputs k_scale and v_scale,
per channel), which it reads without turning it back into floats. Anything else is refused here, in
one line, before the variant is built.
"""

from __future__ import annotations

from pathlib import Path

from ortforge import custom_ops
from tasks.core.errors import StageError
from tasks.quantization import kv_cache

STOCK_DOMAIN = "com.microsoft"
INPUTS = 9  # query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache
CACHE_SCALES = (kv_cache.K_SCALE_INPUT, kv_cache.V_SCALE_INPUT)  # an int8 cache's, which the kernel takes too
REQUIRED_ATTRIBUTES = {"do_rotary": 1, "rotary_interleaved": 0, "smooth_softmax": 0}  # value when unset: 0
HEAD_MULTIPLE = 16  # the kernel's vectors: 16 floats


def attention_nodes(graph) -> list:
    """The graph's GroupQueryAttention nodes still on onnxruntime's kernel."""
    return [node for node in kv_cache.attention_nodes(graph) if node.domain == STOCK_DOMAIN]


def unsupported(node, head_dim: int) -> str | None:
    """Why ortforge's kernel cannot run node (None when it can)."""
    import onnx

    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    extra = [name for index, name in enumerate(node.input) if name and index >= INPUTS and index not in CACHE_SCALES]
    if extra:
        return f"it has inputs beyond the nine the kernel takes and an int8 cache's scales ({', '.join(extra)})"
    for name, wanted in REQUIRED_ATTRIBUTES.items():
        if attributes.get(name, 0) != wanted:
            return f"its {name} is {attributes.get(name, 0)} and the kernel implements {name}={wanted} only"
    if head_dim % HEAD_MULTIPLE:
        return f"its head size {head_dim} is not a multiple of {HEAD_MULTIPLE}"
    return None


def check_supported(graph, model_dir: Path, head_dim: int) -> None:
    """StageError before any slow work when the kernel cannot run this graph or be built here."""
    nodes = attention_nodes(graph)
    if not nodes:
        raise StageError(
            f"attention: ortforge replaces GroupQueryAttention nodes (a graph from onnxruntime-genai's builder); "
            f"{model_dir} has none: set attention: onnxruntime for this model"
        )
    for node in nodes:
        why = unsupported(node, head_dim)
        if why:
            raise StageError(f"attention: ortforge cannot run {node.name}: {why}; set attention: onnxruntime")
    try:
        custom_ops.library()  # the validate stage and every runtime here load it
    except custom_ops.KernelUnavailable as error:
        raise StageError(f"attention: ortforge: {error}") from None


def use_ortforge_kernel(graph) -> None:
    """Move graph's GroupQueryAttention nodes to ortforge's domain (trailing empty inputs dropped)
    and import the domain, which is what makes the runtime load the kernel."""
    import onnx

    for node in attention_nodes(graph):
        while len(node.input) > INPUTS and not node.input[-1]:
            del node.input[-1]
        node.domain = custom_ops.DOMAIN
    if not any(opset.domain == custom_ops.DOMAIN for opset in graph.opset_import):
        graph.opset_import.append(onnx.helper.make_opsetid(custom_ops.DOMAIN, 1))

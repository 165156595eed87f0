"""A quantized KV cache: onnxruntime's GroupQueryAttention (1.32) stores keys and values as int8,
or as 4-bit values packed two per uint8 along the head, quantizing what it writes and dequantizing
what it reads with static per-channel scales the graph carries (attributes k_quant_type,
v_quant_type = PER_CHANNEL and kv_cache_bit_width; inputs k_scale and v_scale, [1, kv_heads, 1,
head_dim]). Graphs without GroupQueryAttention (optimum's export) cannot store it.

The scales come from the variant's own float-cache graph run over the calibration text as one
sequence (samples x tokens, within the context):
- keys: the rotary embedding turns channel i and its partner (i + head/2, or i + 1 when
  interleaved) into each other as the position moves, so one channel's range at the calibrated
  positions says little about later ones. The pair's norm does not change with position and
  bounds both channels everywhere: it is the keys' range.
- values: each channel's largest magnitude times kv_headroom. Text the calibration never saw goes
  beyond its ranges, and clipping costs more than coarser steps: on SmolLM2 int4 (2,048 tokens of
  data/eval/GPL-3.txt) KL from the float cache was 0.013 at 1.0, 0.008 at 1.5, 0.009 at 2.0.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np

from ortforge import names
from tasks.core.errors import StageError
from tasks.graphs import onnx_io
from tasks.quantization import calibration

log = logging.getLogger(__name__)

ATTENTION = "GroupQueryAttention"
K_SCALE_INPUT, V_SCALE_INPUT = 12, 13  # GroupQueryAttention's optional inputs k_scale and v_scale
QUANTIZED_CACHE_ATTRIBUTES = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")
LARGEST_CODE = {8: 127, 4: 7}  # symmetric codes: int8 [-128, 127], int4 [-8, 7]
SMALLEST_SCALE = 1e-4  # of a layer's largest: a channel calibration saw as zero still holds something


def attention_nodes(graph) -> list:
    return [node for node in graph.graph.node if node.op_type == ATTENTION]


def check_supported(graph, model_dir: Path, kv_cache: str) -> None:
    """StageError, before any slow work, when the graph has no GroupQueryAttention to store it."""
    if not attention_nodes(graph):
        raise StageError(
            f"kv_cache {kv_cache} needs GroupQueryAttention nodes (a graph from onnxruntime-genai's builder); "
            f"{model_dir} has none (optimum's export concatenates a float cache): set kv_cache: float for this model"
        )


def calibration_ids(calib, context: int) -> np.ndarray:
    """The calibration chunks as one sequence (they are consecutive slices of the text)."""
    return np.concatenate(calib.chunks())[:context]


def cache_ranges(graph, weights_dir: Path, ids: np.ndarray, head_dim: int) -> dict[str, np.ndarray]:
    """Per past input, the present tensor of a prefill of ids [kv_heads, tokens, head_dim] (float64)."""
    import onnxruntime as ort

    layers = len([i for i in graph.graph.input if i.name.startswith("past_key_values.")]) // 2
    presents = names.present_names(layers)
    with tempfile.TemporaryDirectory() as scratch:
        onnx_io.save_runnable(graph, weights_dir, Path(scratch))
        session = ort.InferenceSession(str(Path(scratch) / names.MODEL_FILE), providers=["CPUExecutionProvider"])
        log.info("KV cache calibration: one prefill of %d tokens", len(ids))
        outputs = session.run(presents, calibration.prefill_feed(graph, ids, head_dim))
    return {past: value[0].astype(np.float64) for past, value in zip(names.past_names(layers), outputs, strict=True)}


def key_range(keys: np.ndarray, interleaved: bool) -> np.ndarray:
    """[kv_heads, head_dim]: each channel's bound at any position, the largest norm of its rotary pair."""
    if interleaved:
        pairs = np.sqrt(keys[..., 0::2] ** 2 + keys[..., 1::2] ** 2).max(axis=1)
        return np.repeat(pairs, 2, axis=-1)
    half = keys.shape[-1] // 2
    pairs = np.sqrt(keys[..., :half] ** 2 + keys[..., half:] ** 2).max(axis=1)
    return np.concatenate([pairs, pairs], axis=-1)


def value_range(values: np.ndarray, headroom: float) -> np.ndarray:
    return np.abs(values).max(axis=1) * headroom


def scale(channel_range: np.ndarray, bits: int) -> np.ndarray:
    """The per-channel scale GroupQueryAttention takes, [1, kv_heads, 1, head_dim] float32."""
    floor = SMALLEST_SCALE * float(channel_range.max())
    steps = np.maximum(channel_range, floor) / LARGEST_CODE[bits]
    return steps[None, :, None, :].astype(np.float32)


def _rotary_interleaved(node) -> bool:
    return bool(onnx_io.attribute(node, "do_rotary", 0) and onnx_io.attribute(node, "rotary_interleaved", 0))


def quantize(graph, weights_dir: Path, calib, context: int, head_dim: int, bits: int, headroom: float) -> None:
    """Store graph's KV cache at bits (8 or 4), with scales calibrated on calib's text
    (weights_dir: where the graph's external data lies)."""
    from onnx import TensorProto, helper, numpy_helper

    ranges = cache_ranges(graph, weights_dir, calibration_ids(calib, context), head_dim)
    for node in attention_nodes(graph):
        past_key, past_value = node.input[3], node.input[4]
        key_scale = scale(key_range(ranges[past_key], _rotary_interleaved(node)), bits)
        value_scale = scale(value_range(ranges[past_value], headroom), bits)
        inputs = list(node.input) + [""] * (V_SCALE_INPUT + 1 - len(node.input))
        for index, past, values in ((K_SCALE_INPUT, past_key, key_scale), (V_SCALE_INPUT, past_value, value_scale)):
            inputs[index] = past + ".scale"
            graph.graph.initializer.append(numpy_helper.from_array(values, inputs[index]))
        del node.input[:]
        node.input.extend(inputs)
        node.attribute.extend(
            [
                helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                helper.make_attribute("kv_cache_bit_width", bits),
            ]
        )
    stored = TensorProto.INT8 if bits == 8 else TensorProto.UINT8
    for value in [*graph.graph.input, *graph.graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.elem_type = stored


def float_cache(graph):
    """A copy of graph (loaded without its weights) that stores its KV cache as float: what a
    quantized cache approximates, and so validate's reference for the error the cache adds."""
    import copy

    twin = copy.deepcopy(graph)
    scales = set()
    for node in attention_nodes(twin):
        inputs = list(node.input)
        for index in (K_SCALE_INPUT, V_SCALE_INPUT):
            if index < len(inputs):
                scales.add(inputs[index])
                inputs[index] = ""
        while inputs and not inputs[-1]:
            inputs.pop()
        attributes = [a for a in node.attribute if a.name not in QUANTIZED_CACHE_ATTRIBUTES]
        del node.input[:], node.attribute[:]
        node.input.extend(inputs)
        node.attribute.extend(attributes)
    initializers = [t for t in twin.graph.initializer if t.name not in scales]
    del twin.graph.initializer[:]
    twin.graph.initializer.extend(initializers)
    float_type = next(o for o in twin.graph.output if o.name == names.LOGITS).type.tensor_type.elem_type
    for value in [*twin.graph.input, *twin.graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.elem_type = float_type
    metadata = [prop for prop in twin.metadata_props if prop.key != names.KV_CACHE_BITS_KEY]
    del twin.metadata_props[:]
    twin.metadata_props.extend(metadata)
    return twin


def stored_bits(graph) -> int:
    """Bits per cached key or value as the graph stores them (32 for a float cache)."""
    import onnx

    for node in attention_nodes(graph):
        kind = onnx_io.attribute(node, "k_quant_type", b"NONE")
        if (kind.decode() if isinstance(kind, bytes) else kind) != "NONE":
            return int(onnx_io.attribute(node, "kv_cache_bit_width", 8))
    past = next(i for i in graph.graph.input if i.name.startswith("past_key_values."))
    return 16 if past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else 32

"""Rotary tables computed when the session loads instead of stored: onnxruntime-genai's builder
stores GroupQueryAttention's cos/sin caches for every position of the context (Gemma 3: four
tables of 32,768 x 128 floats, 67 MB, more than a third of its int4 artifact). Each is
cos(t * inv_freq) for t = 0..positions-1, so the graph can compute it from the 64 frequencies:
Range -> Mul -> Cos/Sin, folded into a constant by onnxruntime at load.

A table is replaced only when onnxruntime's computation reproduces it to float32 rounding
(RECOMPUTE_TOLERANCE); tables with scaled or unusual frequencies stay stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

RECOMPUTE_TOLERANCE = 1e-6
ULPS = 4  # the builder's float32 pow may round inv_freq differently from numpy's


def frequencies(cos: np.ndarray, thetas: tuple[float, ...]) -> np.ndarray | None:
    """inv_freq [half] such that cos(t * inv_freq) is the table, from the rotary bases the config
    names, or None when none fits."""
    positions, half = cos.shape
    t = np.arange(positions, dtype=np.float32)
    exponents = np.arange(0, 2 * half, 2).astype(np.float32) / np.float32(2 * half)
    for theta in thetas:
        base = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
        fitted = np.empty(half, np.float32)
        for j, f in enumerate(base):
            options = np.float32(f) + np.arange(-ULPS, ULPS + 1, dtype=np.float32) * np.spacing(np.float32(f))
            errors = [np.abs(np.cos(t * option) - cos[:, j]).max() for option in options]
            fitted[j] = options[int(np.argmin(errors))]
        if np.abs(np.cos(np.outer(t, fitted)) - cos).max() <= RECOMPUTE_TOLERANCE:
            return fitted
    return None


def _table_nodes(name: str, op: str, positions_name: str, inv_freq_name: str):
    from onnx import helper

    angles = f"{name}/angles"
    return [
        helper.make_node("Mul", [positions_name, inv_freq_name], [angles], name=f"{name}/Mul"),
        helper.make_node(op, [angles], [name], name=f"{name}/{op}"),
    ]


def _computed_by_onnxruntime(positions: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    constants = _constants("t", positions, inv_freq)
    nodes = _position_nodes("t") + _table_nodes("cos", "Cos", "t/column", "t/inv_freq")
    nodes += _table_nodes("sin", "Sin", "t/column", "t/inv_freq")
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin")]
    graph = helper.make_graph(
        nodes, "rotary", [], outputs, [numpy_helper.from_array(v, k) for k, v in constants.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    cos, sin = session.run(None, {})
    return cos, sin


def _constants(stem: str, positions: int, inv_freq: np.ndarray) -> dict[str, np.ndarray]:
    return {
        f"{stem}/start": np.array(0, np.float32),
        f"{stem}/limit": np.array(positions, np.float32),
        f"{stem}/delta": np.array(1, np.float32),
        f"{stem}/axes": np.array([1], np.int64),
        f"{stem}/inv_freq": inv_freq.reshape(1, -1),
    }


def _position_nodes(stem: str):
    from onnx import helper

    return [
        helper.make_node(
            "Range", [f"{stem}/start", f"{stem}/limit", f"{stem}/delta"], [f"{stem}/t"], name=f"{stem}/Range"
        ),
        helper.make_node("Unsqueeze", [f"{stem}/t", f"{stem}/axes"], [f"{stem}/column"], name=f"{stem}/Unsqueeze"),
    ]


def compute_at_load(model, thetas: tuple[float, ...], read: Callable[[str], np.ndarray]) -> list[dict]:
    """Replace each GroupQueryAttention cos/sin table pair that onnxruntime reproduces; return what
    was. read(name) gives an initializer's values (the graph may be loaded without its weights)."""
    from onnx import numpy_helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    pairs = {
        (node.input[7], node.input[8])
        for node in graph.node
        if node.op_type == "GroupQueryAttention" and len(node.input) > 8 and node.input[7] in initializers
    }
    replaced = []
    for cos_name, sin_name in sorted(pairs):
        cos, sin = (read(name) for name in (cos_name, sin_name))
        inv_freq = frequencies(cos, thetas)
        if inv_freq is None:
            log.info("keeping %s stored: no rotary base in the config reproduces it", cos_name)
            continue
        ort_cos, ort_sin = _computed_by_onnxruntime(len(cos), inv_freq)
        gap = float(max(np.abs(ort_cos - cos).max(), np.abs(ort_sin - sin).max()))
        if gap > RECOMPUTE_TOLERANCE:
            log.info("keeping %s stored: onnxruntime computes it %.2g apart", cos_name, gap)
            continue
        stem = f"{cos_name}/computed"
        graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in _constants(stem, len(cos), inv_freq).items())
        for name in (cos_name, sin_name):
            graph.initializer.remove(initializers[name])
        nodes = _position_nodes(stem) + _table_nodes(cos_name, "Cos", f"{stem}/column", f"{stem}/inv_freq")
        nodes += _table_nodes(sin_name, "Sin", f"{stem}/column", f"{stem}/inv_freq")
        for index, node in enumerate(nodes):
            graph.node.insert(index, node)
        replaced.append(
            {
                "tables": [cos_name, sin_name],
                "positions": len(cos),
                "max_abs_diff": gap,
                "bytes_saved": int(cos.nbytes + sin.nbytes),
            }
        )
        log.info("%s and %s computed at load (%.0f MB saved)", cos_name, sin_name, (cos.nbytes + sin.nbytes) / 1e6)
    return replaced

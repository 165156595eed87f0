"""Calibration data for data-aware quantization: token chunks of a fixed text fed to the decoder
graph as prefill inputs (with an empty KV cache), and the statistics taken from them.

GPTQ needs, for each linear layer, H = sum(x x^T) over its inputs (imatrix only its diagonal);
SmoothQuant the largest value of each input channel; static int8 needs an onnxruntime
CalibrationDataReader. All come from the same chunks, so the methods see the same data.

Here the statistics come from the graph run whole in onnxruntime, with the named tensors as extra
outputs; a graph whose weights are the checkpoint's own tensors is calibrated on the PyTorch
model instead, one layer in memory at a time (tasks/quantization/torch_statistics.py).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortforge import names
from tasks.core.errors import StageError
from tasks.core.params import CalibrationConfig
from tasks.graphs import onnx_io

log = logging.getLogger(__name__)

# What statistics of a layer's input an algorithm needs: GPTQ the whole H = sum x x^T; imatrix only
# its diagonal (a full H of every down_proj input of a 1B model alone is 8 GB).
FULL, DIAGONAL = "full", "diagonal"
MAXIMUM = "maximum"  # SmoothQuant's statistic: each input channel's largest magnitude


def token_chunks(cfg: CalibrationConfig, tokenizer_json: Path) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    if not cfg.text.is_file():
        raise StageError(f"calibration text {cfg.text} does not exist; fix calibration.text in params.yaml")
    ids = Tokenizer.from_file(str(tokenizer_json)).encode(cfg.text.read_text(encoding="utf-8")).ids
    needed = cfg.samples * cfg.tokens
    if len(ids) < needed:
        raise StageError(
            f"calibration text {cfg.text} has {len(ids)} tokens, fewer than samples x tokens = {needed}; "
            f"lower calibration.samples or calibration.tokens"
        )
    return [np.asarray(ids[i * cfg.tokens : (i + 1) * cfg.tokens], dtype=np.int64) for i in range(cfg.samples)]


def prefill_feed(model, ids: np.ndarray, head_dim: int) -> dict[str, np.ndarray]:
    """Graph inputs for a prefill of ids with an empty KV cache, shaped from the graph's own inputs
    (head_dim given: genai graphs leave it symbolic)."""
    feed = {names.INPUT_IDS: ids.reshape(1, -1)}
    for graph_input in model.graph.input:
        dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
        if graph_input.name.startswith("past_key_values."):
            feed[graph_input.name] = np.zeros((1, dims[1], 0, head_dim), dtype=np.float32)
    inputs = {i.name for i in model.graph.input}
    if names.ATTENTION_MASK in inputs:
        feed[names.ATTENTION_MASK] = np.ones((1, len(ids)), dtype=np.int64)
    if names.POSITION_IDS in inputs:
        feed[names.POSITION_IDS] = np.arange(len(ids), dtype=np.int64).reshape(1, -1)
    if names.LOGITS_TO_KEEP in inputs:  # one row of logits, not a vocabulary per token
        feed[names.LOGITS_TO_KEEP] = np.array([1], dtype=np.int64)
    return feed


def data_reader(model, chunks: list[np.ndarray], head_dim: int):
    """An onnxruntime CalibrationDataReader over the chunks (for quantize_static)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._feeds: Iterator[dict] = iter([])
            self.rewind()

        def get_next(self):
            return next(self._feeds, None)

        def rewind(self):
            self._feeds = iter([prefill_feed(model, ids, head_dim) for ids in chunks])

    return Reader()


def activations(
    model, tensor_names: list[str], chunks: list[np.ndarray], head_dim: int, weights_dir: Path | None = None
) -> Iterator[dict]:
    """For each chunk, the named intermediate tensors as rows [tokens, channels] in float64
    (weights_dir: where the graph's external data lies, when it was loaded without it)."""
    import copy

    import onnx
    import onnxruntime as ort

    augmented = copy.deepcopy(model)
    known = {o.name for o in augmented.graph.output}
    for name in tensor_names:
        if name not in known:
            augmented.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    with tempfile.TemporaryDirectory() as scratch:
        onnx_io.save_runnable(augmented, weights_dir, Path(scratch))
        session = ort.InferenceSession(str(Path(scratch) / names.MODEL_FILE), providers=["CPUExecutionProvider"])
        for index, ids in enumerate(chunks):
            log.info("calibration pass %d/%d", index + 1, len(chunks))
            outputs = session.run(tensor_names, prefill_feed(model, ids, head_dim))
            yield {
                name: value.reshape(-1, value.shape[-1]).astype(np.float64)
                for name, value in zip(tensor_names, outputs, strict=True)
            }


def accumulate(sums: dict[str, np.ndarray], name: str, x: np.ndarray, kind: str) -> None:
    """Add rows x [n, channels] (float64) to sums[name]: x^T x, or its diagonal; or keep each
    channel's largest magnitude so far (MAXIMUM)."""
    if kind == MAXIMUM:
        sums[name] = np.maximum(sums.get(name, 0), np.abs(x).max(axis=0))
    else:
        sums[name] = sums.get(name, 0) + (x.T @ x if kind == FULL else np.einsum("ij,ij->j", x, x))


def finish(sums: dict[str, np.ndarray], wanted: dict[str, str], rows: int) -> dict[str, np.ndarray]:
    """The statistics from what accumulate gathered over `rows` rows: 2 / n * sum(x x^T) (GPTQ's
    H, or its diagonal), or the channel maxima as they are."""
    return {name: total if wanted[name] == MAXIMUM else total * (2 / rows) for name, total in sums.items()}


def input_hessians(
    model, wanted: dict[str, str], chunks: list[np.ndarray], head_dim: int, weights_dir: Path | None = None
) -> dict[str, np.ndarray]:
    """Per named tensor, 2 / n * sum(x x^T) over its rows x (GPTQ's H; kind "diagonal": only its
    diagonal; "maximum": each channel's largest magnitude), in float64, from the graph run in
    onnxruntime."""
    sums: dict[str, np.ndarray] = {}
    for batch in activations(model, list(wanted), chunks, head_dim, weights_dir):
        for name, x in batch.items():
            accumulate(sums, name, x, wanted[name])
    return finish(sums, wanted, sum(len(ids) for ids in chunks))  # one row per token: a prefill of batch 1


@dataclass(frozen=True)
class Ranges:
    """How large one tensor gets: per channel (SmoothQuant's statistic) and per token."""

    channel_max: np.ndarray
    token_peaks: np.ndarray  # each calibration token's largest magnitude

    @property
    def outlier_ratio(self) -> float:
        """The peak token against the median token: a few models put ~1000x on their first token."""
        return float(self.token_peaks.max() / max(float(np.median(self.token_peaks)), 1e-12))


def activation_ranges(model, tensor_names: list[str], chunks: list[np.ndarray], head_dim: int) -> dict[str, Ranges]:
    channel: dict[str, np.ndarray] = {}
    tokens: dict[str, list[np.ndarray]] = {name: [] for name in tensor_names}
    for batch in activations(model, tensor_names, chunks, head_dim):
        for name, x in batch.items():
            magnitude = np.abs(x)
            channel[name] = np.maximum(channel.get(name, 0), magnitude.max(axis=0))
            tokens[name].append(magnitude.max(axis=1))
    return {name: Ranges(channel[name], np.concatenate(tokens[name])) for name in tensor_names}

"""Calibration statistics from the PyTorch model a graph was written from (ortforge's exporter:
initializers named as the checkpoint's tensors, linears after the model's modules), its decoder
layers read from the checkpoint as they run: the memory of one layer, whatever the model's size,
where running the float graph in onnxruntime would hold all of it.

The same chunks as calibration.input_hessians, run as one batch so each layer is read once; the
statistics of a layer's input are gathered by a hook on the module that reads it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from tasks.core.errors import StageError
from tasks.quantization.calibration import accumulate, finish
from tasks.sources.checkpoint import Checkpoint

log = logging.getLogger(__name__)


class _Enough(Exception):
    """Raised at the output layer's input: calibration needs no logits (8 x 256 rows of a
    128k vocabulary are 1 GB)."""


def _stop(module, args):
    raise _Enough


def calibration_dtype(checkpoint: Checkpoint) -> str:
    """bfloat16 when the checkpoint's weights are bfloat16 and this CPU multiplies bfloat16 faster
    than float32 (measured: 4x here, with AVX512-BF16; CPUs without it emulate bfloat16 and are
    slower), else float32. The statistics are mean squares of a layer's inputs; at Llama 3.2 1B's
    shape bfloat16 moved them by a median 0.04-0.4% per layer, at worst 2.8% of one channel (tests/
    test_torch_statistics.py holds them within 5%), where what they decide is which of 21 ranges a
    block takes."""
    if any(tensor.dtype != "BF16" for tensor in checkpoint.tensors.values()):
        return "float32"
    return "bfloat16" if _bfloat16_is_faster() else "float32"


def _bfloat16_is_faster() -> bool:
    import torch

    def best_seconds(dtype) -> float:
        x, w = torch.ones(256, 2048, dtype=dtype), torch.ones(2048, 2048, dtype=dtype)
        times = []
        for _ in range(4):  # the first run pays for setup
            started = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - started)
        return min(times[1:])

    return best_seconds(torch.bfloat16) < best_seconds(torch.float32)


def checkpoint_statistics(
    modules: dict[str, str], wanted: dict[str, str], hf_dir: Path, chunks: list[np.ndarray]
) -> dict[str, np.ndarray]:
    """input_hessians() from the PyTorch model in hf_dir: modules maps each wanted tensor to the
    module (by name) whose input it is. The chunks run as one batch, so each decoder layer is
    read from the checkpoint once."""
    import torch

    from tasks.evaluation.torch_decoder import load_causal_lm

    dtype = calibration_dtype(Checkpoint(hf_dir))
    model = load_causal_lm(hf_dir, attention="eager", dtype=dtype)
    sums: dict[str, np.ndarray] = {}
    head = model.get_output_embeddings()

    def hook(name: str, stop: bool):
        def record(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double().numpy()
            accumulate(sums, name, x, wanted[name])
            if stop:
                raise _Enough

        return record

    for name, module_name in modules.items():
        module = model.get_submodule(module_name)
        module.register_forward_pre_hook(hook(name, module is head))
    if head is not None and all(model.get_submodule(m) is not head for m in modules.values()):
        head.register_forward_pre_hook(_stop)
    log.info("calibration: %d samples of %d tokens through the PyTorch model in %s", len(chunks), len(chunks[0]), dtype)
    with torch.inference_mode():
        try:
            model(input_ids=torch.as_tensor(np.stack(chunks)), use_cache=False)
        except _Enough:
            pass
    missing = sorted(set(modules) - set(sums))
    if missing:
        raise StageError(f"calibration saw no input of {missing[:3]}; the graph's modules do not match the model")
    return finish(sums, wanted, sum(len(ids) for ids in chunks))

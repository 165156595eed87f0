"""torch_statistics: calibration through the PyTorch model, read layer by layer, gives the
statistics onnxruntime gives on the exported graph; in bfloat16 (chosen for a bf16 checkpoint on a
CPU that multiplies it faster) they stay within a few percent."""

from __future__ import annotations

import numpy as np
import pytest

from ortforge import names
from tasks import quantize
from tasks.core.params import CalibrationConfig
from tasks.graphs import decoder_graph, onnx_io
from tasks.quantization import calibration, layers, torch_statistics
from tasks.quantization.configs import quantize_config
from tasks.sources.checkpoint import Checkpoint
from tests.conftest import REPO

IMATRIX = quantize_config(method="weight_only", algorithm="imatrix", output_algorithm="imatrix")


@pytest.fixture(scope="module")
def graph(built):
    model = onnx_io.load(built["optimized"], with_weights=False)
    metadata = {p.key: p.value for p in model.metadata_props}
    assert metadata[names.WEIGHTS_SOURCE_KEY] == decoder_graph.WEIGHTS_FROM_CHECKPOINT  # ortforge's exporter
    return model


@pytest.fixture(scope="module")
def calib(built):
    text = CalibrationConfig(text=REPO / "data/calibration/python-docs.txt", samples=2, tokens=32)
    return quantize.Calibration(text, built["hf"] / "tokenizer.json", head_dim=16)


def torch_statistics_of(graph, hf_dir, calib, dtype: str, monkeypatch) -> dict[str, np.ndarray]:
    monkeypatch.setattr(torch_statistics, "calibration_dtype", lambda checkpoint: dtype)
    return quantize.statistics(graph, layers.calibrated_inputs(graph, IMATRIX), None, hf_dir, calib)


def test_pytorch_statistics_equal_onnxruntime_on_the_exported_graph(built, graph, calib, monkeypatch):
    from_torch = torch_statistics_of(graph, built["hf"], calib, "float32", monkeypatch)
    wanted = layers.calibrated_inputs(graph, IMATRIX)
    from_graph = calibration.input_hessians(graph, wanted, calib.chunks(), calib.head_dim, built["optimized"])
    assert set(from_torch) == set(from_graph) == set(wanted)
    for name, expected in from_graph.items():
        np.testing.assert_allclose(from_torch[name], expected, rtol=1e-4, atol=1e-6 * expected.max())


@pytest.fixture(scope="module")
def bf16_hf(built, tmp_path_factory):
    """The tiny model saved as a bfloat16 checkpoint, as most checkpoints people download are."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("bf16") / "hf"
    AutoModelForCausalLM.from_pretrained(built["hf"], dtype=torch.bfloat16).save_pretrained(folder)
    for item in built["hf"].iterdir():
        if item.name.startswith("tokenizer") or item.name == "special_tokens_map.json":
            shutil.copy2(item, folder / item.name)
    return folder


def test_bfloat16_statistics_stay_within_a_few_percent_of_float32(bf16_hf, graph, calib, monkeypatch):
    full = torch_statistics_of(graph, bf16_hf, calib, "float32", monkeypatch)
    half = torch_statistics_of(graph, bf16_hf, calib, "bfloat16", monkeypatch)
    for name, expected in full.items():
        relative = np.abs(half[name] - expected) / np.maximum(expected, 1e-3 * expected.max())
        assert np.median(relative) < 0.01 and relative.max() < 0.05, name
    assert any(not np.array_equal(half[name], full[name]) for name in full)  # bfloat16 did run


def test_bfloat16_only_for_a_bf16_checkpoint_on_a_cpu_that_multiplies_it_faster(built, bf16_hf, monkeypatch):
    monkeypatch.setattr(torch_statistics, "_bfloat16_is_faster", lambda: True)
    assert torch_statistics.calibration_dtype(Checkpoint(bf16_hf)) == "bfloat16"
    assert torch_statistics.calibration_dtype(Checkpoint(built["hf"])) == "float32"  # a float32 checkpoint
    monkeypatch.setattr(torch_statistics, "_bfloat16_is_faster", lambda: False)
    assert torch_statistics.calibration_dtype(Checkpoint(bf16_hf)) == "float32"

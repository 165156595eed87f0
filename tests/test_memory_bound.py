"""The build's memory is bounded by its structure, not by luck: a model whose float32 weights are
twice the limit (and whose bfloat16 checkpoint alone is over it) is exported and quantized inside
a hard memory limit (a cgroup of its own where the tests may make one, else RLIMIT_DATA), and
the variant it writes is right. Holding the model whole in any form could not fit."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from benchmarks import random_models
from tests.conftest import REPO, tiny_params, write_params
from tests.memory_limit import memory_limit

# A Llama shape of 36 layers: 574M parameters, 1.15 GB as bfloat16, 2.3 GB as float32.
DEEP = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": True,
    "vocab_size": 8192,
    "hidden_act": "silu",
}
LIMIT = 1_100_000_000  # below the checkpoint's own bytes; Python with torch and onnxruntime is ~0.6 GB of it


@pytest.fixture(scope="module")
def deep_model(built, tmp_path_factory):
    """The checkpoint (a local source) and a params file building it."""
    folder = tmp_path_factory.mktemp("deep")
    source = random_models.write_model(DEEP, built["hf"], folder / "source")
    params = tiny_params(source)
    params["quantize"]["int8"].update(algorithm="rtn", output_algorithm="rtn")  # no calibration text
    write_params(folder, params)
    return folder, source


def stage(folder, module: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", f"tasks.{module}", "--params", str(folder / "params.yaml"), "--model", "tiny", *flags]


def test_download_export_and_quantize_fit_a_limit_below_the_checkpoint(deep_model):
    from tasks.sources.checkpoint import Checkpoint

    folder, source = deep_model
    checkpoint = Checkpoint(source)
    assert checkpoint.float32_bytes() > 2 * LIMIT and sum(t.length for t in checkpoint.tensors.values()) > LIMIT
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    hf, onnx_dir, optimized, variant = folder / "hf", folder / "onnx", folder / "optimized", folder / "int8"
    commands = [
        stage(folder, "download", "--out", str(hf)),
        stage(folder, "export", "--hf", str(hf), "--out", str(onnx_dir)),
        stage(
            folder,
            "optimize",
            "--onnx",
            str(onnx_dir),
            "--hf",
            str(hf),
            "--out",
            str(optimized),
            "--report",
            str(folder / "optimize.json"),
        ),
        stage(
            folder,
            "quantize",
            "--variant",
            "int8",
            "--optimized",
            str(optimized),
            "--hf",
            str(hf),
            "--out",
            str(variant),
        ),
    ]
    for command in commands:
        with memory_limit(LIMIT) as limited:
            done = limited.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            peak = limited.peak()
        assert done.returncode == 0, f"{command[2]} under {limited.how} {LIMIT}: {done.stderr[-2000:]}"
        assert peak is None or peak <= LIMIT, (command[2], peak)
    assert (variant / "model.onnx.data").stat().st_size < 0.6 * checkpoint.float32_bytes() / 2  # 8-bit codes
    assert_variant_follows_the_model(variant, source)


def assert_variant_follows_the_model(variant, hf):
    """Its greedy predictions agree with PyTorch's on most positions (8-bit weights, random model)."""
    from ortforge.decoder import Decoder
    from ortforge.session import create_session
    from tasks.evaluation.torch_decoder import TorchDecoder

    ids = np.random.default_rng(0).integers(0, 384, 24)
    decoder = Decoder(create_session(variant))
    logits, _ = decoder.forward(ids, decoder.empty_cache())
    torch_decoder = TorchDecoder(hf, attention="eager")
    reference, _ = torch_decoder.forward(ids, torch_decoder.empty_cache())
    assert float(np.mean(logits.argmax(-1) == reference.argmax(-1))) >= 0.9
    assert np.abs(logits - reference).max() < 0.1 * np.abs(reference).max()


def test_a_stage_refuses_in_one_line_when_the_limit_is_below_its_estimate(deep_model):
    """optimum's exporter holds the whole float model: inside the limit it stops before work,
    naming the estimate and what the cgroup leaves."""
    folder, source = deep_model
    params = tiny_params(source)
    params["models"]["tiny"]["exporter"] = "optimum"
    (folder / "optimum").mkdir(exist_ok=True)
    write_params(folder / "optimum", params)
    command = stage(folder / "optimum", "export", "--hf", str(source), "--out", str(folder / "refused"))
    with memory_limit(LIMIT) as limited:
        if limited.folder is None:
            pytest.skip("no memory cgroup could be made here: RLIMIT_DATA is not what the preflight reads")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = limited.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]  # the rest is its log
    assert done.returncode == 2 and len(lines) == 1 and done.stderr.strip().endswith(lines[0]), done.stderr[-2000:]
    assert lines[0].startswith("error: export@tiny needs about") and "of memory (the whole 2.3 GB float32" in lines[0]
    assert "are available" in lines[0] and not (folder / "refused").exists()


def test_streamed_pytorch_equals_the_whole_model(built):
    from tasks.evaluation.torch_decoder import TorchDecoder

    ids = np.random.default_rng(0).integers(0, 384, 40)
    whole = TorchDecoder(built["hf"], attention="eager")
    streamed = TorchDecoder(built["hf"], attention="eager", resident_bytes=0)
    for decoder in (whole, streamed):
        first, cache = decoder.forward(ids[:30], decoder.empty_cache())
        decoder.outputs = [first, decoder.forward(ids[30:], cache)[0]]
    for a, b in zip(whole.outputs, streamed.outputs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_limit_is_real():
    """What the limit holds is not vacuous: a process touching more memory than it is stopped."""
    with memory_limit(300_000_000) as limited:
        done = limited.run([sys.executable, "-c", "b = bytearray(600_000_000); b[::4096] = b'x' * len(b[::4096])"])
    assert done.returncode != 0  # killed by the cgroup, or MemoryError under RLIMIT_DATA

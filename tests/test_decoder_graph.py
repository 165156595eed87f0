"""ortforge's own exporter (tasks/graphs/decoder_graph.py): the graph made from the config and the
checkpoint's own tensors matches PyTorch on the configs people bring (bfloat16 weights, Llama 3
and YaRN rope scaling, biased q/k/v, Qwen3's head norms, sliding windows); it links the
checkpoint instead of copying it; a model too large to run whole is checked on a few of its
layers; what it cannot write is refused with the reason; and the weights it reads through Cast and
Transpose nodes fold into the plain float32 graph onnxruntime would make of them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks import export
from tasks.core.params import ExportConfig
from tasks.graphs import decoder_graph, onnx_io
from tests import families
from tests.conftest import EVAL_TEXT

CONFIGS = {
    "llama-bf16-llama3-rope": (
        "llama",
        {
            "torch_dtype": "bfloat16",
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-yarn": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    ),
    "qwen2-biased-qkv": ("qwen2", {}),
    "qwen3-head-norms": ("qwen3", {}),
    "mistral-window": ("mistral", {}),
}


def build_with(family: str, overrides: dict, folder):
    """The family's tiny model with config overrides; torch_dtype bfloat16 stores it so."""
    import torch
    import transformers

    hf = families.build(family, folder, EVAL_TEXT, **{k: v for k, v in overrides.items() if k != "torch_dtype"})
    if overrides.get("torch_dtype") == "bfloat16":
        model = getattr(transformers, families.FAMILIES[family][1]).from_pretrained(hf)
        model.to(torch.bfloat16).save_pretrained(hf)
    return hf


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_graph_from_the_checkpoint_matches_pytorch(case, tmp_path):
    family, overrides = CONFIGS[case]
    hf = build_with(family, overrides, tmp_path / "hf")
    result = export.run(ExportConfig(), "auto", hf, tmp_path / "onnx")
    record = json.loads((tmp_path / "onnx" / export.RECORD_FILE).read_text())
    assert result.exporter == "ortforge" and record["refused"] == {}
    assert record["parity"]["max_relative_logit_diff"] < 1e-5
    if family == "mistral":
        assert record["parity"]["tokens"] > families.SLIDING_WINDOW  # the check saw the window slide
    graph = onnx_io.load(tmp_path / "onnx", with_weights=False)
    stored = {t.data_type for t in graph.graph.initializer if t.data_location == 1}
    assert stored == ({16} if overrides.get("torch_dtype") == "bfloat16" else {1})  # the checkpoint's own dtype


def test_the_checkpoint_is_linked_not_copied(built):
    for path in built["hf"].glob("*.safetensors"):
        assert (built["onnx"] / path.name).stat().st_ino == path.stat().st_ino
    assert sum(p.stat().st_size for p in built["onnx"].iterdir() if p.suffix == ".onnx") < 100_000


def test_a_model_too_large_to_run_whole_is_checked_on_a_few_layers(tmp_path, monkeypatch):
    from tasks.evaluation import torch_decoder

    hf = build_with("mistral", {"num_hidden_layers": 4}, tmp_path / "hf")
    monkeypatch.setattr(torch_decoder, "RESIDENT_BYTES", 0)
    export.run(ExportConfig(), "ortforge", hf, tmp_path / "onnx")
    record = json.loads((tmp_path / "onnx" / export.RECORD_FILE).read_text())
    assert record["parity"]["layers"] == [0, 1] and record["parity"]["max_relative_logit_diff"] < 1e-5
    assert not (tmp_path / "onnx" / "parity").exists()
    graph = onnx_io.load(tmp_path / "onnx", with_weights=False)
    assert sum(n.op_type == "GroupQueryAttention" for n in graph.graph.node) == 4  # the written graph is whole


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling `dynamic` changes with the sequence"),
        ({"hidden_act": "gelu"}, "activation `gelu`"),
        ({"mlp_bias": True}, "biased MLP projections"),
    ],
)
def test_what_it_cannot_write_is_refused_with_the_reason(change, reason):
    config = families.config_for("llama")
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(decoder_graph.Unsupported, match=reason):
        decoder_graph.check_supported(config)
    with pytest.raises(decoder_graph.Unsupported, match="it writes llama, mistral, qwen2, qwen3"):
        decoder_graph.check_supported(families.config_for("gemma3"))


def test_node_names_map_back_to_the_modules():
    for module in ("model.layers.3.mlp.down_proj", "model.layers.12.self_attn.q_proj", "lm_head"):
        assert decoder_graph.module_of(decoder_graph.node_stem(module) + "/MatMul") == module
    assert decoder_graph.node_stem("model.layers.3.mlp.down_proj") == "/model/layers.3/mlp/down_proj"


def test_folded_float_graph_computes_what_the_checkpoint_graph_does(tmp_path):
    """bfloat16 tensors read through Cast and Transpose fold into float32 initializers (a tied
    table stored once, as the output layer's [hidden, vocab] with a Transpose for the lookup)."""
    from ortforge import Decoder, create_session, names
    from tasks.evaluation.metrics import full_pass_logits
    from tasks.graphs.weights import ExternalData
    from tasks.quantize import float_graph

    hf = build_with("llama", {"torch_dtype": "bfloat16"}, tmp_path / "hf")
    export.run(ExportConfig(), "ortforge", hf, tmp_path / "onnx")
    folder = tmp_path / "float"
    folder.mkdir()
    graph = float_graph(tmp_path / "onnx", ExternalData(folder, "model.onnx.data"))
    onnx_io.save_graph_only(graph, folder)
    assert {t.data_type for t in graph.graph.initializer} <= {1, 7}  # float32 (and int64 constants)
    stored = {t.name for t in graph.graph.initializer}
    assert "Cast" not in {n.op_type for n in graph.graph.node if n.input[0] in stored}
    vocab_sized = [t for t in graph.graph.initializer if families.COMMON["vocab_size"] in t.dims]
    assert len(vocab_sized) == 1 and list(vocab_sized[0].dims) == [64, families.COMMON["vocab_size"]]
    ids = np.random.default_rng(0).integers(0, families.COMMON["vocab_size"], 20)

    def logits(path):
        return full_pass_logits(Decoder(create_session(path), head_dim=16, layout=names.KV_SHARED), ids)

    np.testing.assert_allclose(logits(folder), logits(tmp_path / "onnx"), atol=1e-5)

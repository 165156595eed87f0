"""export: a KV-cache graph with the standard names from any exporter, kept only when it matches
PyTorch; `auto` falls back from ortforge's exporter to genai's builder to optimum; tied weights are
stored once."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ortforge import names
from tasks import export
from tasks.core.params import ExportConfig
from tasks.core.stage import StageError
from tasks.graphs import exporters, onnx_io
from tests import families
from tests.conftest import EVAL_TEXT


def test_optimum_graph_has_standard_kv_names(built_optimum):
    graph = onnx_io.load(built_optimum["onnx"], with_weights=False)
    inputs = [i.name for i in graph.graph.input]
    outputs = [o.name for o in graph.graph.output]
    assert inputs == [names.INPUT_IDS, names.ATTENTION_MASK, names.POSITION_IDS, *names.past_names(2)]
    assert outputs == [names.LOGITS, *names.present_names(2)]
    dims = [d.dim_param for d in graph.graph.input[3].type.tensor_type.shape.dim]
    assert dims[0] == names.BATCH and dims[2] == names.PAST_SEQUENCE


@pytest.mark.parametrize("exporter", ["ortforge", "genai"])
def test_fused_graphs_have_standard_kv_names_and_fused_attention(built, built_genai, exporter):
    graph = onnx_io.load((built if exporter == "ortforge" else built_genai)["onnx"], with_weights=False)
    inputs = {i.name for i in graph.graph.input}
    outputs = {o.name for o in graph.graph.output}
    assert {names.INPUT_IDS, names.ATTENTION_MASK, *names.past_names(2)} == inputs
    assert outputs == {names.LOGITS, *names.present_names(2)}
    ops = onnx_io.op_counts(graph)
    assert ops["GroupQueryAttention"] == 2 and ops["SkipSimplifiedLayerNormalization"] >= 2
    assert sum(ops.values()) < 100  # a handful of nodes per layer, no shape arithmetic


def test_run_records_the_exporter_and_its_parity_with_pytorch(built):
    record = json.loads((built["onnx"] / export.RECORD_FILE).read_text())
    assert record["exporter"] == "ortforge" and record["refused"] == {}
    assert record["parity"]["max_relative_logit_diff"] < 1e-5
    assert record["parity"]["cached_steps"] == export.PARITY_STEPS


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    def build(family: str):
        return families.build(family, tmp_path_factory.mktemp(family) / "hf", EVAL_TEXT)

    return build


def test_auto_falls_back_to_optimum_when_genai_gets_attention_windows_wrong(tiny_family, tmp_path):
    # genai's builder hard-codes Gemma 3's layer pattern; this config's second layer attends fully.
    result = export.run(ExportConfig(), "auto", tiny_family("gemma3"), tmp_path / "onnx")
    record = json.loads((tmp_path / "onnx" / export.RECORD_FILE).read_text())
    assert result.exporter == record["exporter"] == "optimum"
    assert "attention windows per layer are [8, 8], the model's config says [8, -1]" in record["refused"]["genai"]
    assert record["parity"]["tokens"] > families.SLIDING_WINDOW  # the check saw the window slide


def test_tied_matrix_stored_once_when_the_exporter_wrote_it_twice(tiny_family, tmp_path):
    from safetensors.numpy import load_file

    hf = tiny_family("gemma3")
    export.run(ExportConfig(), "optimum", hf, tmp_path / "onnx")
    record = json.loads((tmp_path / "onnx" / export.RECORD_FILE).read_text())
    assert [entry["kept"] for entry in record["shared_weights"]] == ["model.embed_tokens.weight"]
    graph = onnx_io.load(tmp_path / "onnx")
    stored = onnx_io.initializer_bytes(graph)
    weights = sum(array.nbytes for array in load_file(hf / "model.safetensors").values())
    assert stored <= weights * 1.01  # no second vocabulary matrix


def test_explicit_genai_refusal_names_the_fix(tiny_family, tmp_path):
    with pytest.raises(
        StageError, match=r"no exporter produced .*builder does not take GPT2LMHeadModel\).*exporter: optimum"
    ):
        export.run(ExportConfig(), "genai", tiny_family("gpt2"), tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_graph_that_differs_from_pytorch_is_refused(built, tmp_path, monkeypatch):
    monkeypatch.setattr(export, "PARITY_TOLERANCE", 1e-12)  # float32 rounding alone now fails it
    with pytest.raises(StageError) as error:
        export.run(ExportConfig(), "auto", built["hf"], tmp_path / "onnx")
    message = str(error.value)
    for exporter in ("ortforge", "genai", "optimum"):
        assert f"{exporter}: its logits differ from PyTorch's" in message
    assert not (tmp_path / "onnx").exists()


def with_config(built, tmp_path, **changes):
    hf = tmp_path / "hf"
    shutil.copytree(built["hf"], hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | changes))
    return hf


def test_run_refuses_unknown_architecture_before_loading_it(built, tmp_path):
    hf = with_config(built, tmp_path, model_type="mystery-net")
    with pytest.raises(StageError, match=r"config.json: transformers [\d.]+ cannot read it"):
        export.run(ExportConfig(), "auto", hf, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_run_refuses_folder_without_config(tmp_path):
    with pytest.raises(StageError, match="has no config.json; run the download stage first"):
        export.run(ExportConfig(), "auto", tmp_path, tmp_path / "onnx")


def test_expected_windows_follow_the_config():
    arch = families.config_for("gemma3")
    from tasks.graphs.architecture import Architecture

    dims = Architecture(
        "gemma3_text", "Gemma3ForCausalLM", 2, 64, 4, 2, 32, 1024, 384, True, 8, tuple(arch.layer_types)
    )
    assert export.expected_windows(dims) == [8, -1]
    assert export.expected_windows(dims.__class__(**{**dims.__dict__, "sliding_window": None})) == [-1, -1]
    assert np.all(np.array(export.expected_windows(dims.__class__(**{**dims.__dict__, "layer_types": None}))) == 8)


@pytest.mark.parametrize("family", sorted(families.REFUSED))
def test_a_family_no_exporter_takes_is_refused_in_one_line_with_each_reason(family, tmp_path):
    """Every exporter's failure, a torch trace's page of context included, becomes one clause of
    one line; a failure of the PyTorch comparison run is PyTorch's, not onnxruntime's."""
    hf = families.build(family, tmp_path / "hf", EVAL_TEXT)
    with pytest.raises(StageError) as refusal:
        export.run(ExportConfig(), "auto", hf, tmp_path / "onnx")
    message = str(refusal.value)
    assert "\n" not in message and message.startswith("no exporter produced a faithful graph")
    assert all(f"{exporter}: " in message for exporter in exporters.candidates("auto"))
    assert "onnxruntime running its graph" not in message
    assert not (tmp_path / "onnx").exists()


def test_exporters_are_ruled_out_from_config_json_alone():
    """ortforge's and genai's families, optimum's task list and what optimum is known to fail on,
    read without exporting anything: StarCoder2 and Falcon's new decoder architecture none takes
    (refused before work); Falcon-7B's layout optimum lists, so its export decides."""
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"} <= exporters.genai_architectures()
    llama = families.config_for("llama")
    llama.architectures = ["LlamaForCausalLM"]
    assert exporters.refusals(llama, "auto") == {} and exporters.refusal(llama, "auto") is None
    starcoder2 = families.config_for("starcoder2")
    starcoder2.architectures = ["Starcoder2ForCausalLM"]
    assert exporters.refusal(starcoder2, "auto") == (
        "no exporter can take Starcoder2ForCausalLM (ortforge: ortforge's exporter does not write it: it writes "
        "llama, mistral, qwen2, qwen3 decoders, not model_type `starcoder2`; genai: onnxruntime-genai's builder does "
        "not take Starcoder2ForCausalLM; optimum: optimum-onnx cannot export model_type `starcoder2` with a KV "
        "cache); use a supported causal LM"
    )
    falcon = families.config_for("falcon")
    falcon.architectures = ["FalconForCausalLM"]
    assert exporters.refusal(falcon, "auto").endswith(
        "optimum: optimum-onnx's export fails: its trace of Falcon's new decoder architecture fails (Sizes of "
        "tensors must match)); use a supported causal LM"
    )
    falcon.new_decoder_architecture = False  # Falcon-7B's layout: optimum may take it, its export decides
    assert set(exporters.refusals(falcon, "auto")) == {"ortforge", "genai"} and not exporters.refusal(falcon, "auto")
    only_genai = exporters.refusal(falcon, "genai")
    assert only_genai.startswith("no exporter can take FalconForCausalLM (genai: ") and "exporter: auto" in only_genai


@pytest.mark.parametrize("model_type", sorted(exporters.OPTIMUM_FAILS))
def test_what_optimum_is_known_to_fail_on_still_fails(model_type, tmp_path):
    """OPTIMUM_FAILS refuses these configs before any work; this exports one, so a new optimum
    that mends it fails here instead of a model it could export being refused."""
    family = next(f for f in families.REFUSED if families.config_for(f).model_type == model_type)
    hf = families.build(family, tmp_path / "hf", EVAL_TEXT)
    assert exporters.optimum_fails(families.config_for(family)) is not None
    with pytest.raises(export.ExportRefused, match="optimum-onnx's export failed"):
        export.export_optimum(ExportConfig(), hf, tmp_path / "onnx", False)

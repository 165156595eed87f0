"""Every architecture family ortforge takes, through every stage: a tiny random model from the
family's real config class is downloaded (local folder), exported (`auto`: ortforge's own exporter
for the LLaMA-style and mixture-of-experts families, genai's builder where it is faithful, optimum
otherwise), optimized, quantized to fp32, int8 and int4 (experts too), and validated against
PyTorch; the runtime's prefill, cached decode and batched rows equal PyTorch, and the server
answers with the runtime's tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks import export
from tasks.evaluation.torch_decoder import TorchDecoder
from tasks.graphs import decoder_graph
from tests import families

# ortforge's exporter writes the LLaMA-style families; where genai's builder is faithful it comes
# next; it refuses GPT-2 and gets the Gemma 2 / Gemma 3 layer patterns of these configs wrong.
EXPECTED_EXPORTER = {
    "llama": "ortforge",
    "mistral": "ortforge",
    "qwen2": "ortforge",
    "qwen3": "ortforge",
    "phi3": "genai",
    "gemma": "genai",
    "gemma2": "optimum",
    "gemma3": "optimum",
    "gpt2": "optimum",
    "mixtral": "ortforge",
    "qwen2_moe": "ortforge",
    "qwen3_moe": "ortforge",
    "opt": "optimum",
    "bloom": "optimum",
}


@pytest.fixture(scope="module", params=sorted(families.FAMILIES))
def family_build(request, tmp_path_factory):
    built = families.through_every_stage(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, built["folders"], built["reports"]


def test_auto_exporter_choice(family_build):
    family, out, _ = family_build
    record = json.loads((out["onnx"] / export.RECORD_FILE).read_text())
    assert record["exporter"] == EXPECTED_EXPORTER[family]
    assert record["parity"]["max_relative_logit_diff"] < 1e-5


def test_every_variant_validates_with_every_linear_quantized(family_build):
    family, _, reports = family_build
    for variant, figures in reports.items():
        assert figures["coverage"]["share_as_asked"] == 1.0, variant
        bits = {"fp32": "32", "int8": "8", "int4": "4"}[variant]
        roles = figures["coverage"]["by_role"]
        assert set(roles["linear"]) == {bits}, variant
        assert set(roles["output"]) == {bits}, variant
        if family in families.MOE:  # every sparse layer's experts at the variant's width; routers float
            config = families.config_for(family)
            sparse = decoder_graph.read_experts(config, config.num_hidden_layers).sparse
            assert set(roles["experts"]) == {bits} and roles["experts"][bits]["matrices"] == sum(sparse), variant
            assert set(roles["router"]) == {"32"}, variant
        else:
            assert "experts" not in roles and "router" not in roles


def test_an_int4_whose_experts_stayed_float_fails_coverage(family_build, tmp_path, monkeypatch):
    """An int4 that rewrote every linear but left the experts, most of a MoE model's weights, float
    must not pass: before experts were counted, such a variant read as 100% as asked."""
    from tasks import quantize, validate
    from tasks.core.params import Params
    from tasks.quantization import weight_only
    from tests.conftest import tiny_params

    family, out, _ = family_build
    if family not in families.MOE:
        pytest.skip("a dense family has no experts")
    recipe = Params.model_validate(tiny_params(out["hf"])).variant("int4")
    monkeypatch.setattr(weight_only, "quantize_experts", lambda *args: [])
    quantize.run(recipe, out["optimized"], out["hf"], tmp_path / "int4", {"model": family})
    judged = validate.measure_coverage(tmp_path / "int4", recipe)
    assert judged["not_as_asked"] and all("(MoE, 32-bit, asked 4)" in line for line in judged["not_as_asked"])
    roles = judged["by_role"]
    total = sum(row["parameters"] for rows in roles.values() for row in rows.values())
    assert judged["share_as_asked"] == pytest.approx(1 - roles["experts"]["32"]["parameters"] / total)
    assert roles["linear"].keys() == {"4"}  # every linear was quantized


def test_runtime_prefill_and_cached_decode_equal_pytorch(family_build):
    from ortforge import TextGenerator

    _, out, _ = family_build
    assert families.runtime_gap(out["fp32"], out["hf"]) < 1e-4

    generator = TextGenerator(out["fp32"])
    prompt = generator.encode("The GNU General Public License is")
    tokens = generator.generate_ids(prompt, 8)
    torch_decoder = TorchDecoder(out["hf"], attention="eager")
    reference_tokens = []
    logits, cache = torch_decoder.forward(prompt, torch_decoder.empty_cache())
    for _ in range(len(tokens)):
        reference_tokens.append(int(np.argmax(logits[-1])))
        logits, cache = torch_decoder.forward([reference_tokens[-1]], cache)
    assert tokens == reference_tokens


def test_batched_rows_equal_each_sequence_alone(family_build):
    """Rows of different lengths decoded together in one run (the server's continuous batching)
    give each sequence's batch-1 logits, on the int4 artifact (for MoE: QMoE routes every row's
    tokens apart)."""
    import onnxruntime as ort

    from ortforge import TextGenerator
    from ortforge.batch import BatchDecoder

    _, out, _ = family_build
    generator = TextGenerator(out["int4"])
    if not BatchDecoder.supports(generator.session):
        pytest.skip("this family's graph (optimum's) concatenates its cache: one sequence a run")
    assert isinstance(generator.session, ort.InferenceSession)
    prompts = [generator.encode(text) for text in ("The GNU General Public License", "Lua", "static int str_find")]
    batch = BatchDecoder(generator.session, slots=3)
    first = {row: batch.prefill(row, ids) for row, ids in enumerate(prompts)}
    tokens = {row: int(np.argmax(logits)) for row, logits in first.items()}
    stepped = batch.step(tokens)
    for row, ids in enumerate(prompts):
        logits, cache = generator.decoder.forward(ids, generator.decoder.empty_cache(), last_only=True)
        np.testing.assert_allclose(first[row], logits[-1], rtol=1e-4, atol=1e-4)
        logits, _ = generator.decoder.forward([tokens[row]], cache, last_only=True)
        np.testing.assert_allclose(stepped[row], logits[-1], rtol=1e-4, atol=1e-4)


def test_the_server_answers_with_the_runtime_tokens(family_build):
    """`ortforge serve` on the int4 artifact: two concurrent completions share batched runs and
    each equals the runtime's own greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from ortforge import TextGenerator
    from tests.test_server import MODEL, serving

    family, out, _ = family_build
    if family not in families.MOE:
        pytest.skip("the server's own tests cover the dense families")
    generator = TextGenerator(out["int4"])
    prompts = ["The GNU General Public License is", "local function"]
    with serving(out["int4"], slots=2) as (url, _):

        def complete(prompt):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(complete, prompts))
    assert texts == [generator.generate(prompt, 10) for prompt in prompts]


def test_a_config_without_a_position_count_takes_its_familys_trained_context():
    """Bloom's ALiBi configs declare no max_position_embeddings: its trained context stands in,
    the user's config stays as it is; another family missing it is still asked to add it."""
    from tasks.core.errors import StageError
    from tasks.graphs import architecture

    bloom = families.config_for("bloom")
    assert getattr(bloom, "max_position_embeddings", None) is None
    assert architecture.from_config(bloom, bloom).context_length == architecture.TRAINED_CONTEXT["bloom"]
    llama = families.config_for("llama")
    del llama.max_position_embeddings
    with pytest.raises(StageError, match="declares no max_position_embeddings; add it"):
        architecture.from_config(llama, llama)

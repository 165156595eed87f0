"""Every architecture family ortforge takes, through every stage: a tiny random model from the
family's real config class is downloaded (local folder), exported (`auto`: genai's builder where
it is faithful, optimum otherwise), optimized, quantized to fp32, int8 and int4, and validated
against PyTorch; the runtime's prefill and cached decode equal PyTorch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks import download, export, optimize, quantize, reference, validate
from tasks.params import Params
from tasks.torch_decoder import TorchDecoder
from tests import families
from tests.conftest import EVAL_TEXT, VARIANTS, tiny_params

# Where genai's builder is faithful it is chosen; it refuses GPT-2 and gets the Gemma 2 / Gemma 3
# layer patterns of these configs wrong.
EXPECTED_EXPORTER = {
    "llama": "genai",
    "mistral": "genai",
    "qwen2": "genai",
    "qwen3": "genai",
    "phi3": "genai",
    "gemma": "genai",
    "gemma2": "optimum",
    "gemma3": "optimum",
    "gpt2": "optimum",
}


@pytest.fixture(scope="module", params=sorted(families.FAMILIES))
def family_build(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    params = Params.model_validate(tiny_params(families.build(family, root / "src", EVAL_TEXT)))
    out = {name: root / name for name in ("hf", "onnx", "optimized", "reference")}
    download.run(params.model("tiny"), out["hf"])
    export.run(params.export, "auto", out["hf"], out["onnx"])
    optimize.run(params.optimize, out["onnx"], out["hf"], out["optimized"])
    reference.run(params.validation.eval, out["hf"], out["reference"])
    reports = {}
    for variant in VARIANTS:
        out[variant] = root / "variants" / variant
        quantize.run(params.variant(variant), out["optimized"], out["hf"], out[variant], {"model": family})
        reports[variant] = validate.run(
            params.validation.eval,
            params.thresholds("tiny", variant),
            out[variant],
            out["reference"],
            root / f"{variant}.json",
            variant,
        )
    return family, out, reports


def test_auto_exporter_choice(family_build):
    family, out, _ = family_build
    record = json.loads((out["onnx"] / export.RECORD_FILE).read_text())
    assert record["exporter"] == EXPECTED_EXPORTER[family]
    assert record["parity"]["max_relative_logit_diff"] < 1e-5


def test_every_variant_validates_with_every_linear_quantized(family_build):
    _, _, reports = family_build
    for variant, figures in reports.items():
        assert figures["coverage"]["share_as_asked"] == 1.0, variant
        bits = {"fp32": "32", "int8": "8", "int4": "4"}[variant]
        assert set(figures["coverage"]["by_role"]["linear"]) == {bits}, variant
        assert set(figures["coverage"]["by_role"]["output"]) == {bits}, variant


def test_runtime_prefill_and_cached_decode_equal_pytorch(family_build):
    from ortforge import Decoder, TextGenerator

    _, out, _ = family_build
    ids = np.random.default_rng(1).integers(3, 384, 20)
    torch_decoder = TorchDecoder(out["hf"], attention="eager")
    expected, _ = torch_decoder.forward(ids, torch_decoder.empty_cache())
    decoder = Decoder.for_artifact(out["fp32"])
    logits, cache = decoder.forward(ids[:14], decoder.empty_cache())
    stepped = [logits]
    for token in ids[14:]:
        logits, cache = decoder.forward([int(token)], cache)
        stepped.append(logits)
    assert np.abs(np.concatenate(stepped) - expected).max() < 1e-4 * np.abs(expected).max()

    generator = TextGenerator(out["fp32"])
    prompt = generator.encode("The GNU General Public License is")
    tokens = generator.generate_ids(prompt, 8)
    reference_tokens = []
    logits, cache = torch_decoder.forward(prompt, torch_decoder.empty_cache())
    for _ in range(len(tokens)):
        reference_tokens.append(int(np.argmax(logits[-1])))
        logits, cache = torch_decoder.forward([reference_tokens[-1]], cache)
    assert tokens == reference_tokens

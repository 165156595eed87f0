"""A quantized KV cache (tasks/quantization/kv_cache.py): GroupQueryAttention stores int8 or packed
4-bit codes with calibrated scales; the runtime's buffers shrink by 4 and 8; quality stays near the
float cache's; batched decode still equals batch-1 runs; validate checks the cache is what the
variant's name says."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortforge import names
from ortforge.decoder import Decoder
from ortforge.generate import TextGenerator
from ortforge.manifest import read_manifest, write_manifest
from ortforge.session import create_session
from tasks import quantize, validate
from tasks.core.errors import StageError
from tasks.core.params import Thresholds
from tasks.quantization import kv_cache
from tasks.quantization.configs import quantize_config
from tests.conftest import WEIGHT_ONLY, assert_batched_decode_equals_batch_1

INT4_KV8 = {**WEIGHT_ONLY, "kv_cache": "int8"}
LOOSE = Thresholds(
    ppl_ratio=1e9, kl_divergence=1e9, top1_agreement=0.0, greedy_agreement=0.0, kv_max_prob_diff=1.0, kv_cache_kl=1e9
)


@pytest.fixture(scope="module")
def kv_variants(built, params, tmp_path_factory) -> dict[str, object]:
    """fp32 weights with a float, int8 and int4 cache, and int4 weights with an int8 cache."""
    root = tmp_path_factory.mktemp("kv")
    recipes = {
        "fp32_kv8": {"method": "fp32", "kv_cache": "int8"},
        "fp32_kv4": {"method": "fp32", "kv_cache": "int4"},
        "int4_kv8": INT4_KV8,
    }
    out = {}
    for name, recipe in recipes.items():
        out[name] = root / name
        record = {"model": "tiny", "variant": name, "tool_versions": {}}
        quantize.run(quantize_config(**recipe), built["optimized"], built["hf"], out[name], record, params.calibration)
    return out


def _decoder(folder) -> Decoder:
    return Decoder(create_session(folder))


def test_the_graph_stores_the_cache_at_the_asked_width(built, kv_variants):
    for name, bits, dtype in (("fp32_kv8", 8, onnx.TensorProto.INT8), ("fp32_kv4", 4, onnx.TensorProto.UINT8)):
        graph = onnx.load(str(kv_variants[name] / "model.onnx"), load_external_data=False)
        assert kv_cache.stored_bits(graph) == bits
        pasts = [i for i in graph.graph.input if i.name.startswith("past_key_values.")]
        assert pasts and all(i.type.tensor_type.elem_type == dtype for i in pasts)
        attention = kv_cache.attention_nodes(graph)
        assert attention and all(node.input[kv_cache.K_SCALE_INPUT].endswith(".scale") for node in attention)
    float_graph = onnx.load(str(built["fp32"] / "model.onnx"), load_external_data=False)
    assert kv_cache.stored_bits(float_graph) == 32


def test_cache_bytes_per_token_are_a_quarter_and_an_eighth(built, kv_variants):
    float_bytes = _decoder(built["fp32"]).kv_bytes_per_token
    assert _decoder(kv_variants["fp32_kv8"]).kv_bytes_per_token * 4 == float_bytes
    assert _decoder(kv_variants["fp32_kv4"]).kv_bytes_per_token * 8 == float_bytes
    decoder = _decoder(kv_variants["fp32_kv4"])
    _, cache = decoder.forward(list(range(5, 40)), decoder.empty_cache())
    assert decoder._arrays[0].dtype == np.uint8 and decoder._arrays[0].shape[-1] == decoder.head_dim // 2


def _kl_from_float(built, folder, ids) -> float:
    """Mean KL divergence of folder's next-token distributions from the float cache's, decoding ids
    one token at a time after a prefill (every position reads the stored cache)."""

    def distributions(decoder):
        logits, cache = decoder.forward(ids[:16], decoder.empty_cache())
        rows = [logits]
        for token in ids[16:]:
            logits, cache = decoder.forward([token], cache)
            rows.append(logits)
        rows = np.concatenate(rows).astype(np.float64)
        rows -= rows.max(-1, keepdims=True)
        return rows - np.log(np.exp(rows).sum(-1, keepdims=True))

    p, q = distributions(_decoder(built["fp32"])), distributions(_decoder(folder))
    return float((np.exp(p) * (p - q)).sum(-1).mean())


def test_int8_cache_stays_near_the_float_cache_and_int4_further(built, kv_variants):
    ids = TextGenerator(built["fp32"]).encode(
        "The licenses for most software and other practical works are designed to take away your freedom to share "
        "and change the works. By contrast, the GNU General Public License is intended to guarantee your freedom."
    )
    int8, int4 = (
        _kl_from_float(built, kv_variants["fp32_kv8"], ids),
        _kl_from_float(built, kv_variants["fp32_kv4"], ids),
    )
    assert 0 < int8 < 2e-3
    assert int4 > 4 * int8


def test_key_range_holds_at_every_rotary_position():
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(2, 50, 8))  # [kv_heads, tokens, head]
    bound = kv_cache.key_range(keys, interleaved=False)
    for angle in np.linspace(0, 2 * np.pi, 13):
        cos, sin = np.cos(angle), np.sin(angle)
        rotated = np.concatenate(
            [keys[..., :4] * cos - keys[..., 4:] * sin, keys[..., 4:] * cos + keys[..., :4] * sin], -1
        )
        assert (np.abs(rotated).max(axis=1) <= bound + 1e-12).all()


def test_batched_decode_over_a_quantized_cache_equals_batch_1(kv_variants):
    assert_batched_decode_equals_batch_1(kv_variants["int4_kv8"])


def test_validate_checks_the_cache_is_what_the_name_says(built, kv_variants, params, tmp_path):
    report = tmp_path / "validate.json"
    asked = validate.Asked(quantize_config(**INT4_KV8), LOOSE)
    validate.run(params.validation.eval, asked, kv_variants["int4_kv8"], built["reference"], report, "int4_kv8")
    written = json.loads(report.read_text())
    assert written["passed"] and written["checks"]["kv_cache_as_asked"]["passed"]
    assert written["coverage"]["kv_cache"] == {"asked": "int8", "stored_bits": 8, "as_asked": True}
    # Rows and pieces are proven over the float-cache twin, where float rounding cannot flip codes.
    assert written["kv_check"]["deployment_proven_over_float_cache"]
    assert written["deployment"]["batched_rows"] and written["deployment"]["prefill_pieces"]
    # A variant whose manifest says int8 over a float cache is not what its name says.
    claimed = tmp_path / "claimed"
    shutil.copytree(built["fp32"], claimed)
    manifest = read_manifest(claimed)
    manifest["params"]["kv_cache"] = "int8"
    write_manifest(claimed, {key: value for key, value in manifest.items() if key != "files"})
    recipe = quantize_config(method="fp32", kv_cache="int8")
    assert validate.measure_coverage(claimed, recipe)["kv_cache"] == {
        "asked": "int8",
        "stored_bits": 32,
        "as_asked": False,
    }


def test_a_graph_without_group_query_attention_is_refused_before_work(tmp_path):
    graph = onnx.helper.make_model(onnx.helper.make_graph([], "no-attention", [], []))
    with pytest.raises(StageError, match="kv_cache int8 needs GroupQueryAttention.*set kv_cache: float"):
        kv_cache.check_supported(graph, tmp_path, "int8")


def test_kv_cache_setting_is_checked_like_every_key():
    with pytest.raises(ValueError, match="kv_cache"):
        quantize_config(method="fp32", kv_cache="int2")
    assert quantize_config(method="weight_only", kv_cache="int8").kv_bits == 8
    assert quantize_config(method="fp16").kv_bits is None


def with_kv_scales_times(variant_dir, dest, factor: float):
    """A copy of variant_dir whose KV cache scales are factor times the calibrated ones."""
    shutil.copytree(variant_dir, dest)
    graph = onnx.load(str(dest / "model.onnx"))
    for tensor in graph.graph.initializer:
        if tensor.name.endswith(".scale"):
            scaled = (numpy_helper.to_array(tensor) * factor).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(scaled, tensor.name))
    onnx.save(graph, str(dest / "model.onnx"))
    return dest


def test_the_cache_gates_see_the_quantized_cache_error(built, kv_variants, params, tmp_path):
    """A quantized cache's own full pass reads the same quantized cache: the cost of storing it is
    measured against the same graph over a float cache (kv_cache_kl), on every text, and a bad
    scale fails it while the cache as a mechanism (kv_max_prob_diff) still holds."""
    limits = LOOSE.model_copy(update={"kv_cache_kl": 0.01, "kv_max_prob_diff": 0.01})
    asked = validate.Asked(quantize_config(**INT4_KV8), limits)
    good = validate.run(
        params.validation.eval, asked, kv_variants["int4_kv8"], built["reference"], tmp_path / "good.json", "int4_kv8"
    )
    costs = [text["kv_cache_kl"] for text in good["texts"].values()]
    assert len(costs) == 2 and all(0 < cost < 0.01 for cost in costs)
    proven_over_float_cache = {"deployment_proven_over_float_cache": True}
    assert (
        good["kv_check"]
        == {"float_compute": True, "quantized_cache_against_float_cache": True} | proven_over_float_cache
    )
    clipped = with_kv_scales_times(kv_variants["int4_kv8"], tmp_path / "clipped", 0.02)
    with pytest.raises(validate.ValidationFailed, match=r"kv_cache_kl\[GPL-3.txt\] [\d.e-]+ > 0.01") as failed:
        validate.run(params.validation.eval, asked, clipped, built["reference"], tmp_path / "bad.json", "int4_kv8")
    assert "kv_max_prob_diff" not in str(failed.value)
    float_cache = validate.Asked(quantize_config(**WEIGHT_ONLY), LOOSE)
    figures = validate.run(
        params.validation.eval, float_cache, built["int4"], built["reference"], tmp_path / "f.json", "int4"
    )
    assert all("kv_cache_kl" not in text for text in figures["texts"].values())  # a float cache costs nothing


def test_the_float_cache_twin_stores_float_and_keeps_every_weight(kv_variants):
    graph = onnx.load(str(kv_variants["int4_kv8"] / "model.onnx"), load_external_data=False)
    twin = kv_cache.float_cache(graph)
    assert kv_cache.stored_bits(graph) == 8 and kv_cache.stored_bits(twin) == 32
    scales = {t.name for t in graph.graph.initializer if t.name.endswith(".scale")}
    assert scales and {t.name for t in twin.graph.initializer} == {t.name for t in graph.graph.initializer} - scales
    assert names.KV_CACHE_BITS_KEY not in {prop.key for prop in twin.metadata_props}
    assert kv_cache.stored_bits(graph) == 8  # the original is untouched


def test_a_quantized_cache_without_a_cost_limit_is_refused_in_params(tiny_hf):
    from tasks.core.params import Params
    from tests.conftest import tiny_params

    values = tiny_params(tiny_hf)
    values["quantize"]["int4"] = INT4_KV8
    with pytest.raises(ValueError, match=r"validate.thresholds of \['int4'\] set no kv_cache_kl"):
        Params.model_validate(values)
    values["validate"]["thresholds"]["int4"]["kv_cache_kl"] = 0.01
    assert Params.model_validate(values).validation.thresholds["int4"].kv_cache_kl == 0.01


def test_validate_budgets_memory_for_every_session_it_holds(built, kv_variants, params, tmp_path):
    """validate's preflight counts the sessions each phase really holds: the variant's while
    scoring; the cache checks' (each holding the weights) and a quantized cache's KL windows; the
    deployment proof's one session; so a machine too small for the largest phase is refused before
    the first session loads."""
    from types import SimpleNamespace

    from tasks.core import resources
    from tasks.core.files import folder_bytes

    for name, folder in {"fp32": built["fp32"], "int4": built["int4"], "int4_kv8": kv_variants["int4_kv8"]}.items():
        scratch = tmp_path / name
        scratch.mkdir()
        opened = sum(decoder is not None for decoder in validate.cache_check_decoders(folder, scratch)[:2])
        shutil.rmtree(scratch)  # its hard links to the shared variant's files: onnx.load refuses a linked file
        assert validate.cache_check_sessions(validate.structure(folder)) == opened, name
        stage = SimpleNamespace(paths={"variant-dir": folder}, params=params)
        one = resources.runtime_needs(folder, params.validation.eval.window, "scoring windows")
        weights = folder_bytes(folder, "model.onnx*")
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        kl = validate.KL_BYTES_PER_LOGIT * params.validation.eval.window * vocab if name.endswith("kv8") else 0
        assert validate.kv_kl_bytes(validate.structure(folder), params.validation.eval.window) == kl, name
        checking = resources.RUNTIME_MEMORY + opened * 2 * weights + kl
        assert validate.needs(stage).memory == max(one.memory, checking), name
        held = f"1 session while scoring, {opened} while checking the cache, 1 while proving"
        assert held in validate.needs(stage).basis, name
    for name in ("fp32_kv8", "int4_kv8"):  # the variant (or its float compute) and a float-cache twin
        assert validate.cache_check_sessions(validate.structure(kv_variants[name])) == 2, name

"""reference + validate: variants measured against the PyTorch reference; a bad variant fails with
one message naming every failed check, and the report is still written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ortforge.manifest import check_validated, validation_stamp
from tasks import validate
from tasks.core.params import Thresholds
from tasks.core.stage import StageError
from tasks.evaluation.metrics import Reference
from tasks.graphs import onnx_io

LOOSE = Thresholds(ppl_ratio=1e9, kl_divergence=1e9, top1_agreement=0.0, greedy_agreement=0.0, kv_max_prob_diff=1.0)
GATES = {"ppl_ratio", "kl_divergence", "top1_agreement", "greedy_agreement", "kv_max_prob_diff"}


def test_reference_holds_inputs_and_figures_per_text(built, params):
    ref = Reference.load(built["reference"])
    cfg = params.validation.eval
    assert list(ref.texts) == ["GPL-3.txt", "lstrlib.c"]  # prose and code
    for name, text in ref.texts.items():
        assert len(text.ids) == cfg.max_tokens + 1
        assert text.top_ids.shape == text.top_logits.shape == (cfg.max_tokens, cfg.top_k)
        assert np.all(np.diff(text.top_logits, axis=-1) <= 0)  # most likely first
        assert np.all(text.top_logits[:, 0] <= text.logsumexp)  # log-probabilities below 0
        assert len(text.greedy_tokens) == cfg.greedy_steps
        assert 1.0 < ref.perplexity[name] < 1e4
    assert ref.sequence_tokens == cfg.max_tokens  # the tiny model's 1,024 positions hold the whole text


@pytest.mark.parametrize("variant", ["fp32", "int8", "int4"])
def test_run_passes_variants_within_thresholds(built, params, tmp_path, variant):
    report = tmp_path / "validate.json"
    figures = validate.run(
        params.validation.eval,
        validate.Asked.from_params(params, "tiny", variant),
        built[variant],
        built["reference"],
        report,
        variant,
    )
    written = json.loads(report.read_text())
    per_text = {f"{gate}[{text}]" for gate in GATES for text in ("GPL-3.txt", "lstrlib.c")}
    assert written["passed"] is True and set(written["checks"]) == per_text | {
        "coverage",
        "kept_float_share",
        "kv_cache_as_asked",
    }
    assert written["role"] == "goal" and written["goal_met"] is True and written["limits_replaced_by_build"] == {}
    ppl = written["checks"]["ppl_ratio[GPL-3.txt]"]
    limit = params.validation.thresholds[variant].ppl_ratio
    assert ppl["limit"] == limit and ppl["margin"] == pytest.approx(limit - ppl["value"])
    assert check_validated(built[variant])["variant"] == variant
    assert written["coverage"]["share_as_asked"] == 1.0
    if variant == "fp32":
        assert figures["kl_divergence"] < 1e-9 and figures["top1_agreement"] == 1.0
    else:  # quantization must change the numbers, or the variant is not what it claims
        assert figures["max_logit_diff"] > 1e-3 and figures["kl_divergence"] > 1e-6


def corrupt(model_dir, dest):
    """Shuffle the largest weight tensor: same shapes and value range, broken model."""
    import onnx
    from onnx import numpy_helper

    shutil.copytree(model_dir, dest)
    graph = onnx.load(str(dest / "model.onnx"))
    weights = [t for t in graph.graph.initializer if not t.name.endswith("_cache")]  # not the rotary tables
    tensor = max(weights, key=lambda t: len(t.raw_data))
    array = numpy_helper.to_array(tensor)
    rng = np.random.default_rng(0)
    tensor.CopyFrom(numpy_helper.from_array(rng.permutation(array.reshape(-1)).reshape(array.shape), tensor.name))
    onnx.save(graph, str(dest / "model.onnx"))
    return dest


def test_run_gate_stops_a_corrupted_variant(built, params, tmp_path):
    broken = corrupt(built["int4"], tmp_path / "broken")
    report = tmp_path / "validate.json"
    with pytest.raises(validate.ValidationFailed) as error:
        validate.run(
            params.validation.eval,
            validate.Asked.from_params(params, "tiny", "int4"),
            broken,
            built["reference"],
            report,
            "int4",
        )
    message = str(error.value)
    assert message.startswith("variant int4 failed validation: ")
    assert "validate.thresholds.int4" in message
    written = json.loads(report.read_text())
    assert written["passed"] is False
    assert not validation_stamp(broken).exists()  # never marked valid
    failed = {name for name, check in written["checks"].items() if not check["passed"]}
    assert failed and all(name in message for name in failed)


def test_check_treats_nan_as_failure():
    assert not validate.Check("kl_divergence", float("nan"), 1.0, upper_bound=True).passed
    assert not validate.Check("greedy_agreement", float("nan"), 0.0, upper_bound=False).passed


def test_run_requires_quantized_variant(built, params, tmp_path):
    with pytest.raises(StageError, match="has no model.onnx; run the quantize stage first"):
        asked = validate.Asked(params.variant("int4"), LOOSE)
        validate.run(params.validation.eval, asked, tmp_path, built["reference"], tmp_path / "v.json", "int4")


def test_a_replaced_limit_passes_the_build_but_not_the_quality_goal(built, params, tmp_path):
    """A build may widen a variant's limits; the variant then passes, and validate.json says which
    limit the build replaced and that the shared one, the variant's quality goal, is missed."""
    tight = params.validation.thresholds["int4"].model_copy(update={"kl_divergence": 1e-9})
    loose = tight.model_copy(update={"kl_divergence": 10.0})
    report = tmp_path / "validate.json"
    validate.run(
        params.validation.eval,
        validate.Asked(params.variant("int4"), loose, tight),
        built["int4"],
        built["reference"],
        report,
        "int4",
    )
    written = json.loads(report.read_text())
    assert written["passed"] is True and written["goal_met"] is False
    assert written["limits_replaced_by_build"] == {"kl_divergence": {"limit": 10.0, "shared": 1e-9}}
    kl = written["checks"]["kl_divergence[lstrlib.c]"]
    assert kl["passed"] and not kl["meets_shared_limit"] and kl["shared_limit"] == 1e-9


def test_a_comparison_point_has_no_goal(built, params, tmp_path):
    report = tmp_path / "validate.json"
    asked = validate.Asked(params.variant("int4"), LOOSE, comparison=True)
    validate.run(params.validation.eval, asked, built["int4"], built["reference"], report, "int4")
    written = json.loads(report.read_text())
    assert written["role"] == "comparison" and written["goal_met"] is None


def test_asked_from_params_knows_overrides_and_comparison_points(tiny_hf):
    from tasks.core.params import Params
    from tests.conftest import tiny_params

    values = tiny_params(tiny_hf)
    values["builds"]["tiny-int4"]["thresholds"] = {"ppl_ratio": 1.5}
    values["validate"]["comparison"] = ["int8"]
    params = Params.model_validate(values)
    int4, int8 = (validate.Asked.from_params(params, "tiny", v) for v in ("int4", "int8"))
    assert int4.limits.ppl_ratio == 1.5 and int4.goal("ppl_ratio") == params.validation.thresholds["int4"].ppl_ratio
    assert int4.goal("kl_divergence") is None and not int4.comparison
    assert int8.comparison and int8.shared is None
    values["validate"]["comparison"] = ["int9"]
    with pytest.raises(ValueError, match=r"validate.comparison names \['int9'\], not in `quantize`"):
        Params.model_validate(values)


def test_the_cache_check_runs_with_float_compute_so_it_sees_the_cache_alone(built, params, tmp_path):
    """int8-activation kernels (accuracy_level 4) round one token differently from many; the
    cached-decode check compares with float compute on both sides, where a correct cache agrees
    with a full pass to float rounding, and the variant itself is left as built."""
    import onnx

    from ortforge.decoder import Decoder
    from ortforge.session import create_session
    from tasks.evaluation.metrics import cached_decode_gap

    report = tmp_path / "validate.json"
    figures = validate.run(
        params.validation.eval, validate.Asked.from_params(params, "tiny", "int4"), built["int4"],
        built["reference"], report, "int4",
    )  # fmt: skip
    float_cache = {"quantized_cache_against_float_cache": False, "deployment_proven_over_float_cache": False}
    assert figures["kv_check"] == {"float_compute": True} | float_cache
    assert all(text["kv_max_prob_diff"] < 1e-4 for text in figures["texts"].values())
    graph = onnx.load(str(built["int4"] / "model.onnx"), load_external_data=False)
    levels = {onnx_io.attribute(n, "accuracy_level", 0) for n in graph.graph.node if n.op_type == "MatMulNBits"}
    assert levels == {4}  # the artifact still computes at its own accuracy level
    ids = Reference.load(built["reference"]).texts["GPL-3.txt"].ids
    cfg = params.validation.eval
    assert cached_decode_gap(Decoder(create_session(built["int4"])), ids, cfg.kv_prefill, cfg.kv_steps) >= 0

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

LOOSE = Thresholds(ppl_ratio=1e9, kl_divergence=1e9, top1_agreement=0.0, greedy_agreement=0.0, kv_max_prob_diff=1.0)
GATES = {"ppl_ratio", "kl_divergence", "top1_agreement", "greedy_agreement"}


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
        params.validation.thresholds[variant],
        built[variant],
        built["reference"],
        report,
        variant,
    )
    written = json.loads(report.read_text())
    per_text = {f"{gate}[{text}]" for gate in GATES for text in ("GPL-3.txt", "lstrlib.c")}
    assert written["passed"] is True and set(written["checks"]) == per_text | {
        "kv_max_prob_diff",
        "coverage",
        "kv_cache_as_asked",
    }
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
            params.validation.eval, params.validation.thresholds["int4"], broken, built["reference"], report, "int4"
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
        validate.run(params.validation.eval, LOOSE, tmp_path, built["reference"], tmp_path / "v.json", "int4")

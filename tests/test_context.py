"""Context limits: a model with fewer positions than the evaluation text is scored in sequences that
fit; settings and prompts that cannot fit stop in one line before any work; the runtime refuses a
prompt plus new tokens past the context, and an empty prompt."""

from __future__ import annotations

import pytest

from tasks import bench, download, export, optimize, quantize, reference, validate
from tasks.core.params import BenchConfig, EvalConfig, Params
from tasks.core.stage import StageError
from tests import tiny_models
from tests.conftest import EVAL_TEXT, tiny_params

CONTEXT = 64  # positions; the tiny eval text scores 128 tokens


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """The tiny LLaMA with a 64-position context, through every stage to a validated int4 variant."""
    root = tmp_path_factory.mktemp("short")
    source = tiny_models.build_hf_model(root / "src", EVAL_TEXT, max_position_embeddings=CONTEXT)
    params = Params.model_validate(tiny_params(source))
    out = {name: root / name for name in ("hf", "onnx", "optimized", "reference", "int4")}
    download.run(params.model("tiny"), out["hf"])
    export.run(params.export, "auto", out["hf"], out["onnx"])
    optimize.run(params.optimize, out["onnx"], out["hf"], out["optimized"])
    reference.run(params.validation.eval, out["hf"], out["reference"])
    quantize.run(params.variant("int4"), out["optimized"], out["hf"], out["int4"], {"model": "short"})
    figures = validate.run(
        params.validation.eval,
        validate.Asked.from_params(params, "tiny", "int4"),
        out["int4"],
        out["reference"],
        root / "v.json",
        "int4",
    )
    return params, out, figures


def test_eval_text_longer_than_the_context_is_scored_in_sequences_that_fit(short):
    params, _, figures = short
    assert params.validation.eval.max_tokens > CONTEXT
    assert figures["sequence_tokens"] == CONTEXT
    assert all(text["tokens_scored"] == params.validation.eval.max_tokens for text in figures["texts"].values())


def test_eval_settings_that_cannot_fit_stop_before_work(short, tmp_path):
    params, out, _ = short
    too_long = params.validation.eval.model_copy(update={"greedy_prompt_tokens": 60, "greedy_steps": 8})
    with pytest.raises(
        StageError, match="greedy_prompt_tokens \\+ greedy_steps = 68 tokens exceed the model's context of 64"
    ):
        reference.run(too_long, out["hf"], tmp_path / "ref")
    assert not (tmp_path / "ref").exists()


def test_bench_prompt_past_the_context_stops_before_work(short):
    _, out, _ = short
    cfg = BenchConfig(text=EVAL_TEXT, prompt_tokens=60, new_tokens=8)
    with pytest.raises(StageError, match="prompt_tokens \\+ bench.new_tokens = 68 exceed the model's context of 64"):
        bench.check_fits_context(cfg, out["int4"])


def test_runtime_refuses_prompts_past_the_context_and_empty_prompts(short):
    from ortforge import TextGenerator

    _, out, _ = short
    generator = TextGenerator(out["int4"])
    prompt = generator.encode(EVAL_TEXT.read_text(encoding="utf-8"))[:60]
    with pytest.raises(ValueError, match="a 60-token prompt plus 8 new tokens does not fit the model's context of 64"):
        generator.generate_ids(prompt, 8)
    assert len(generator.generate_ids(prompt, 4)) <= 4  # up to the last position is fine
    with pytest.raises(ValueError, match="the prompt is empty"):
        list(generator.stream("", 4))
    with pytest.raises(ValueError, match="max_new_tokens 0 must be at least 1"):
        generator.generate("Hello", 0)
    with pytest.raises(ValueError, match="65 tokens do not fit the model's context of 64 positions"):
        generator.decoder.forward(list(range(65)), generator.decoder.empty_cache())


def test_eval_texts_must_be_where_dvc_tracks_them(tmp_path):
    with pytest.raises(ValueError, match="are not under data/eval/"):
        EvalConfig(texts=(tmp_path / "elsewhere.txt",))

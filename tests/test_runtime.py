"""The ortforge runtime on the tiny model's fp32 variant: KV-cache decode equals a full recompute,
streaming equals non-streaming, and multi-byte characters are never split."""

from __future__ import annotations

import ast
import subprocess
import sys

import numpy as np
import pytest

from ortforge import Decoder, IncrementalDetokenizer, SessionSettings, TextGenerator, create_session
from ortforge.generate import LONG_PROMPT_PIECE
from tasks.evaluation.metrics import cached_decode_gap, full_pass_logits
from tests.conftest import REPO


@pytest.fixture(scope="module", params=["genai", "optimum"])
def generator(request, built, built_optimum):
    """The fp32 variant from each exporter: shared (in-place) and chained KV caches."""
    return TextGenerator((built if request.param == "genai" else built_optimum)["fp32"])


def test_decoder_cached_steps_equal_full_recompute(generator):
    ids = np.array(generator.encode("the GNU General Public License is a free license"))
    assert len(ids) >= 10
    assert cached_decode_gap(generator.decoder, ids, prefill=4, steps=6) < 1e-4


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_prefill_in_chunks_equals_the_whole_prompt(generator, chunk):
    ids = generator.encode("the GNU General Public License is a free license")[:10]
    whole = Decoder(generator.session)
    pieces = Decoder(generator.session, prefill_chunk=chunk)
    expected, whole_cache = whole.forward(ids, whole.empty_cache(), last_only=True)
    logits, cache = pieces.forward(ids, pieces.empty_cache(), last_only=True)
    assert cache.length == whole_cache.length == len(ids)
    assert logits.shape == expected.shape == (1, expected.shape[1])
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    # the cache the pieces filled carries on exactly like the whole prompt's
    np.testing.assert_allclose(
        pieces.forward([7], cache, last_only=True)[0][-1],
        whole.forward([7], whole_cache, last_only=True)[0][-1],
        atol=1e-4,
    )


def test_a_long_prompt_runs_in_pieces_where_tuning_chose_whole_prompts(generator, monkeypatch):
    """A prefill_chunk of 0 (tuning ran its short prompt best whole) still cuts a prompt longer
    than LONG_PROMPT_PIECE into pieces where validate proved them (GroupQueryAttention scores a
    run's every query against its every key, so one run of N tokens costs N x N), with the
    logits of the whole prompt; a prompt within one piece runs whole."""
    decoder = generator.decoder
    assert SessionSettings.for_artifact(generator.model_dir).prefill_chunk == 0
    assert decoder.prefill_chunk == LONG_PROMPT_PIECE
    text = " ".join(["the GNU General Public License is a free, copyleft license for software"] * 60)
    ids = generator.encode(text)[: 2 * LONG_PROMPT_PIECE + 5]
    assert len(ids) == 2 * LONG_PROMPT_PIECE + 5
    runs, run = [], decoder._run

    def counted(piece, cache, last_only):
        runs.append(piece.shape[1])
        return run(piece, cache, last_only)

    monkeypatch.setattr(decoder, "_run", counted)
    logits, cache = decoder.forward(ids, decoder.empty_cache(), last_only=True)
    decoder.forward(ids[:LONG_PROMPT_PIECE], decoder.empty_cache(), last_only=True)
    assert decoder.runs_like_any(len(ids)) or not decoder.shared  # genai's graphs are proven for pieces
    pieces = [LONG_PROMPT_PIECE, LONG_PROMPT_PIECE, 5] if decoder.runs_like_any(len(ids)) else [len(ids)]
    assert runs == [*pieces, LONG_PROMPT_PIECE] and cache.length == len(ids)
    whole = Decoder(generator.session)
    np.testing.assert_allclose(logits, whole.forward(ids, whole.empty_cache(), last_only=True)[0], atol=1e-4)


def test_generation_computes_only_the_last_row_of_logits(generator):
    decoder = generator.decoder
    assert decoder.can_keep_last  # every variant has logits_to_keep, and the decoder must find it
    ids = generator.encode("the GNU General Public License")
    last, _ = decoder.forward(ids, decoder.empty_cache(), last_only=True)
    every, _ = decoder.forward(ids, decoder.empty_cache())
    assert last.shape == (1, every.shape[1]) and every.shape[0] == len(ids)
    np.testing.assert_allclose(last[0], every[-1], atol=1e-4)


def test_decoder_logits_change_with_context(generator):
    # Guards the check above against a decoder that ignores its cache.
    a = full_pass_logits(generator.decoder, np.array([5, 6, 7, 8]))[-1]
    b = full_pass_logits(generator.decoder, np.array([9, 10, 11, 8]))[-1]
    assert np.abs(a - b).max() > 1e-3


def test_greedy_generation_matches_argmax_of_full_passes(generator):
    prompt = generator.encode("Everyone is permitted to copy")
    tokens = generator.generate_ids(prompt, 5)
    sequence = list(prompt)
    for token in tokens:
        logits = full_pass_logits(generator.decoder, np.array(sequence))
        assert token == int(np.argmax(logits[-1]))
        sequence.append(token)


def test_stream_equals_generate(generator):
    prompt = "To protect your rights, we need"
    assert "".join(generator.stream(prompt, 12)) == generator.generate(prompt, 12)


def test_incremental_detokenizer_never_splits_characters(generator):
    text = "Korean 안녕하세요, Japanese 日本語, emoji 🎉👍🏽 and café"
    ids = generator.encode(text)
    assert len(ids) > len(text.split())  # byte-level BPE splits these characters across tokens
    detokenizer = IncrementalDetokenizer(generator.tokenizer)
    pieces = [detokenizer.push(token) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_decoder_rejects_graph_without_kv_cache(built, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    onnx.save(helper.make_model(graph), tmp_path / "model.onnx")
    with pytest.raises(ValueError, match="not a KV-cache decoder"):
        Decoder(create_session(tmp_path))


def test_session_settings_come_from_the_artifacts_runtime_file(built, tmp_path):
    import json
    import shutil

    from ortforge.session import runtime_config

    variant = tmp_path / "int4"
    shutil.copytree(built["int4"], variant)
    assert SessionSettings.for_artifact(variant) == SessionSettings()
    tuned = {"intra_op_threads": 1, "inter_op_threads": 0, "graph_level": "basic", "prefill_chunk": 2}
    runtime_config(variant).write_text(json.dumps({"session": tuned}))
    assert SessionSettings.for_artifact(variant) == SessionSettings(**tuned)
    generator = TextGenerator(variant)
    assert generator.generate("the license", 3) == TextGenerator(built["int4"]).generate("the license", 3)
    assert generator.decoder.prefill_chunk == Decoder.for_artifact(variant).prefill_chunk == 2


def test_session_settings_reject_unknown_keys():
    with pytest.raises(ValueError, match="intra_op_thread"):
        SessionSettings.from_dict({"intra_op_thread": 2})
    with pytest.raises(ValueError, match="prefill_chunk -1 must be >= 0"):
        SessionSettings(prefill_chunk=-1)


def test_runtime_imports_without_build_tools(built):
    """An application ships the runtime with onnxruntime, numpy and tokenizers only."""
    blocked = ("torch", "transformers", "optimum", "prefect", "dvc", "tasks")
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from ortforge import TextGenerator\n"
        f"print(TextGenerator({str(built['fp32'])!r}).generate('the', 3))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_runtime_module_imports_the_build_side():
    """Every module under ortforge/, the CLI included, imports neither tasks/ nor flows/ (the build
    commands reach the CLI through entry points)."""
    found = []
    for module in (REPO / "ortforge").rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{module.name}: {n}" for n in names if n.split(".")[0] in ("tasks", "flows")]
    assert found == []


def test_shared_cache_matches_chained_cache_past_its_first_capacity(built):
    from ortforge.decoder import INITIAL_CAPACITY

    ids = np.random.default_rng(3).integers(0, 384, INITIAL_CAPACITY + 40)
    shared = Decoder(create_session(built["fp32"]))
    chained = Decoder(create_session(built["fp32"]), layout="chained")
    assert shared.shared and not chained.shared
    prompt = INITIAL_CAPACITY - 8  # the cache grows (and is copied once) during the steps below

    def stepped(decoder):
        logits, cache = decoder.forward(ids[:prompt], decoder.empty_cache())
        rows = [logits[-1]]
        for token in ids[prompt:]:
            logits, cache = decoder.forward([int(token)], cache)
            rows.append(logits[-1])
        return np.array(rows)

    in_place = stepped(shared)
    np.testing.assert_allclose(in_place, stepped(chained), atol=1e-4)
    np.testing.assert_allclose(in_place, full_pass_logits(chained, ids)[prompt - 1 :], atol=1e-3)


def test_runtime_refuses_a_folder_that_is_not_an_artifact_in_one_line(built, tmp_path):
    import shutil

    from ortforge import TextGenerator

    with pytest.raises(ValueError, match="has no model.onnx; point at an artifact folder"):
        TextGenerator(tmp_path)
    shutil.copytree(built["int4"], tmp_path / "v", ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        TextGenerator(tmp_path / "v")

"""What deploys is what validate checked: validate proves each way the runtime may run a variant's
tokens (prompt pieces, batched rows, tuned session settings) against the plain way, the stamp
records it, and the runtime and bench's tuning use only what was proven. A graph with one
activation scale per run (onnxruntime's dynamic int8) proves neither pieces nor rows, and is then
run the reference's way: whole prompts, each sequence alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortforge import BatchDecoder, Decoder, TextGenerator, create_session, names
from ortforge.decoder import LengthDependentRope, Proven, length_dependent_rope, proven_runs
from ortforge.manifest import validation_stamp
from tasks import quantize, validate
from tasks.evaluation import deployment
from tasks.evaluation.metrics import Reference
from tasks.measurement import tuning
from tasks.quantization.configs import quantize_config


@pytest.fixture(scope="module")
def run_scaled(built, tmp_path_factory):
    """onnxruntime's quantize_dynamic: one activation scale per run, so rows and pieces couple."""
    out = tmp_path_factory.mktemp("dynamic") / "int8_dynamic"
    quantize.run(quantize_config(method="int8_dynamic"), built["optimized"], built["hf"], out, {})
    return out


def text_ids(built) -> np.ndarray:
    return next(iter(Reference.load(built["reference"]).texts.values())).ids


def proof_of(folder, built, tmp_path) -> dict:
    proven_on = validate.cache_check_decoders(folder, tmp_path)[-1]
    return validate.prove_deployment(folder, proven_on, text_ids(built)).record()


def test_validate_proves_pieces_rows_and_settings_of_a_float_graph(built, tmp_path):
    record = proof_of(built["int4"], built, tmp_path)
    assert record["prefill_pieces"] and record["batched_rows"]
    room = len(text_ids(built)) - 2 - deployment.STEPS  # the tiny text is shorter than a real one
    assert record["prompt_tokens"] == min(room, deployment.SHORTEST_PROMPT)
    changes = record["largest_change"]
    assert set(changes["pieces"]) == {"chunk 64", "chunk 32", "uneven 1/7/33"}
    assert max(changes["pieces"].values()) <= deployment.SAME_PROBABILITY
    assert len(record["session_settings"]) == len(changes["session_settings"]) >= 3


def test_one_scale_per_run_proves_neither_pieces_nor_rows(built, run_scaled, tmp_path):
    record = proof_of(run_scaled, built, tmp_path)
    assert not record["prefill_pieces"] and not record["batched_rows"]
    changes = record["largest_change"]
    assert min(changes["pieces"].values()) > deployment.SAME_PROBABILITY
    assert changes["batched_rows"] > deployment.SAME_PROBABILITY


def test_the_prompt_reaches_past_every_boundary_the_config_declares():
    config = {"sliding_window": 64, "rope_scaling": {"rope_type": "longrope"}, "original_max_position_embeddings": 96}
    rope = LengthDependentRope(96, recompute=True)
    assert deployment.boundaries(config, rope) == {"sliding_window": 64, "rope_limit": 96}
    assert deployment.boundaries({"sliding_window": None, "max_position_embeddings": 2048}, None) == {}


def test_the_rope_boundary_is_the_limit_the_runtime_acts_on(tmp_path):
    """Llama 3's rope (like yarn and linear) gives a position the same frequencies in any run: its
    original context is no length past which anything changes (counting it made the proof run
    prompts as long as the evaluation text, 2,038 tokens instead of 160, at the 1B shape). Dynamic
    NTK rescales past the length the runtime reads, which the proof must pass."""

    def boundaries_of(config: dict) -> dict[str, int]:
        (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return deployment.boundaries(config, length_dependent_rope(tmp_path))

    llama3 = {"rope_type": "llama3", "factor": 32.0, "original_max_position_embeddings": 8192}
    assert boundaries_of({"rope_scaling": llama3, "max_position_embeddings": 131072}) == {}
    dynamic = {"type": "dynamic", "factor": 2.0}
    assert boundaries_of({"rope_scaling": dynamic, "original_max_position_embeddings": 2048}) == {"rope_limit": 2048}
    assert boundaries_of({"rope_scaling": dynamic, "max_position_embeddings": 4096}) == {"rope_limit": 4096}


def stamped(folder, tmp_path, record: dict | None):
    """A copy of the variant folder with a stamp carrying the given deployment record."""
    import shutil

    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    stamp = {"passed": True} | ({names.DEPLOYMENT_KEY: record} if record is not None else {})
    validation_stamp(copy).write_text(json.dumps(stamp), encoding="utf-8")
    return copy


def test_the_runtime_reads_what_the_stamp_proved(built, tmp_path):
    nothing = {"prefill_pieces": False, "batched_rows": False, "session_settings": []}
    assert proven_runs(built["int4"]) == Proven()  # no stamp: a graph used directly
    assert proven_runs(stamped(built["int4"], tmp_path / "a", nothing)) == Proven(False, False)
    assert proven_runs(stamped(built["int4"], tmp_path / "b", None)) == Proven(False, False)  # no record, no proof
    generator = TextGenerator(stamped(built["int4"], tmp_path / "c", nothing | {"prefill_pieces": True}))
    assert generator.proven == Proven(pieces=True, rows=False)
    assert generator.decoder.runs_like_any(100) and not generator.decoder.batches_like_alone(100)


def test_unproven_rows_step_alone_and_give_each_rows_own_logits(run_scaled):
    """The scheduler's batch over a one-scale-per-run graph, told rows are not proven: each row's
    logits are those of its batch-1 run, bit for bit, whatever the other row holds."""
    prompts = {0: [5, 17, 42, 7, 99, 3], 1: list(range(300, 340))}
    batch = BatchDecoder(create_session(run_scaled), 2, proven=Proven(pieces=False, rows=False))
    for row, prompt in prompts.items():
        batch.prefill(row, prompt)
    stepped = batch.step({0: 8, 1: 9})
    for row, prompt in prompts.items():
        alone = Decoder(create_session(run_scaled))
        _, cache = alone.forward(prompt, alone.empty_cache(), last_only=True)
        logits, _ = alone.forward([8 if row == 0 else 9], cache, last_only=True)
        assert np.array_equal(stepped[row], logits[-1]), row


def test_unproven_pieces_prefill_whole_whatever_chunk_is_set(run_scaled):
    ids = np.random.default_rng(2).integers(0, 384, 50).tolist()

    def last(chunk: int, proven: Proven) -> np.ndarray:
        decoder = Decoder(create_session(run_scaled), prefill_chunk=chunk, proven=proven)
        return decoder.forward(ids, decoder.empty_cache(), last_only=True)[0][-1]

    whole = last(0, Proven())
    assert np.array_equal(last(8, Proven(pieces=False, rows=False)), whole)
    assert not np.allclose(last(8, Proven()), whole, atol=1e-4)  # the chunk, had it been allowed


def test_tuning_tries_only_proven_settings(built, tmp_path):
    record = {
        "prefill_pieces": False,
        "batched_rows": True,
        "session_settings": [{"intra_op_threads": 1, "graph_level": "all"}],
    }
    allowed = tuning.proven(stamped(built["int4"], tmp_path, record))
    base = {"intra_op_threads": 1, "graph_level": "all", "prefill_chunk": 0}
    assert allowed(base) and allowed(base | {"intra_op_threads": 0})  # onnxruntime's defaults: validate's own
    assert not allowed(base | {"prefill_chunk": 64})
    assert not allowed(base | {"graph_level": "basic"})
    assert not allowed(base | {"intra_op_threads": 2})

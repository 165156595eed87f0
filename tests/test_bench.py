"""bench: the metrics a user reads, with the baseline measured in the same run (no timing asserts:
speed is shown by the bench stage's own figures, never by tests)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks import bench
from tasks.core.params import BenchConfig
from tasks.core.stage import StageError
from tasks.measurement import concurrency, timing
from tasks.measurement.tuning import CONFIRMATIONS

METRICS = {
    "seconds_to_first_token_p50",
    "seconds_to_first_token_p95",
    "prefill_tokens_per_second",
    "decode_ms_per_token_p50",
    "decode_ms_per_token_p95",
    "decode_tokens_per_second",
    "peak_rss_mb",
    "size_mb",
}


@pytest.fixture(scope="module")
def validated(built, params, tmp_path_factory):
    """The int4 variant after the validate stage stamped it."""
    from tasks import validate

    section = params.validation
    report = tmp_path_factory.mktemp("bench") / "validate.json"
    validate.run(
        section.eval,
        validate.Asked.from_params(params, "tiny", "int4"),
        built["int4"],
        built["reference"],
        report,
        "int4",
    )
    return built["int4"]


def test_run_reports_variant_and_baseline_metrics(built, params, validated):
    result = bench.run(params.bench, validated, built["hf"])
    assert METRICS <= set(result) and METRICS <= set(result["baseline"])
    assert result["seconds_to_first_token_p50"] <= result["seconds_to_first_token_p95"]
    assert result["decode_ms_per_token_p50"] <= result["decode_ms_per_token_p95"]
    assert 0 < result["size_mb"] < result["baseline"]["size_mb"]
    assert result["peak_rss_mb"] > 10  # a real process's resident memory, not a placeholder
    assert set(result["vs_baseline"]) == {"decode_speedup", "first_token_speedup", "rss_reduction", "size_reduction"}
    assert result["workload"]["new_tokens"] == params.bench.new_tokens
    tuning = result["tuning"]
    assert len(tuning["trials"]) >= 8  # threads, inter-op, graph levels, memory pattern, arena, chunks
    # The runs its last verdict was judged on: its latest rounds measured in turn with a rival, or
    # its first trial where no rival won a first trial against it.
    chosen = [trial for trial in tuning["trials"] if trial["settings"] == tuning["session"]]
    rounds = [trial for trial in chosen if trial.get("confirming")][-CONFIRMATIONS:] or chosen[:1]
    assert tuning["workload_seconds"] == np.median([run for trial in rounds for run in trial["runs"]])
    assert result["kv_bytes_per_token"] > 0


def test_run_measures_the_serving_workload_per_concurrency_level(built, params, validated):
    load = params.bench.concurrency
    result = bench.run(params.bench, validated, built["hf"])["concurrency"]
    assert list(result) == [str(s) for s in load.streams]
    for streams, figures in result.items():
        assert figures["requests"] == int(streams) * load.requests
        assert 1 <= figures["widest_step"] <= int(streams)  # rows one run advanced together
        assert figures["seconds_to_first_token_p50"] <= figures["seconds_to_first_token_p95"]
        assert figures["inter_token_ms_p50"] <= figures["inter_token_ms_p95"]
        assert figures["aggregate_tokens_per_second"] > 0 and figures["peak_rss_mb"] > 10
        assert "continuous batching" in figures["scheduler"]


def test_serving_prompts_share_their_start_and_differ_after_it():
    ids = list(range(1000))
    prompts = concurrency.request_prompts(ids, streams=3, requests=2, tokens=10, shared_prefix=0.4)
    flat = [p for stream in prompts for p in stream]
    assert len(prompts) == 3 and all(len(p) == 10 and p[:4] == ids[:4] for p in flat)
    assert len({tuple(p[4:]) for p in flat}) == 6
    with pytest.raises(ValueError, match="need more"):
        concurrency.request_prompts(ids[:20], streams=3, requests=2, tokens=10, shared_prefix=0.4)


def test_timed_generation_times_every_decode_step(built):
    from ortforge import Decoder, create_session

    first, steps = timing.timed_generation(Decoder(create_session(built["fp32"])), [5, 6, 7], 5)
    assert first > 0 and len(steps) == 4 and all(s > 0 for s in steps)


def test_run_refuses_unvalidated_variant(built, tmp_path):
    import shutil

    unstamped = tmp_path / "int4"
    shutil.copytree(built["int4"], unstamped)
    with pytest.raises(StageError, match="has no validation stamp int4.valid.json.*only validated variants"):
        bench.run(BenchConfig(), unstamped, built["hf"])


def test_run_refuses_variant_changed_after_validation(built, validated, tmp_path):
    import shutil

    changed = tmp_path / "int4"
    shutil.copytree(validated, changed)
    shutil.copy(validated.with_name("int4.valid.json"), tmp_path / "int4.valid.json")
    manifest = json.loads((changed / "manifest.json").read_text())
    (changed / "manifest.json").write_text(json.dumps({**manifest, "variant": "edited"}))
    with pytest.raises(StageError, match="does not vouch for"):
        bench.run(BenchConfig(), changed, built["hf"])

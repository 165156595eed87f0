"""bench: the metrics a user reads, with the baseline measured in the same run (no timing asserts:
speed is shown by the bench stage's own figures, never by tests)."""

from __future__ import annotations

import json

import pytest

from tasks import bench
from tasks.params import BenchConfig
from tasks.stage import StageError

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
def validated(built, tmp_path_factory):
    report = tmp_path_factory.mktemp("bench") / "validate.json"
    report.write_text(json.dumps({"passed": True}))
    return report


def test_run_reports_variant_and_baseline_metrics(built, params, validated):
    result = bench.run(params.bench, built["int4"], validated, built["hf"])
    assert METRICS <= set(result) and METRICS <= set(result["baseline"])
    assert result["seconds_to_first_token_p50"] <= result["seconds_to_first_token_p95"]
    assert result["decode_ms_per_token_p50"] <= result["decode_ms_per_token_p95"]
    assert 0 < result["size_mb"] < result["baseline"]["size_mb"]
    assert result["peak_rss_mb"] > 10  # a real process's resident memory, not a placeholder
    assert set(result["vs_baseline"]) == {"decode_speedup", "first_token_speedup", "rss_reduction", "size_reduction"}
    assert result["workload"]["new_tokens"] == params.bench.new_tokens


def test_timed_generation_times_every_decode_step(built):
    from ortforge import Decoder, create_session

    first, steps = bench.timed_generation(Decoder(create_session(built["fp32"])), [5, 6, 7], 5)
    assert first > 0 and len(steps) == 4 and all(s > 0 for s in steps)


def test_run_refuses_unvalidated_variant(built, tmp_path):
    failed = tmp_path / "validate.json"
    failed.write_text(json.dumps({"passed": False}))
    with pytest.raises(StageError, match="has not passed validation"):
        bench.run(BenchConfig(), built["int4"], failed, built["hf"])
    with pytest.raises(StageError, match="has not passed validation"):
        bench.run(BenchConfig(), built["int4"], tmp_path / "absent.json", built["hf"])

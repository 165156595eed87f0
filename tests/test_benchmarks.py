"""The benchmark scripts' engines and arithmetic on the tiny model: every engine generates the same
greedy tokens (they are comparable), and the summaries compute what they say. No timing asserts."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import engines, side_by_side

PROMPT = [5, 17, 99, 250, 3, 7, 11, 200]


@pytest.fixture(scope="module")
def specs(built, built_optimum):
    return {
        "torch-kv": {"kind": "torch-kv", "path": str(built["hf"])},
        "torch-nokv": {"kind": "torch-nokv", "path": str(built["hf"])},
        "ort-plain optimum": {"kind": "ort-plain", "path": str(built_optimum["fp32"])},
        "ort-plain genai": {"kind": "ort-plain", "path": str(built["fp32"])},
        "ort": {"kind": "ort", "path": str(built["fp32"]), "tuned": True},
    }


def test_engines_agree_on_greedy_tokens(specs):
    from ortforge.greedy import greedy_tokens

    tokens = {name: list(greedy_tokens(engines._decoder(spec), PROMPT, 6)) for name, spec in specs.items()}
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens


def test_measure_reports_every_step(specs):
    result = engines.measure(specs["ort"], PROMPT, new_tokens=5, warmup=1, repeats=2)
    assert len(result["first_token_s"]) == 2 and [len(s) for s in result["step_s"]] == [4, 4]
    assert result["peak_rss_mb"] > 10


def test_prompt_lookup_timing_gives_every_token_its_share_of_a_run(specs):
    spec = specs["ort"] | {"prompt_lookup": 3}
    result = engines.measure(spec, PROMPT * 3, new_tokens=24, warmup=0, repeats=2)
    assert [len(s) for s in result["step_s"]] == [23, 23]
    assert all(0 < runs <= 23 for runs in result["decode_runs"])
    for steps, runs in zip(result["step_s"], result["decode_runs"], strict=True):
        assert len(set(steps)) <= runs  # the tokens of one run share its time equally
    assert engines.measure(specs["ort"], PROMPT, new_tokens=3, warmup=0, repeats=1)["decode_runs"] is None


def test_sampled_steps_interpolate_between_measured_lengths(specs):
    spec = specs["torch-nokv"] | {"sample_steps": 3}
    result = engines.measure(spec, PROMPT, new_tokens=9, warmup=0, repeats=1)
    assert len(result["step_s"][0]) == 8 and all(s > 0 for s in result["step_s"][0])


def test_summarize_and_lighter_arithmetic():
    runs = [{"first_token_s": [0.1, 0.1], "step_s": [[0.01] * 4, [0.02] * 4], "peak_rss_mb": 100.0, "load_seconds": 1}]
    spec = {"kind": "ort", "path": "/nonexistent/model.gguf"}
    summary = side_by_side.summarize(runs, spec | {"path": __file__}, prompt_tokens=10, bandwidth=10.0)
    assert summary["decode_tokens_per_second"] == pytest.approx(75.0)  # median of 100 and 50
    assert summary["end_to_end_seconds"] == pytest.approx(np.median([0.14, 0.18]))
    assert summary["seconds_to_first_token_p50"] == pytest.approx(0.1)  # the bench stage's own names
    assert summary["tokens_per_run"] is None
    with_lookup = side_by_side.summarize([runs[0] | {"decode_runs": [2, 4]}], spec | {"path": __file__}, 10, 10.0)
    assert with_lookup["tokens_per_run"] == pytest.approx(8 / 6)
    chain = {"a": {"end_to_end_seconds": 100.0}, "b": {"end_to_end_seconds": 10.0}, "c": {"end_to_end_seconds": 2.0}}
    light = side_by_side.lighter(chain)
    assert light["x_lighter"] == 50.0 and light["steps"] == {"b": 10.0, "c": 5.0}


def test_memory_bandwidth_is_measured():
    assert 0.5 < side_by_side.memory_bandwidth_gb_s(size_mb=16, seconds=0.2) < 1000


def test_one_way_to_measure():
    """The side-by-side benchmark measures and summarizes with the bench stage's own code."""
    import inspect

    from tasks import bench
    from tasks.measurement import timing

    assert "timed_runs(" in inspect.getsource(engines.measure)
    assert "timing.summarize(" in inspect.getsource(side_by_side.summarize)
    assert "timing.summarize(" in inspect.getsource(bench.summarize)
    assert set(timing.summarize.__code__.co_names) >= {"percentile", "median"}

"""Bench's tuning (tasks/measurement/tuning.py): a setting changes only when it is clearly faster,
and a sweep starts from what this machine chose before. The workload is faked with fixed run
times, so what is tested is the choice, not the timing."""

from __future__ import annotations

import json

import pytest

from ortforge import machine
from ortforge.session import SessionSettings
from tasks import bench
from tasks.measurement import tuning

CORES = 2
DEFAULTS = SessionSettings(intra_op_threads=CORES).to_dict()


def fake_sweep(monkeypatch, runs_of, allowed=lambda settings: True, incumbent=None, graphs=None) -> dict:
    """tuning.sweep where a settings dict's runs are runs_of(settings) (default: 1.00 and 1.01 s)
    and each graph level builds the graph graphs names for it (default: a graph of its own)."""
    monkeypatch.setattr(tuning.os, "cpu_count", lambda: CORES)
    monkeypatch.setattr(tuning, "proven", lambda model_dir: allowed)
    monkeypatch.setattr(tuning, "workload_runs", lambda model_dir, settings, *rest: runs_of(settings))
    monkeypatch.setattr(tuning, "optimized_graph_digest", lambda model_dir, level: (graphs or {}).get(level, level))
    return tuning.sweep("unused", [1, 2, 3], 4, incumbent=incumbent)


def runs_with(changes: dict[tuple[str, object], list[float]]):
    """Runs per settings: those of the one change from the defaults it holds, else 1.00 and 1.01 s."""

    def runs_of(settings: dict) -> list[float]:
        differ = [(name, value) for name, value in settings.items() if DEFAULTS[name] != value]
        return changes.get(differ[-1], [1.0, 1.01]) if differ else [1.0, 1.01]

    return runs_of


@pytest.mark.parametrize(
    ("runs", "best_runs", "clear"),
    [
        ([0.90, 0.91], [1.00, 1.01], True),  # every run 10% faster
        ([0.985, 0.99], [1.00, 1.01], False),  # every run faster, by 1.5%: noise
        ([0.80, 1.20], [1.00, 1.01], False),  # a faster median, but one run slower than the best's
        ([0.96, 0.97], [0.99, 1.00], True),  # 3.5% on the median, and no run overlaps
    ],
)
def test_clearly_faster_needs_every_run_ahead_and_the_median_by_min_gain(runs, best_runs, clear):
    assert tuning.clearly_faster(runs, best_runs) is clear


def test_a_setting_changes_only_when_it_is_clearly_faster(monkeypatch):
    found = fake_sweep(
        monkeypatch,
        runs_with(
            {
                ("graph_level", "basic"): [0.985, 0.99],  # 1.5% faster on every run: kept as it was
                ("enable_cpu_mem_arena", False): [0.80, 1.20],  # faster median, overlapping runs: kept
                ("enable_mem_pattern", False): [0.90, 0.91],  # clearly faster: taken
            }
        ),
    )
    assert found["session"] == DEFAULTS | {"enable_mem_pattern": False}
    assert found["workload_seconds"] == pytest.approx(0.905)
    tried = [trial["settings"] for trial in found["trials"]]
    assert DEFAULTS | {"graph_level": "basic"} in tried
    assert all(len(trial["runs"]) == 2 for trial in found["trials"])
    confirmed = [trial["settings"] for trial in found["trials"] if trial.get("confirming")]
    in_turn = [DEFAULTS, DEFAULTS | {"enable_mem_pattern": False}] * tuning.CONFIRMATIONS
    assert confirmed == in_turn  # measured again, best and candidate in turn, before the change


def test_a_win_over_one_slow_trial_of_the_best_is_measured_again_and_not_taken(monkeypatch):
    """The sweep's first trial ran 3-5% slow here: a candidate that beats only that trial stays out."""
    calls = {"defaults": 0}

    def runs_of(settings: dict) -> list[float]:
        if settings == DEFAULTS:
            calls["defaults"] += 1
            return [1.05, 1.06] if calls["defaults"] == 1 else [1.0, 1.01]
        return [1.01, 1.015] if settings == DEFAULTS | {"graph_level": "basic"} else [1.1, 1.1]

    found = fake_sweep(monkeypatch, runs_of)
    assert found["session"] == DEFAULTS
    assert calls["defaults"] == 1 + tuning.CONFIRMATIONS and found["workload_seconds"] == pytest.approx(1.005)


def test_a_win_over_two_slow_trials_of_the_best_is_not_taken_when_measured_in_turn(monkeypatch):
    """This machine's speed drifts over minutes: here the best's first trial and its first
    confirming trial both run 5% slow, and the candidate is no faster. Pooled with those stale
    trials, the candidate looked ahead on every run and was taken (two of 14 graph levels flipped
    on one re-run); judged on the rounds measured in turn, it is not."""
    calls = {"defaults": 0}

    def runs_of(settings: dict) -> list[float]:
        if settings == DEFAULTS:
            calls["defaults"] += 1
            return [1.05, 1.06] if calls["defaults"] <= 2 else [1.0, 1.01]
        return [1.0, 1.01] if settings == DEFAULTS | {"graph_level": "basic"} else [1.1, 1.1]

    found = fake_sweep(monkeypatch, runs_of)
    assert found["session"] == DEFAULTS
    assert calls["defaults"] == 1 + tuning.CONFIRMATIONS


def test_a_graph_level_that_builds_a_graph_already_measured_is_not_measured(monkeypatch):
    """onnxruntime's "extended" and "all" build one graph for a decoder: between them only noise could choose."""
    same = {"extended": "fused", "all": "fused"}

    def levels(found: dict) -> list[str]:
        return [trial["settings"]["graph_level"] for trial in found["trials"]]

    found = fake_sweep(monkeypatch, runs_with({}), graphs=same)  # from the default, all
    assert "basic" in levels(found) and "extended" not in levels(found)

    found = fake_sweep(monkeypatch, runs_with({}), incumbent=DEFAULTS | {"graph_level": "basic"}, graphs=same)
    assert "extended" in levels(found) and "all" not in levels(found)
    assert found["graph_levels"] == {"basic": "basic", "extended": "fused", "all": "fused"}


def test_graph_digests_tell_onnxruntimes_optimized_graphs_apart(built):
    """On a real artifact: "extended" and "all" build the same graph, "basic" leaves the SiLU unfused."""
    digests = tuning.GraphDigests(built["fp32"])
    assert digests.digest("extended") == digests.digest("all") != digests.digest("basic")


def test_the_sweep_starts_from_what_this_machine_chose_before_while_it_is_proven(monkeypatch):
    before = DEFAULTS | {"graph_level": "extended", "enable_cpu_mem_arena": False}
    slower_defaults = runs_with({})  # nothing is clearly faster than the incumbent: it stays
    found = fake_sweep(monkeypatch, slower_defaults, incumbent=before)
    assert found["trials"][0]["settings"] == before and found["session"] == before

    unproven = before | {"prefill_chunk": 64}  # validate no longer proves pieces: start from the defaults
    found = fake_sweep(monkeypatch, slower_defaults, allowed=lambda s: not s["prefill_chunk"], incumbent=unproven)
    assert found["trials"][0]["settings"] == DEFAULTS and found["session"] == DEFAULTS

    incomplete = {"graph_level": "basic"}  # an older file's settings: not a whole choice
    assert fake_sweep(monkeypatch, slower_defaults, incumbent=incomplete)["trials"][0]["settings"] == DEFAULTS


def test_bench_starts_from_a_runtime_json_tuned_on_this_machine_only(tmp_path):
    runtime = tmp_path / "int4.runtime.json"
    assert bench.chosen_before(runtime) is None  # none yet
    session = DEFAULTS | {"graph_level": "basic"}
    here = {"session": session, "measured_by": bench.TUNED, "machine": machine.describe()}
    runtime.write_text(json.dumps(here), encoding="utf-8")
    assert bench.chosen_before(runtime) == session
    elsewhere = here | {"machine": {"cpu": "another CPU", "features": ["avx2"]}}
    runtime.write_text(json.dumps(elsewhere), encoding="utf-8")
    assert bench.chosen_before(runtime) is None
    untuned = here | {"measured_by": "bench.tune false: not measured"}
    runtime.write_text(json.dumps(untuned), encoding="utf-8")
    assert bench.chosen_before(runtime) is None
    runtime.write_text("{not json", encoding="utf-8")
    assert bench.chosen_before(runtime) is None

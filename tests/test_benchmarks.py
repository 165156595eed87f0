"""The benchmark scripts' engines and arithmetic on the tiny model: every engine generates the same
greedy tokens (they are comparable), and the summaries compute what they say. No timing asserts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import engines, provenance, side_by_side

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


def test_a_step_that_ran_at_the_defaults_says_so(specs):
    """A row meant to run at bench's settings records the settings it got here, and a chain step
    named for tuned settings that got the defaults (bench tuned them on another CPU) says so."""
    tuned = side_by_side.with_settings(specs["ort"])
    assert tuned["settings"] == provenance.settings_used(Path(specs["ort"]["path"]))
    assert "settings" not in side_by_side.with_settings(specs["ort-plain genai"])
    assert side_by_side.settings(specs["ort-plain genai"]) == "the engine's defaults"
    figures = {"end_to_end_seconds": 2.0, "decode_tokens_per_second": 50.0, "seconds_to_first_token_p50": 0.1}
    figures |= {"peak_rss_mb": 100.0}
    elsewhere = "onnxruntime's defaults (bench tuned it on X, avx2)"
    long = {
        "order": ["+ int4", "+ tuned session settings", "+ I/O binding"],
        "steps": {"+ tuned session settings": 1.0, "+ I/O binding": 2.0},
        "chain": {
            "+ int4": figures | {"spec": {}},
            "+ tuned session settings": figures | {"spec": {"tuned": True, "settings": elsewhere}},
            "+ I/O binding": figures | {"spec": {"tuned": True, "settings": "tuned by bench (runtime.json)"}},
        },
    }
    rows = side_by_side.chain_table(long).splitlines()[2:]
    assert rows[1].startswith(f"| + tuned session settings ({elsewhere}) |") and rows[2].startswith("| + I/O binding |")


def test_attention_times_each_kernel_and_cache_at_each_row_count_and_writes_in_place(monkeypatch, kernel_library):
    """The attention benchmark on a tiny shape: both caches, every row count and prompt, its table;
    and a step writes the new token into the bound buffer at its position, as BatchDecoder's do."""
    import onnxruntime as ort

    from benchmarks import attention

    monkeypatch.setattr(attention, "TIMED_SECONDS", 0.01)
    monkeypatch.setitem(attention.SHAPES, "tiny", (4, 2, 16, 2))
    kernels = tuple(attention.KERNELS)
    found = attention.measure("tiny", rows=[1, 2], contexts=[8], prompts=[4], threads=1, rounds=2, kernels=kernels)
    assert set(found["kernels"]) == set(kernels)
    for caches in found["kernels"].values():
        assert set(caches) == {"float", "int8"}
        for figures in caches.values():
            assert set(figures["decode_us_per_layer"]["8"]) == {"1", "2"}
            assert set(figures["prefill_us_per_layer"]) == {"4"}
    lines = attention.table({"rows": [1, 2], "contexts": [8], "prompts": [4], "models": {"tiny": found}}).splitlines()
    assert len(lines) == 6 and lines[-1].startswith("| tiny (4 / 2 x 16) | ortforge | int8 | 8 | ")
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernel_library))
    for kernel in kernels:
        for bits in (None, 8):
            graph = attention.attention_model(4, 2, 16, bits, kernel)
            session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
            (binding,), (key, _value) = attention.bindings(session, (4, 2, 16), 2, 1, 8, bits, 1)
            before = key.copy()
            session.run_with_iobinding(binding)
            changed = np.flatnonzero((key != before).any(axis=(1, 3)).any(axis=0))
            assert changed.tolist() == [8] and np.isfinite(binding.get_outputs()[0].numpy()).all()


def test_attention_kernel_times_both_kernels_and_tabulates(monkeypatch, hand_written_kernel):
    from benchmarks import attention, attention_kernel

    monkeypatch.setattr(attention, "TIMED_SECONDS", 0.01)
    monkeypatch.setitem(attention.SHAPES, "tiny", (4, 2, 16, 2))
    found = attention_kernel.measure("tiny", hand_written_kernel, rows=[1, 2], contexts=[40], prompts=[20], rounds=2)
    assert found["max_abs_difference"] < 1e-5 and set(found["call_overhead_us"]) == set(attention_kernel.ENGINES)
    assert set(found["decode_us_per_layer"]["40"]) == {"1", "2"}
    assert set(found["prefill_us_per_layer"]["20"]) == set(attention_kernel.ENGINES)
    lines = attention_kernel.table({"models": {"tiny": found}}).splitlines()
    assert len(lines) == 5 and lines[-1].startswith("| tiny (4 / 2 x 16) | prefill 20 tokens | ")


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


def test_quality_sits_beside_speed_and_absent_peers_are_named():
    """Each row says its perplexity ratio or why it has none; a peer the run left out is named."""
    row = {"decode_tokens_per_second": 100.0, "decode_ms_per_token_p50": 10.0, "decode_ms_per_token_p95": 11.0}
    row |= {"seconds_to_first_token_p50": 0.1, "seconds_to_first_token_p95": 0.2, "peak_rss_mb": 200.0}
    row |= {"size_mb": 80.0, "share_of_roofline": 0.5}
    results = {
        "ortforge int4": row | {"spec": {"kind": "ort", "path": "artifacts/m/variants/int4", "tuned": True}},
        "onnxruntime-genai int4 + its runtime": row | {"spec": {"kind": "genai", "path": "x/genai-int4"}},
        "PyTorch fp32, KV cache": row | {"spec": {"kind": "torch-kv", "path": "x/hf", "float_weights": True}},
        "ortforge int4 + prompt lookup (3 tokens)": row
        | {"spec": {"kind": "ort", "path": "artifacts/m/variants/int4", "prompt_lookup": 3}},
    }
    found = {"ortforge int4": {"ppl_ratio": 1.0521}}
    lines = {line.split(" | ")[0].strip("| "): line for line in side_by_side.table(results, found).splitlines()[2:]}
    assert "| 1.052 |" in lines["ortforge int4"]
    assert "| not scored |" in lines["onnxruntime-genai int4 + its runtime"]
    assert "| 1 (float weights) |" in lines["PyTorch fp32, KV cache"]
    assert "int4's (greedy tokens unchanged)" in lines["ortforge int4 + prompt lookup (3 tokens)"]
    absent = side_by_side.absent_peers({name: r["spec"] for name, r in results.items()})
    assert "onnxruntime-genai" not in absent and {"llama.cpp", "OpenVINO GenAI"} <= set(absent)


def test_a_peers_replayed_logits_score_as_the_live_decoder_does(built, params):
    """Peers in other processes (OpenVINO's venv) hand back logits of validate's sequences; replayed
    through validate's own metrics they give the figures the live decoder gives, and a token that
    is not the one scored fails instead of passing as a quality figure."""
    from ortforge.decoder import Decoder
    from tasks.evaluation.metrics import Reference, windows

    reference, cfg = Reference.load(built["reference"]), params.validation.eval
    decoder = Decoder.for_artifact(built["int4"])
    sequences = engines.scored_sequences(reference)
    assert sum(map(len, sequences)) == sum(len(t.ids) - 1 for t in reference.texts.values())
    logits = [np.concatenate([w for _, w in windows(decoder, np.asarray(s), cfg.window, len(s))]) for s in sequences]

    live = engines._scored(decoder, reference, cfg)
    replayed = engines._scored(engines.ScoredLogits(sequences, logits), reference, cfg)
    assert replayed == pytest.approx(live) and live["ppl_ratio"] > 1
    shifted = [sequence[1:] + sequence[:1] for sequence in sequences]
    with pytest.raises(ValueError, match="not the ones scored"):
        engines._scored(engines.ScoredLogits(shifted, logits), reference, cfg)


def test_load_goals_compare_against_the_best_peer_within_our_quality_budget():
    """OpenVINO's int4 is faster but outside our int4 budget, ortforge's int4 within it but slower
    than its w8a8: our fastest within the budget is held to their fastest within it (int8)."""
    from benchmarks import load_peers

    def figures(rate: float, first_p95: float, gap_p95: float) -> dict:
        return {
            "aggregate_tokens_per_second": rate,
            "seconds_to_first_token_p95": first_p95,
            "inter_token_ms_p95": gap_p95,
        }

    def engine(ppl, one, eight, first):
        return {"load": {"1": one, "8": eight}, "first_token_seconds": {"128": first}} | (
            {"quality": {"ppl_ratio": ppl}} if ppl else {}
        )

    report = {
        "streams": ["1", "8"],
        "prompt_tokens": 128,
        "int4_ppl_budget": 1.07,
        "engines": {
            "OpenVINO GenAI int4, group 32 (CPU defaults)": engine(
                1.2, figures(90, 0.1, 10), figures(500, 0.3, 20), 0.03
            ),
            "OpenVINO GenAI int8 (CPU defaults)": engine(1.01, figures(80, 0.1, 10), figures(400, 0.3, 20), 0.05),
            "OpenVINO GenAI int8 (f32)": engine(None, figures(60, 0.2, 12), figures(900, 0.1, 20), 0.15),
            "ortforge int4": engine(1.05, figures(100, 0.1, 8), figures(400, 0.25, 20), 0.08),
            "ortforge int8": engine(1.003, figures(95, 0.1, 9), figures(300, 0.4, 30), 0.06),
            "ortforge w8a8": engine(1.02, figures(100, 0.1, 8), figures(480, 0.25, 20), 0.04),
        },
    }
    report["engines"]["ortforge w8a8"]["settings"] = "tuned by bench (runtime.json)"
    assert load_peers.settings_line(report) == (
        "ortforge's session settings: ortforge int4, not recorded; ortforge int8, not recorded; "
        "ortforge w8a8, tuned by bench (runtime.json)"
    )
    said = load_peers.goals(report)
    assert said[0].startswith(
        "within our int4 budget (ppl ratio <= 1.07), 8 streams: ortforge w8a8 x1.20 the throughput of "
        "OpenVINO GenAI int8 (CPU defaults)"
    )
    assert "(goal x1.2: met)" in said[0] and "250 ms against 300 ms (goal no worse: met)" in said[0]
    assert "int8, 8 streams: ortforge int8 x0.75 the throughput of OpenVINO GenAI int8 (CPU defaults)" in said[1]
    assert "(goal x1.2: not met)" in said[1]
    assert said[2] == (
        "ortforge int4, 8 streams against 1: throughput x4.00 (goal x4: met), "
        "p95 inter-token x2.50 (goal at most x3: met)"
    )
    assert "p95 inter-token x3.33 (goal at most x3: not met)" in said[3]
    assert said[5] == (
        "first token, 128 tokens, batch 1, within our int4 budget: ortforge w8a8 40 ms against "
        "OpenVINO GenAI int8 (CPU defaults) 50 ms (goal no slower: met)"
    )


def test_load_prompts_share_no_prefix():
    from benchmarks import load_peers

    streams = load_peers.stream_prompts(list(range(1000)), 3, 2, 100)
    flat = [prompt for stream in streams for prompt in stream]
    assert len(streams) == 3 and all(len(p) == 100 for p in flat) and len({p[0] for p in flat}) == 6
    with pytest.raises(SystemExit, match="the bench text has 1000 tokens; 12 prompts of 100 need more"):
        load_peers.stream_prompts(list(range(1000)), 6, 2, 100)


def test_scale_load_goal_holds_our_fastest_against_the_peers_fastest():
    """Random weights carry no quality, so at scale the goal is speed alone: ortforge's fastest
    variant at 8 streams against OpenVINO GenAI's fastest, and first-token p95 against that one's."""
    from benchmarks import scale

    rows = {
        "ortforge int4": {"streams_tok_s": 50.0, "streams_first_token_p95_ms": 4000.0},
        "ortforge w8a8": {"streams_tok_s": 120.0, "streams_first_token_p95_ms": 2000.0},
        "onnxruntime-genai int4": {"decode_tok_s": 30.0},
        "OpenVINO GenAI int4 (CPU defaults)": {"streams_tok_s": 90.0, "streams_first_token_p95_ms": 2500.0},
        "OpenVINO GenAI int8 (CPU defaults)": {"streams_tok_s": 100.0, "streams_first_token_p95_ms": 1600.0},
    }
    (line,) = scale.under_load_goals("llama-3.2-1b", rows)
    assert line == (
        "- llama-3.2-1b, 8 streams: ortforge w8a8 120.0 tok/s, x1.20 OpenVINO GenAI int8 (CPU defaults) "
        "(goal at least x1.2: met); first-token p95 x1.25 the peer's (goal at most x1: **not met**)"
    )
    assert scale.under_load_goals("llama-3.2-1b", {"ortforge int4": rows["ortforge int4"]}) == []


def test_the_scheduler_replay_runs_the_real_scheduler_and_puts_the_model_back():
    from benchmarks import scheduler_replay
    from ortforge import scheduler

    timings = scheduler_replay.Timings({1: 1.0, 4: 2.0, 8: 4.0}, first_token_128_ms=1.0 + 128 * 0.01)
    assert timings.step(2) == pytest.approx(1.333e-3, rel=1e-3) and timings.piece(64) == pytest.approx(1.64e-3)
    scheduler_replay.StandInBatch.timings = timings
    found = scheduler_replay.replay(streams=3, requests=2, prompt_tokens=20, new_tokens=5, share=1.5, finish=8)
    assert found["requests"] == 6 and found["aggregate_tokens_per_second"] > 0
    assert found["seconds_to_first_token_p50"] <= found["seconds_to_first_token_p95"]
    assert scheduler.BatchDecoder.__module__ == "ortforge.batch"  # the real decoder is back


def test_execution_providers_count_where_nodes_ran_and_how_far_the_logits_moved():
    """The execution-provider benchmark's arithmetic on a profiler trace and two runs (the plugin
    itself is a benchmark peer the tests never need)."""
    from benchmarks import execution_providers as eps

    def node(name: str, provider: str, op: str) -> dict:
        return {"cat": "Node", "name": f"{name}_kernel_time", "args": {"provider": provider, "op_name": op}}

    events = [node("ov_0", eps.OPENVINO, "OpenVINO-EP-subgraph_1"), node("gqa_0", "CPUExecutionProvider", "GQA")]
    events += [node("ov_1", eps.OPENVINO, "OpenVINO-EP-subgraph_2"), {"cat": "Session", "name": "model_run"}]
    events.append(node("gqa_0", "CPUExecutionProvider", "GQA"))  # the same node in a second run
    placement = eps.node_placement(events)
    assert placement == {"nodes": {eps.OPENVINO: 2, "CPUExecutionProvider": 1}, "cpu_op_types": {"GQA": 1}}

    def run(logits: list[float], tokens: list[int], prefill: float) -> dict:
        timings = {"load_seconds": 1.0, "prefill_ms": [prefill] * 3, "step_ms": [5.0, 6.0, 7.0]}
        return {
            "plugin_version": "1",
            "placement": placement,
            "first_logits": logits,
            "greedy_tokens": tokens,
        } | timings

    cpu = [run([0.0, 2.0, 10.0], [1, 2, 3, 4], 100.0)]
    other = eps.summarize([run([0.5, 2.0, 9.0], [1, 2, 9, 4], 50.0), run([0.5, 2.0, 9.0], [1, 2, 9, 4], 70.0)], cpu)
    assert other["largest_logit_change"] == 1.0 and other["logit_range"] == 10.0
    assert other["greedy_tokens_equal"] == 2 and other["prefill_ms_p50"] == 60.0 and other["step_ms_p50"] == 6.0
    assert eps.summarize(cpu + cpu, cpu)["greedy_tokens_equal"] == 4  # all equal: every token
    report = {"new_tokens": 4, "variants": {"int4": {eps.CPU: eps.summarize(cpu, None), "OpenVINO EP (f32)": other}}}
    elsewhere = "onnxruntime's defaults (bench tuned it on X, avx2)"
    report["session_settings"] = {"int4": elsewhere, "w8a8": "tuned by bench (runtime.json)"}
    cpu_row, row = eps.table(report).splitlines()[-2:]
    assert "| 2 / 1 | GQA 1 | 60.0 | x0.60 |" in row and "| 1 (10.0) | 2/4 |" in row
    assert f"| int4 | CPU EP ({elsewhere}) |" in cpu_row  # what it ran with
    # a provider that will not load a graph: its row says why, with as many cells as the header
    error = RuntimeError("[ONNXRuntimeError] : 1 : FAIL :\n OpenVINO-EP: it could not convert QuantizeLinear-21")
    refused = eps.summarize([{"plugin_version": "1", "refused": eps.refusal(error)}], cpu)
    assert refused == {"plugin_version": "1", "refused": "OpenVINO-EP: it could not convert QuantizeLinear-21"}
    assert eps.refusal(RuntimeError("")) == "RuntimeError"  # an error without a message still says something
    report["variants"]["w8a8"] = {eps.CPU: eps.summarize(cpu, None), "OpenVINO EP (its defaults)": refused}
    header, *_, last = eps.table(report).splitlines()
    assert "refused: OpenVINO-EP: it could not convert" in last and last.count("|") == header.count("|")


def test_a_plugin_that_offers_no_device_is_a_refusal_not_a_crash(built, monkeypatch):
    """On a CPU where the OpenVINO plugin registers and lists no device (an AMD EPYC did), the
    benchmark records why for that configuration and goes on, instead of stopping on the lookup."""
    import onnxruntime as ort

    from benchmarks import execution_providers as eps

    monkeypatch.setattr(ort, "register_execution_provider_library", lambda name, path: None)
    monkeypatch.setattr(ort, "get_ep_devices", lambda: [])
    found = eps.run_config(str(built["fp32"]), "plugin.so", {}, [5, 6, 7])
    assert found == {"plugin_version": None, "refused": eps.NO_DEVICE}
    assert eps.summarize([found], None)["refused"] == eps.NO_DEVICE


def test_prefill_pieces_times_every_length_and_piece_and_shows_the_runtimes_against_whole(built):
    """The long-prompt benchmark on the tiny model: each length whole and in each piece size, then
    its table in length order with the runtime's piece against the whole prompt."""
    from benchmarks import prefill_pieces
    from ortforge.generate import LONG_PROMPT_PIECE

    ids = list(range(5, 45))
    found = prefill_pieces.first_tokens(str(built["fp32"]), ids, [40, 12], [8, LONG_PROMPT_PIECE], 1)
    assert found["pieces_proven"] and found["tuned_prefill_chunk"] == 0
    assert {n: sorted(by, key=int) for n, by in found["seconds"].items()} == {
        n: ["0", "8", str(LONG_PROMPT_PIECE)] for n in ("40", "12")
    }
    assert all(len(s) == 1 and s[0] > 0 for by in found["seconds"].values() for s in by.values())
    medians = {"12": {"0": 10.0, "8": 9.0, str(LONG_PROMPT_PIECE): 10.0}, "40": {"0": 40.0, "8": 30.0}}
    report = {"pieces": [8, LONG_PROMPT_PIECE], "variants": {"fp32": {**found, "first_token_ms": medians}}}
    rows = prefill_pieces.table(report).splitlines()[2:]
    assert rows == ["| fp32 | 12 | 10 | 9 | 10 | x1.00 |", "| fp32 | 40 | 40 | 30 | - | - |"]
    memory = prefill_pieces.peak_memory(str(built["fp32"]), ids, 8)
    assert memory["peak_mb"] >= memory["loaded_mb"] > 0


def test_step_profile_splits_each_phase_into_operators_and_the_python_around_them(on_our_kernel):
    """step_profile.py on the tiny model, on ortforge's attention kernel: every phase's model runs
    found in the profiler's trace (the custom op's among them), the scheduler timed without it, and
    both summaries read from the same figures."""
    from benchmarks import step_profile

    prompts = [list(range(5 + row, 17 + row)) for row in range(max(step_profile.ROWS))]
    figures = step_profile.profile_variant(str(on_our_kernel), prompts, 2, 1)
    labels = [step_profile.prefill_label(12), *(step_profile.step_label(rows) for rows in step_profile.ROWS)]
    assert sorted(figures["phases"]) == sorted(labels)
    for label in labels:
        phase = figures["phases"][label]
        assert phase["model_runs_per_operation"] == 1 and phase["wall_ms_p50"] >= phase["model_run_ms"] > 0
        assert phase["ops_ms"]["GroupQueryAttention"] > 0
    figures["scheduler"] = step_profile.scheduler_time(str(on_our_kernel), prompts, 4)
    assert all(figures["scheduler"][str(rows)]["steps"] > 0 for rows in step_profile.ROWS)
    report = {"variants": {"fp32_attn": figures}}
    assert len(step_profile.table(report).splitlines()) == 2 + len(labels)
    (line,) = step_profile.batching_cost(report)
    one, eight = (figures["scheduler"][rows]["batch_step_ms_p50"] for rows in ("1", "8"))
    assert line.startswith(f"- fp32_attn: a step of 8 rows takes x{eight / one:.2f} the time of 1 row")


def test_quantize_chain_stands_one_node_in_for_each_per_token_chain_and_times_both(built, tmp_path):
    """quantize_chain.py on the tiny model's w8a8 recipe: every six-node chain becomes one
    DynamicQuantizeLinear, the stand-in runs, both graphs are timed, and the summary's ratios are
    the medians'."""
    import onnx
    import onnxruntime as ort

    from benchmarks import quantize_chain
    from tasks import quantize
    from tasks.quantization.configs import quantize_config

    w8a8 = tmp_path / "w8a8"
    quantize.run(quantize_config(method="int8_per_token"), built["optimized"], built["hf"], w8a8, {})
    stand_in = tmp_path / "stand_in"
    chains = quantize_chain.one_node_graph(w8a8, stand_in)
    ops = [node.op_type for node in onnx.load(str(stand_in / "model.onnx"), load_external_data=False).graph.node]
    assert chains == ops.count("MatMulIntegerToFloat") == ops.count("DynamicQuantizeLinear") > 0
    assert "Abs" not in ops and "ReduceMax" not in ops and "QuantizeLinear" not in ops
    assert quantize_chain._node_count(w8a8) == len(ops) + 5 * chains
    ort.InferenceSession(str(stand_in / "model.onnx"), providers=["CPUExecutionProvider"])  # a valid graph

    prompts = [list(range(5 + row, 17 + row)) for row in range(max(quantize_chain.ROWS))]
    rounds = {
        graph: [quantize_chain.time_graph(str(folder), str(w8a8), prompts, 4)]
        for graph, folder in zip(quantize_chain.GRAPHS, (w8a8, stand_in), strict=True)
    }
    keys = {"prefill_ms", *(f"step_{rows}_ms" for rows in quantize_chain.ROWS)}
    assert all(set(found[0]) == keys and min(found[0].values()) > 0 for found in rounds.values())
    report = {
        "chains": chains,
        "graphs": {graph: {"nodes": 1, "median": quantize_chain.medians(found)} for graph, found in rounds.items()},
    }
    assert len(quantize_chain.table(report).splitlines()) == 2 + len(quantize_chain.GRAPHS)
    built_ms, fused_ms = (rounds[graph][0]["step_8_ms"] for graph in quantize_chain.GRAPHS)
    assert f"8 rows x{built_ms / fused_ms:.2f}" in quantize_chain.summary(report)


def test_attention_op_finds_the_kernel_twin_and_tabulates_both():
    """attention_op.py pairs a variant with the build of the same recipe on ortforge's kernel, and
    its summary names both and the peer."""
    from benchmarks import attention_op
    from tasks.core.params import Build
    from tasks.quantization.configs import quantize_config

    recipes = {
        "w8a8": quantize_config(method="int8_per_token"),
        "w8a8_attn": quantize_config(method="int8_per_token", attention="ortforge"),
        "int4": quantize_config(method="weight_only"),
        "int4_attn": quantize_config(method="weight_only", attention="ortforge"),
        "int8": quantize_config(method="weight_only", bits=8),
    }
    builds = {f"m-{v}": Build(model="m", variant=v) for v in recipes}
    assert attention_op.kernel_twin(builds, recipes, "m", "w8a8") == "w8a8_attn"
    assert attention_op.kernel_twin(builds, recipes, "m", "int4") == "int4_attn"
    with pytest.raises(SystemExit, match="builds no m variant with int8's recipe and attention: ortforge"):
        attention_op.kernel_twin(builds, recipes, "m", "int8")
    with pytest.raises(SystemExit, match="int4_attn runs ortforge's kernel already"):
        attention_op.kernel_twin(builds, recipes, "m", "int4_attn")

    def load(tps: float) -> dict:
        return {
            "aggregate_tokens_per_second": tps,
            "seconds_to_first_token_p50": 0.1,
            "seconds_to_first_token_p95": 0.2,
            "inter_token_ms_p50": 10.0,
            "inter_token_ms_p95": 12.0,
        }

    def engine(one: float, eight: float) -> dict:
        return {
            "load": {"1": load(one), "8": load(eight)},
            "throughput_by_round": {"1": [one, one], "8": [eight * 0.9, eight * 1.1]},
            "first_token_seconds": {"128": 0.07},
        }

    peer = "OpenVINO GenAI int8 (CPU defaults)"
    report = {
        "streams": ["1", "8"],
        "variants": {attention_op.STOCK: "w8a8", attention_op.OURS: "w8a8_attn"},
        "engines": {
            attention_op.STOCK: engine(80, 240),
            attention_op.OURS: engine(90, 300),
            peer: {**engine(70, 250), "quality": {"ppl_ratio": 1.01}},
        },
        "validation": {
            attention_op.STOCK: {"passed": True, "checks": {"ppl_ratio[a.txt]": 1.02}},
            attention_op.OURS: {"passed": True, "checks": {"ppl_ratio[a.txt]": 1.03}},
        },
    }
    lines = attention_op.summary(report)
    assert lines[0].startswith("w8a8_attn against w8a8, 8 streams: x1.25 the throughput")
    assert lines[2] == "round by round at 8 streams against w8a8: x1.25, x1.25 (ahead in 2 of 2)"
    assert lines[3].startswith(f"round by round at 8 streams against {peer}: x1.20, x1.20")
    assert lines[4].startswith(f"w8a8_attn against {peer} at 8 streams: throughput x1.20 (w8a8 x0.96)")
    assert lines[-1] == "validate's gates on w8a8_attn: passed; ppl_ratio[a.txt] 1.03 (w8a8 1.02)"
    rows = attention_op.table(report).splitlines()
    assert rows[3].startswith("| ortforge w8a8_attn | 1.030 | 1 | 90.0 |") and rows[4].startswith(f"| {peer} | 1.010 |")


def test_attention_replies_counts_where_replies_part():
    from benchmarks import attention_replies

    assert attention_replies.parting([1, 2, 3], [1, 2, 3]) is None
    assert attention_replies.parting([1, 2, 3], [1, 5, 3]) == 1
    assert attention_replies.parting([1, 2], [1, 2, 3]) == 2  # one ending sooner parts there
    found = attention_replies.compare([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [5, 6]])
    assert found == {"questions": 3, "identical": 1, "first_parting_tokens": [1, 1]}
    report = {"pairs": {"w8a8": {"twin": "w8a8_attn", **found, "chat_qa_scores": {"w8a8": 0.55, "w8a8_attn": 0.45}}}}
    assert attention_replies.table(report).splitlines()[-1] == "| w8a8 | w8a8_attn | 1 of 3 | 1 | 55% / 45% |"

"""report: the table, the Pareto front, the recommendation by the rule in params, and the plot."""

from __future__ import annotations

import json

import pytest

from tasks import report
from tasks.core.params import ReportConfig, TasksConfig
from tasks.core.stage import StageError
from tasks.evaluation import task_scores

# variant: (ppl ratio, size MB, decode tokens/s)
FIGURES = {
    "fp32": (1.000, 540.0, 50.0),
    "int8": (1.004, 146.0, 90.0),
    "int4": (1.054, 86.0, 120.0),
    "int4_bad": (1.260, 81.0, 110.0),  # smallest, so on the front, but outside the budget
    "slow8": (1.010, 200.0, 60.0),  # worse than int8 everywhere: dominated
}


def gate_records(ratio: float, limit: float = 1.07, comparison: bool = False) -> dict:
    """validate.json's verdict and checks for a variant whose perplexity ratio is ratio."""
    checks = {}
    for text in ("prose.txt", "code.c"):
        for gate, value, bound, upper in (
            ("ppl_ratio", ratio, limit, True),
            ("kl_divergence", ratio - 1, 0.1, True),
            ("top1_agreement", 1 - (ratio - 1), 0.8, False),
            ("greedy_agreement", 0.9, 0.8, False),
            ("kv_max_prob_diff", 0.01, 0.1, True),
        ):
            margin = bound - value if upper else value - bound
            checks[f"{gate}[{text}]"] = {
                "gate": gate, "text": text, "value": value, "limit": bound, "margin": margin,
                "upper_bound": upper, "passed": margin >= 0,
            }  # fmt: skip
    return {
        "role": "comparison" if comparison else "goal",
        "goal_met": None if comparison else all(c["passed"] for c in checks.values()),
        "limits_replaced_by_build": {},
        "checks": checks,
        "coverage": {
            "share_as_asked": 1.0,
            "quantized_share": 1.0,
            "kept_float": {"matrices": {}, "share": 0.0, "limit": 0.0},
            "kv_cache": {"asked": "float", "stored_bits": 32, "as_asked": True},
        },
    }


def fake_reports(folder, figures=FIGURES):
    for variant, (ratio, size, speed) in figures.items():
        (folder / variant).mkdir(parents=True)
        validation = {
            **gate_records(ratio),
            "passed": True,
            "perplexity": 19.6 * ratio,
            "ppl_ratio": ratio,
            "kl_divergence": (ratio - 1) * 2,
            "top1_agreement": 1 - (ratio - 1),
            "reference_perplexity": 19.6,
            "greedy_tokens_matched": 20,
            "greedy_steps": 32,
            "tokens_scored": 2048,
        }
        timings = {
            "size_mb": size,
            "decode_tokens_per_second": speed,
            "decode_ms_per_token_p50": 1000 / speed,
            "decode_ms_per_token_p95": 1100 / speed,
            "seconds_to_first_token_p50": 0.1,
            "peak_rss_mb": 300.0,
        }
        bench = {
            **timings,
            "vs_baseline": {"decode_speedup": speed / 25.0},
            "baseline": {**timings, "decode_tokens_per_second": 25.0, "size_mb": 538.0},
            "workload": {"prompt_tokens": 128, "new_tokens": 64, "warmup": 1, "repeats": 3, "rounds": 1},
            "kv_bytes_per_token": 46080,
            "concurrency": {
                str(streams): {
                    "aggregate_tokens_per_second": speed * streams**0.5,
                    "seconds_to_first_token_p50": 0.1 * streams,
                    "seconds_to_first_token_p95": 0.2 * streams,
                    "inter_token_ms_p50": 1000 / speed * streams**0.5,
                    "inter_token_ms_p95": 1100 / speed * streams**0.5,
                    "peak_rss_mb": 300.0 + streams,
                }
                for streams in (1, 4)
            },
        }
        (folder / variant / "validate.json").write_text(json.dumps(validation))
        (folder / variant / "bench.json").write_text(json.dumps(bench))
        fake_answers(folder, variant)


QA_ITEMS = 20  # the reference answers 16 right


def fake_answers(folder, variant, qa_right: int = 16, choices_changed: int = 0):
    """evaluate's tasks.json: a qa set (the first qa_right of QA_ITEMS right) and a choice set of
    20 items (the reference's choice but for the first choices_changed)."""
    ids = [f"q{i:02d}" for i in range(QA_ITEMS)]
    right = {i: n < qa_right for n, i in enumerate(ids)}
    qa = {
        "kind": "qa", "file": "data/tasks/qa.jsonl", "items": QA_ITEMS,
        "answers": {i: "Paris" if right[i] else "Lyon" for i in ids}, "right": right,
        "score": task_scores.share(list(right.values())).record(),
    }  # fmt: skip
    picked = {f"c{n:02d}": (n % 2) ^ (n < choices_changed) for n in range(20)}
    choice_right = {i: pick == int(i[1:]) % 2 for i, pick in picked.items()}
    choice = {
        "kind": "choice", "file": "data/tasks/choice.jsonl", "items": 20, "answers": picked, "right": choice_right,
        "score": task_scores.share(list(choice_right.values())).record(),
    }  # fmt: skip
    record = {"sets": {"qa": qa, "choice": choice}, "chat_template": False, "session": {}, "seconds": 1.0}
    (folder / variant / "tasks.json").write_text(json.dumps(record))


def report_outputs(folder):
    return {name: folder / f"r.{name}" for name in ("md", "png", "load-png", "html", "json")}


@pytest.fixture
def outputs(tmp_path):
    return report_outputs(tmp_path)


def test_run_marks_front_and_recommends_by_rule(tmp_path, outputs):
    fake_reports(tmp_path / "variants")
    summary = report.run("tiny", list(FIGURES), ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)
    assert summary["pareto_front"] == ["fp32", "int8", "int4", "int4_bad"]
    assert summary["recommended"] == "int4"  # fastest within x1.07
    text = outputs["md"].read_text()
    assert "**Recommended: int4**" in text
    assert (
        "| int4 | yes | 20.66 | 1.054 | 0.1080 | 0.946 | 20/32 | 86.0 | 120.0 | 8.3 / 9.2 | 100 | 300 | 4.80 | 46,080 |"
        in text
    )
    assert "| slow8 |  |" in text and f"| {report.BASELINE} | - |" in text
    assert outputs["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(outputs["json"].read_text())["recommended"] == "int4"
    # Under load: the recommended variant's figures against concurrency, and their plot.
    assert "## Under load: int4" in text
    assert "| 4 | 240.0 | 2.00 | 400 / 800 | 16.7 / 18.3 | 304 |" in text
    assert outputs["load-png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(outputs["json"].read_text())["under_load"]["int4"]["4"]["peak_rss_mb"] == 304.0


def test_speeds_from_two_machines_are_said_to_be_so(tmp_path, outputs):
    """A bench reruns only for a changed artifact: after a change built on another machine, one
    table holds speeds no one run measured, and the report says which come from where."""
    fake_reports(tmp_path / "variants")
    assert report.run("tiny", list(FIGURES), ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)[
        "bench_machines"
    ] == {"an unrecorded CPU (-)": list(FIGURES)}
    assert "machines" not in outputs["md"].read_text()
    for variant, features in (("int8", ["avx2"]), ("int4", ["avx2", "amx_int8"])):
        bench = tmp_path / "variants" / variant / "bench.json"
        bench.write_text(json.dumps(json.loads(bench.read_text()) | {"machine": {"cpu": "Xeon", "features": features}}))
    summary = report.run("tiny", list(FIGURES), ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)
    assert summary["bench_machines"]["Xeon (avx2+amx_int8)"] == ["int4"] and len(summary["bench_machines"]) == 3
    assert "Speeds in this table come from 3 machines (" in outputs["md"].read_text()
    assert "int4 on Xeon (avx2+amx_int8)" in outputs["md"].read_text()
    assert "dvc repro --force --single-item --glob 'bench@tiny-*'" in outputs["md"].read_text()


@pytest.mark.parametrize(
    "rule, expected",
    [
        (ReportConfig(recommend_by="size_mb", max_ppl_ratio=1.07), "int4"),
        (ReportConfig(recommend_by="decode_tokens_per_second", max_ppl_ratio=1.01), "int8"),
        (ReportConfig(recommend_by="size_mb", max_ppl_ratio=1.3), "int4_bad"),
        (ReportConfig(recommend_by="decode_tokens_per_second", max_ppl_ratio=1.0), "fp32"),
    ],
)
def test_recommend_follows_the_rule(tmp_path, rule, expected):
    fake_reports(tmp_path / "variants")
    rows = report.collect(tmp_path / "variants", list(FIGURES)).rows
    assert report.recommend(rows, rule, set(FIGURES)).variant == expected
    assert report.recommend(rows, rule, set(FIGURES) - {expected}) != expected  # the task gate's say


def test_run_says_when_nothing_is_within_budget(tmp_path, outputs):
    fake_reports(tmp_path / "variants", {"int4_bad": FIGURES["int4_bad"]})
    summary = report.run("tiny", ["int4_bad"], ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)
    assert summary["recommended"] is None
    assert "none is recommended" in outputs["md"].read_text()


def test_run_names_the_missing_report(tmp_path, outputs):
    fake_reports(tmp_path / "variants", {"fp32": FIGURES["fp32"]})
    with pytest.raises(StageError, match="int8/validate.json is missing; run `dvc repro`"):
        report.run("tiny", ["fp32", "int8"], ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)
    assert not outputs["md"].exists()


def test_a_variant_that_failed_validation_never_reaches_the_table(tmp_path, outputs):
    fake_reports(tmp_path / "variants")
    failed = tmp_path / "variants" / "int4" / "validate.json"
    failed.write_text(json.dumps(json.loads(failed.read_text()) | {"passed": False}))
    summary = report.run("m", list(FIGURES), ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)
    table = outputs["md"].read_text().split("## Validation gates")[0]
    assert "| int4 |" not in table and "int4" not in summary["variants"]
    assert summary["recommended"] != "int4" and summary["failed_validation"] == ["int4"]
    assert "Not shown: int4 failed validation" in table


def test_run_refuses_when_no_variant_passed(tmp_path, outputs):
    fake_reports(tmp_path / "variants", {"int4": FIGURES["int4"]})
    failed = tmp_path / "variants" / "int4" / "validate.json"
    failed.write_text(json.dumps(json.loads(failed.read_text()) | {"passed": False}))
    with pytest.raises(StageError, match="no variant of .* passed validation \\(int4\\)"):
        report.run("m", ["int4"], ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)


def test_the_gate_table_shows_value_limit_and_margin_per_text(tmp_path, outputs):
    fake_reports(tmp_path / "variants")
    summary = report.run("m", list(FIGURES), ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)
    gates = outputs["md"].read_text().split("## Validation gates")[1]
    # int4_bad: ppl 1.26 over int4's 1.07 on both texts, shown failing with its margin
    assert "| int4_bad | goal | prose.txt | 1.26 > 1.07 (-0.19) |" in gates
    assert "| int4 | goal | code.c | 1.054 <= 1.07 (+0.016) |" in gates
    assert summary["validation"]["variants"]["int4"]["checks"]["ppl_ratio[code.c]"]["limit"] == 1.07


def test_comparison_points_and_replaced_limits_are_said_in_words(tmp_path, outputs):
    fake_reports(tmp_path / "variants")
    folder = tmp_path / "variants"
    for variant, changes in (
        ("slow8", gate_records(1.010, comparison=True)),
        ("int4_bad", gate_records(1.26, limit=1.3) | {"goal_met": False}),
    ):
        record = json.loads((folder / variant / "validate.json").read_text()) | changes
        if variant == "int4_bad":
            record["limits_replaced_by_build"] = {"ppl_ratio": {"limit": 1.3, "shared": 1.07}}
            for check in record["checks"].values():
                if check["gate"] == "ppl_ratio":
                    check |= {"shared_limit": 1.07, "meets_shared_limit": False}
        (folder / variant / "validate.json").write_text(json.dumps(record))
    summary = report.run("m", list(FIGURES), ReportConfig(), TasksConfig(), folder, outputs)
    text = outputs["md"].read_text()
    assert "m int4_bad: limit replaced by the build: ppl_ratio 1.3 (shared limit 1.07): quality goal not met." in text
    assert "1.26 <= 1.3* (+0.04)" in text
    assert "4 of 4 goal variants passed validation and 3 met their quality goal (the shared limits); " in text
    assert "1 of 1 comparison points passed" in text
    assert summary["validation"]["counts"] == {
        "goal": {"variants": 4, "passed": 4, "goal_met": 3},
        "comparison": {"variants": 1, "passed": 1},
    }


def test_a_validate_json_without_gate_records_is_refused_naming_the_fix(tmp_path, outputs):
    fake_reports(tmp_path / "variants", {"fp32": FIGURES["fp32"]})
    stale = tmp_path / "variants" / "fp32" / "validate.json"
    stale.write_text(json.dumps({k: v for k, v in json.loads(stale.read_text()).items() if k != "role"}))
    with pytest.raises(StageError, match="predates the gate records the report shows; run `dvc repro`"):
        report.run("m", ["fp32"], ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)


def test_a_variant_that_fails_the_task_gate_is_shown_and_not_recommended(tmp_path, outputs):
    """int4 is fastest within the perplexity budget, but keeps 10 of the reference's 16 right
    answers (0.625 < 0.95): int8 is recommended, unless the rule does not ask for the task gate."""
    folder = tmp_path / "variants"
    fake_reports(folder)
    fake_answers(folder, "int4", qa_right=10)
    fake_answers(folder, "slow8", choices_changed=3)  # 17 of 20 of the reference's choices
    summary = report.run("m", list(FIGURES), ReportConfig(), TasksConfig(), folder, outputs)
    assert summary["recommended"] == "int8"
    text = outputs["md"].read_text()
    assert (
        "**Recommended: int8**: best decode_tokens_per_second within perplexity x1.07 and passing the task gate" in text
    )
    assert "| int4 | x1.054 | 50% [30, 70] | -30 | 70% [48, 85] | 100% [84, 100] | +0 (noise) | 100% [84, 100] " in text
    assert "| fails: qa score retention 0.625 < 0.95 |" in text
    assert (
        "| slow8 | x1.010 |" in text
        and "fails: choice score retention 0.850 < 0.95; choice agreement 0.850 < 0.9" in text
    )
    assert "| fp32 | x1.000 | 80% [58, 92] | +0 (noise) | 100% [84, 100] |" in text and "| reference |" in text
    tasks = summary["tasks"]
    assert tasks["reference"] == "fp32" and tasks["variants"]["int8"]["task_gate_failures"] == []
    assert tasks["variants"]["int4"]["tasks"]["qa"]["retention"] == 10 / 16
    without = report.run(
        "m", list(FIGURES), ReportConfig(require_task_gate=False), TasksConfig(), folder, report_outputs(tmp_path / "b")
    )
    assert without["recommended"] == "int4"


def test_without_the_reference_answers_no_variant_is_recommended_by_the_task_gate(tmp_path, outputs):
    folder = tmp_path / "variants"
    fake_reports(folder)
    failed = folder / "fp32" / "validate.json"
    failed.write_text(json.dumps(json.loads(failed.read_text()) | {"passed": False}))
    summary = report.run("m", list(FIGURES), ReportConfig(), TasksConfig(), folder, outputs)
    assert summary["recommended"] is None and summary["tasks"]["reference"] is None
    text = outputs["md"].read_text()
    assert "No reference answers to compare with" in text and "- int4: qa 80% [58, 92], choice 100% [84, 100]" in text
    assert (
        report.run("m", list(FIGURES), ReportConfig(require_task_gate=False), TasksConfig(), folder, outputs)[
            "recommended"
        ]
        == "int4"
    )


def test_a_missing_tasks_json_names_the_stage(tmp_path, outputs):
    fake_reports(tmp_path / "variants", {"fp32": FIGURES["fp32"]})
    (tmp_path / "variants" / "fp32" / "tasks.json").unlink()
    with pytest.raises(StageError, match="fp32/tasks.json is missing; run `dvc repro` to evaluate fp32"):
        report.run("m", ["fp32"], ReportConfig(), TasksConfig(), tmp_path / "variants", outputs)

"""report: one markdown table and one PNG across variants, with the baseline row."""

from __future__ import annotations

import json

import pytest

from tasks import report
from tasks.stage import StageError


def fake_reports(folder, variants):
    for i, variant in enumerate(variants):
        (folder / variant).mkdir(parents=True)
        validation = {
            "passed": True,
            "perplexity": 20.0 + i,
            "ppl_ratio": 1.0 + i / 20,
            "reference_perplexity": 20.0,
            "greedy_tokens_matched": 32 - i,
            "greedy_steps": 32,
            "tokens_scored": 2048,
        }
        timings = {
            "size_mb": 500.0 / (i + 1),
            "decode_tokens_per_second": 50.0 * (i + 1),
            "decode_ms_per_token_p50": 20.0 / (i + 1),
            "decode_ms_per_token_p95": 25.0 / (i + 1),
            "seconds_to_first_token_p50": 0.1,
            "peak_rss_mb": 800.0 - 100 * i,
        }
        bench = {
            **timings,
            "vs_baseline": {"decode_speedup": 2.0 * (i + 1)},
            "baseline": {**timings, "decode_tokens_per_second": 25.0, "size_mb": 538.0},
            "workload": {"prompt_tokens": 128, "new_tokens": 64, "warmup": 1, "repeats": 3, "rounds": 1},
        }
        (folder / variant / "validate.json").write_text(json.dumps(validation))
        (folder / variant / "bench.json").write_text(json.dumps(bench))


def test_run_writes_table_and_plot(tmp_path):
    fake_reports(tmp_path / "variants", ["fp32", "int4"])
    text = report.run("tiny", ["fp32", "int4"], tmp_path / "variants", tmp_path / "r.md", tmp_path / "r.png")
    lines = text.splitlines()
    assert lines[0] == "# tiny"
    rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| variant", "| fp32", "| int4", f"| {report.BASELINE}"]
    assert "| int4 | yes | 21.00 | 1.050 | 31/32 | 250.0 | 100.0 | 10.0 / 12.5 | 100 | 700 | 4.00 |" in text
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "r.md").read_text() == text


def test_run_names_the_missing_report(tmp_path):
    fake_reports(tmp_path / "variants", ["fp32"])
    with pytest.raises(StageError, match="int8/validate.json is missing; run `dvc repro`"):
        report.run("tiny", ["fp32", "int8"], tmp_path / "variants", tmp_path / "r.md", tmp_path / "r.png")
    assert not (tmp_path / "r.md").exists()

"""Every README figure is filled in from a committed result file by scripts/readme_figures.py, and
the README says nothing its tree contradicts."""

from __future__ import annotations

import json
import re

import pytest

from ortforge import machine
from scripts import readme_figures
from tests.conftest import REPO


def test_readme_figures_equal_their_result_files():
    text = readme_figures.README.read_text(encoding="utf-8")
    assert readme_figures.render(text) == text, "run python scripts/readme_figures.py"


def test_readme_figures_do_not_depend_on_what_is_built_here(monkeypatch, tmp_path):
    """CI renders on a fresh clone with no artifacts: a figure block must come from committed files only."""
    monkeypatch.chdir(tmp_path)  # artifacts/ and reports/ are relative paths: none exist here
    text = readme_figures.README.read_text(encoding="utf-8")
    assert readme_figures.render(text) == text


def test_every_renderer_has_a_block_and_every_block_a_renderer():
    text = readme_figures.README.read_text(encoding="utf-8")
    assert sorted(m["name"] for m in readme_figures.BLOCK.finditer(text)) == sorted(readme_figures.RENDERERS)


def test_an_edited_figure_is_caught():
    text = readme_figures.README.read_text(encoding="utf-8")
    block = next(readme_figures.BLOCK.finditer(text))
    edited = text[: block.end() - 20] + "9" + text[block.end() - 20 :]
    assert readme_figures.render(edited) != edited


def test_a_block_without_renderer_is_refused():
    with pytest.raises(SystemExit, match="no renderer"):
        readme_figures.render("<!-- figures: nothing -->\nx\n<!-- /figures -->\n")


def test_every_path_the_readme_names_exists():
    text = readme_figures.README.read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:tasks|flows|ortforge|tests|benchmarks|scripts)/[\w/]+\.(?:py|json|md|png))`", text))
    assert named and [p for p in sorted(named) if not (REPO / p).exists()] == []


def test_the_results_and_reports_describe_what_dvc_lock_names():
    """No result file recorded hashes other than dvc.lock's now, and every report is the output
    dvc.lock records (a result file that records no provenance fails too: nothing could tell)."""
    errors = readme_figures.outdated_sources()
    assert errors == [], "python -m benchmarks.refresh, then python scripts/readme_figures.py"


def test_a_result_about_a_rebuilt_artifact_is_named_with_its_refresh_command(tmp_path, monkeypatch):
    from benchmarks import provenance, refresh

    lock = tmp_path / "dvc.lock"
    lock.write_text(
        "schema: '2.0'\nstages:\n  quantize@m-int4:\n    outs:\n    - path: artifacts/m/variants/int4\n"
        "      md5: aaa.dir\n",
        encoding="utf-8",
    )
    result = {"provenance": {"refresh": "python benchmarks/kv_cache.py --model m", "measured": {}}}
    result["provenance"]["measured"]["artifacts/m/variants/int4"] = "aaa.dir"
    assert provenance.stale(result, provenance.lock_outputs(lock)) == []
    lock.write_text(lock.read_text(encoding="utf-8").replace("aaa.dir", "bbb.dir"), encoding="utf-8")
    assert provenance.stale(result, provenance.lock_outputs(lock)) == [
        "artifacts/m/variants/int4 is bbb.dir in dvc.lock, aaa.dir when measured"
    ]
    assert provenance.stale({}, {}) == [provenance.UNRECORDED]
    results = tmp_path / "results"
    results.mkdir()
    (results / "kv_cache.json").write_text(json.dumps(result), encoding="utf-8")
    monkeypatch.setattr(refresh, "RESULTS", results)
    outputs = provenance.lock_outputs(lock)
    monkeypatch.setattr(readme_figures.provenance, "lock_outputs", lambda: outputs)
    monkeypatch.setattr(readme_figures.provenance, "stale_stages", lambda: [])
    (results / "serving.json").write_text(json.dumps({"servers": {}}), encoding="utf-8")
    errors = readme_figures.outdated_sources()
    assert errors[0] == (
        "benchmarks/results/kv_cache.json: artifacts/m/variants/int4 is bbb.dir in dvc.lock, aaa.dir when measured; "
        "refresh: python benchmarks/kv_cache.py --model m"
    )
    assert errors[1].startswith("benchmarks/results/serving.json: it records no provenance")
    assert errors[2] == (
        f"benchmarks/results/side_by_side.json: {refresh.MISSING}; refresh: python benchmarks/side_by_side.py"
    )


def test_a_report_that_is_not_the_locked_output_is_an_error(monkeypatch):
    from benchmarks import provenance

    report = REPO / "reports" / "smollm2-135m" / "report.json"
    locked = provenance.lock_outputs()
    changed = {**locked, "reports/smollm2-135m/report.json": {"stage": "report@smollm2-135m", "md5": "0" * 32}}
    monkeypatch.setattr(readme_figures.provenance, "lock_outputs", lambda: changed)
    monkeypatch.setattr(readme_figures.provenance, "stale_stages", lambda: [])
    errors = readme_figures.outdated_sources()
    assert f"{report.relative_to(REPO)} is not what dvc.lock records for report@smollm2-135m; run `dvc repro`" in errors


def test_a_measurement_records_the_locked_hashes_of_what_it_read():
    from benchmarks import provenance

    path = "artifacts/smollm2-135m/hf"
    found = provenance.record("python benchmarks/x.py --model smollm2-135m", [path])
    assert found["measured"] == {path: provenance.lock_outputs()[path]["md5"]}
    assert len(found["commit"]) == 40 and found["refresh"] == "python benchmarks/x.py --model smollm2-135m"
    assert found["machine"] == machine.describe()  # figures are true of the CPU they ran on
    with pytest.raises(SystemExit, match="artifacts/nothing not in dvc.lock; run `dvc repro` first"):
        provenance.require_current(["artifacts/nothing"])


def test_a_row_says_bench_settings_only_where_the_runtime_uses_them(tmp_path):
    """A benchmark row meant to run at bench's settings says what it got on this machine: bench's
    where they were tuned on this CPU, onnxruntime's defaults (naming the other CPU) where they were
    not, as SessionSettings.for_artifact decides."""
    from benchmarks import provenance
    from ortforge.manifest import runtime_config
    from ortforge.session import SessionSettings

    folder = tmp_path / "int4"
    folder.mkdir()
    assert provenance.settings_used(folder) == "onnxruntime's defaults (never benched)"
    tuned = SessionSettings(intra_op_threads=1, graph_level="basic").to_dict()
    here = machine.describe()
    elsewhere = {"cpu": "Some Other CPU", "features": ["avx2"]}
    richer = {"cpu": here["cpu"], "features": [*here["features"], "amx_tile", "amx_bf16"]}  # what this CPU lacks
    saying = {
        "here": "tuned by bench (runtime.json)",
        "elsewhere": "defaults (bench tuned it on Some Other CPU)",
        "richer": "defaults (bench tuned it on a CPU with amx_tile+amx_bf16)",
    }
    for tuned_on, said in ((here, saying["here"]), (elsewhere, saying["elsewhere"]), (richer, saying["richer"])):
        runtime_config(folder).write_text(json.dumps({"session": tuned, "machine": tuned_on}), encoding="utf-8")
        assert provenance.settings_used(folder).endswith(said)
        runs_tuned = SessionSettings.for_artifact(folder) == SessionSettings.from_dict(tuned)
        assert runs_tuned == (tuned_on is here)  # the label and the runtime agree


def test_refresh_lists_every_result_file_with_its_state_and_command(capsys):
    from benchmarks import refresh

    assert refresh.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in listed] == list(refresh.COMMANDS)
    assert all(line.endswith(")") and "python benchmarks/" in line for line in listed)


def test_a_stage_whose_code_changed_makes_the_check_name_it(monkeypatch):
    """The figures of a stage DVC would rerun describe what the project no longer builds."""
    monkeypatch.setattr(readme_figures.provenance, "stale_stages", lambda: ["quantize@smollm2-135m-int4"])
    errors = readme_figures.outdated_sources()
    assert any(e.startswith("stage quantize@smollm2-135m-int4 changed since dvc.lock") for e in errors)


def test_a_result_file_written_is_not_a_code_change(tmp_path, monkeypatch):
    """A benchmark that runs while another's result file is uncommitted measured committed code."""
    import subprocess

    from benchmarks import provenance

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "x.py").write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}\n", encoding="utf-8")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "start"], cwd=tmp_path, check=True)
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    assert provenance.code_state()[1] is False
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"a": 1}\n', encoding="utf-8")
    assert provenance.code_state()[1] is False
    (tmp_path / "benchmarks" / "x.py").write_text("x = 2\n", encoding="utf-8")
    assert provenance.code_state()[1] is True

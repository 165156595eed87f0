"""A quiet build: one line per stage (what it wrote, how long it took), problems as they come, and
everything else in logs/build.log, whose path is printed first and named again by a failure."""

from __future__ import annotations

import os

import pytest

from flows.progress import LOG, StageLines
from tests.conftest import set_param
from tests.test_faults import built_clone, ortforge  # noqa: F401  (built_clone is a fixture)

DVC_OUTPUT = """Running stage 'quantize@tiny-int4':
> python -m tasks.quantize --model tiny --variant int4
2026-12-01 10:00:00 onnxruntime.quantization INFO quantizing /model/layers.0/mlp/down_proj/MatMul
2026-12-01 10:00:01 __main__ INFO quantize: int4 has 12 MatMulNBits, 1.2 MB
Updating lock file 'dvc.lock'
Running stage 'validate@tiny-int4':
error: validate: int4 failed ppl_ratio 1.9 > 1.07
"""


def test_one_line_per_stage_with_its_own_message_and_problems_as_they_come():
    said = []
    stages = StageLines(said.append)
    for line in DVC_OUTPUT.splitlines():
        stages.line(line)
    stages.finish()
    assert [line.rsplit(" (", 1)[0] for line in said] == [
        "quantize@tiny-int4: quantize: int4 has 12 MatMulNBits, 1.2 MB",
        "error: validate: int4 failed ppl_ratio 1.9 > 1.07",
        "validate@tiny-int4: failed",
    ]
    assert all(line.endswith(" s)") for line in said if "@" in line.split(":")[0])


def test_a_refused_stage_is_one_line_and_said_to_have_failed():
    said = []
    stages = StageLines(said.append)
    for line in [
        "Running stage 'export@m':",
        "error: export@m needs about 5.6 GB of memory (...); 1.8 GB are available: use a machine with more memory",
        "ERROR: failed to reproduce 'export@m': failed to run: python -m tasks.export --model m, exited with 2",
    ]:
        stages.line(line)
    stages.finish()
    assert [line.rsplit(" (", 1)[0] for line in said] == [
        "error: export@m needs about 5.6 GB of memory",
        "export@m: failed",
    ]
    assert stages.failed == ["export@m"]


def test_an_interrupted_stage_is_not_said_to_be_done(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of a stage: its line says interrupted, and the interrupt goes on up."""
    from flows import dvc, progress

    def reproduce(root, targets, *options, echo):
        echo("Running stage 'quantize@m-int4':")
        echo("2026-12-01 10:00:01 __main__ INFO quantize: int4 has 12 MatMulNBits, 1.2 MB")
        raise KeyboardInterrupt

    monkeypatch.setattr(dvc, "planned_stages", lambda root, targets, *options: ["quantize@m-int4"])
    monkeypatch.setattr(dvc, "reproduce", reproduce)
    with pytest.raises(KeyboardInterrupt):
        progress.reproduce_with_progress(tmp_path)
    said = capsys.readouterr().out.splitlines()
    assert [line.rsplit(" (", 1)[0] for line in said[1:]] == ["quantize@m-int4: interrupted"], said


def test_a_stage_killed_by_the_kernel_is_said_to_be_out_of_memory_with_its_estimate():
    said = []
    stages = StageLines(said.append)
    for line in [
        "Running stage 'quantize@m-int4':",
        "2026-12-01 10:00:00 tasks.core.resources INFO preflight: quantize@m-int4 needs about 9.1 GB of memory "
        "and 0.8 GB of disk (one weight at a time); 6.0 GB of memory and 40.0 GB of disk are available",
        "ERROR: failed to reproduce 'quantize@m-int4': failed to run: python -m tasks.quantize, exited with -9",
    ]:
        stages.line(line)
    assert said == [
        "error: quantize@m-int4 was killed (SIGKILL), most likely by the kernel's out-of-memory killer: its "
        "estimate was about 9.1 GB of memory, with 6.0 GB available at its start"
    ]


@pytest.mark.e2e
def test_build_prints_a_screen_and_logs_the_rest(built_clone):  # noqa: F811
    set_param(built_clone, ["quantize", "int4", "block_size"], 16)  # int4's quantize, validate, bench, report
    # As `.venv/bin/ortforge build` from a shell that never activated the venv: the stages' `python`
    # must still be the venv's.
    unactivated = {**os.environ, "PATH": os.defpath, "VIRTUAL_ENV": ""}
    result = ortforge(built_clone, "build", env=unactivated)
    assert result.returncode == 0, result.stderr[-2000:]
    # Not a terminal here, so no progress bar redraws either: only the lines a log reader needs.
    lines = [line for line in (result.stdout + result.stderr).replace("\r", "\n").splitlines() if line.strip()]
    assert lines[0] == f"full log: {built_clone / LOG}"
    for stage in ("quantize@tiny-int4", "validate@tiny-int4", "bench@tiny-int4", "report@tiny"):
        assert any(line.startswith(f"{stage}: ") for line in lines), (stage, lines)
    assert len(lines) <= 8, "\n".join(lines)  # the four stages, the log's path and the count
    log = (built_clone / LOG).read_text()
    assert "Running stage 'quantize@tiny-int4'" in log and len(log.splitlines()) > 2 * len(lines)


@pytest.mark.e2e
def test_a_failed_build_names_its_log(built_clone):  # noqa: F811
    set_param(built_clone, ["validate", "thresholds", "int4", "kl_divergence"], 1e-9)
    result = ortforge(built_clone, "build")
    assert result.returncode == 2
    assert "error: variant int4 failed validation: kl_divergence[GPL-3.txt]" in result.stderr  # as it came
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"error: the build stopped at validate@tiny-int4 (full log: {built_clone / LOG})"
    said = (result.stdout + result.stderr).replace("\r", "\n").splitlines()
    print("\n".join(said))
    assert sum("failed validation" in line for line in said) == 1, said  # the stage's line, not DVC's echo too
    assert not any(line.startswith(("ERROR:", "validate@tiny-int4: done")) for line in said), said

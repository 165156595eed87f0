"""Before heavy work, a stage checks free disk and memory against an estimate from its input's size,
and stops with one line instead of dying halfway."""

from __future__ import annotations

from collections import namedtuple

import pytest

from tasks import export
from tasks.core import resources
from tests.conftest import tiny_params, write_params

DiskUsage = namedtuple("DiskUsage", "total used free")
Memory = namedtuple("Memory", "total available")


@pytest.fixture
def stage_dir(built, tmp_path, monkeypatch):
    write_params(tmp_path, tiny_params(built["hf"]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(resources.SKIP_ENV, raising=False)
    return tmp_path


def run_export(built, out):
    return export.main(["--model", "tiny", "--hf", str(built["hf"]), "--out", str(out)])


def test_stage_stops_when_disk_is_short(built, stage_dir, monkeypatch, capsys):
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12, 1000))
    assert run_export(built, stage_dir / "out" / "onnx") == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: export needs about") and "free disk space, or set" in error
    # The tiny model's figures in units that show them (KB/MB), not "0.0 GB"; 1000 bytes free is 1.0 KB.
    assert "0.0 GB" not in error and "1.0 KB free" in error and " MB" in error
    assert not (stage_dir / "out").exists()


def test_stage_stops_when_memory_is_short(built, stage_dir, monkeypatch, capsys):
    monkeypatch.setattr(resources.psutil, "virtual_memory", lambda: Memory(10**10, 1000))
    assert run_export(built, stage_dir / "out" / "onnx") == 2
    error = capsys.readouterr().err
    assert "MB of memory" in error and "1.0 KB available" in error
    assert not (stage_dir / "out").exists()


def test_estimate_scales_with_input_and_can_be_overridden(built, stage_dir, monkeypatch):
    size = resources.input_bytes(built["hf"])
    needs = resources.STAGE_NEEDS["export"]
    free = int(needs.disk * size * 0.9)  # just short of the estimate
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda path: DiskUsage(10**12, 0, free))
    with pytest.raises(resources.StageError, match="export needs about"):
        resources.check_room("export", needs, built["hf"], stage_dir / "onnx")
    monkeypatch.setenv(resources.SKIP_ENV, "1")
    resources.check_room("export", needs, built["hf"], stage_dir / "onnx")


def test_every_heavy_stage_has_an_estimate():
    from tasks.core.versions import STAGES

    # download checks its source itself (its input is a params entry); report reads small JSON.
    assert set(resources.STAGE_NEEDS) == set(STAGES) - {"download", "report"}


@pytest.mark.parametrize(
    "size, shown", [(0, "0 bytes"), (999, "999 bytes"), (2500, "2.5 KB"), (3.2e8, "320.0 MB"), (4.5e9, "4.5 GB")]
)
def test_amount_picks_the_unit_that_shows_the_number(size, shown):
    assert resources.amount(size) == shown

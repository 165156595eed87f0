"""Before heavy work, a stage checks free disk and memory against its own estimate, made from the
model's shape as its checkpoint header says (tasks/core/resources.py), and stops with one line
instead of dying halfway; available memory counts a cgroup's limit; and the estimates grow with
one layer and the vocabulary, not with the model, where the stage streams."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest

from tasks import export, quantize
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
    assert error.startswith("error: export@tiny needs about") and "free disk space, or set" in error
    assert len(error.splitlines()) == 1
    # The tiny model's figures in units that show them (KB/MB), not "0.0 GB"; 1000 bytes free is 1.0 KB.
    assert "0.0 GB" not in error and "1.0 KB free" in error and " MB" in error
    assert not (stage_dir / "out").exists()


def test_stage_stops_when_memory_is_short_naming_the_stage_estimate_and_what_is_available(
    built, stage_dir, monkeypatch, capsys
):
    monkeypatch.setattr(resources.psutil, "virtual_memory", lambda: Memory(10**10, 1000))
    monkeypatch.setattr(resources, "resident_memory", lambda: 0)  # the test process's own RSS aside
    assert run_export(built, stage_dir / "out" / "onnx") == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: export@tiny needs about") and "MB of memory (" in error
    assert "1.0 KB are available" in error and len(error.splitlines()) == 1
    assert not (stage_dir / "out").exists()


def test_the_check_can_be_skipped_by_a_user_who_knows_better(built, stage_dir, monkeypatch):
    needs = resources.Needs(memory=10**15, disk=0, basis="a test")
    with pytest.raises(resources.StageError, match="export@tiny needs about 1000000.0 GB of memory"):
        resources.check("export@tiny", needs, stage_dir / "onnx")
    monkeypatch.setenv(resources.SKIP_ENV, "1")
    resources.check("export@tiny", needs, stage_dir / "onnx")


def test_every_heavy_stage_declares_an_estimate():
    from tasks import bench, download, optimize, reference, validate

    for module in (export, optimize, reference, quantize, validate, bench):
        assert callable(module.needs), module.__name__
    assert callable(download.gguf_needs) and callable(download.folder_needs)  # its source decides which


def test_model_size_reads_the_checkpoint_header(built):
    size = resources.ModelSize.of(built["hf"])
    config = json.loads((built["hf"] / "config.json").read_text())
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    assert size.vocab_rows == vocab and size.vocabulary == 4 * vocab * hidden  # tied: the embedding only
    assert size.largest == 4 * vocab * hidden
    assert size.total == size.vocabulary + layers * size.layer + 4 * hidden  # + the final norm


def scaled(size: resources.ModelSize, layers: int) -> resources.ModelSize:
    """The same model with `layers` decoder layers."""
    per_layer = size.layer
    return resources.ModelSize(
        total=size.vocabulary + layers * per_layer,
        layer=per_layer,
        vocabulary=size.vocabulary,
        largest=size.largest,
        vocab_rows=size.vocab_rows,
        stored=size.stored,
    )


def test_streamed_estimates_grow_with_a_layer_not_with_the_model():
    from tasks.reference import torch_needs

    # Llama 3.2 1B's shape: a 1.05 GB float32 vocabulary matrix, 0.24 GB layers.
    shape = resources.ModelSize(0, 243_000_000, 1_050_000_000, 1_050_000_000, 128256, 0)
    small, deep = scaled(shape, 16), scaled(shape, 160)
    assert deep.total > 8 * small.total
    assert torch_needs(small, 512).memory == torch_needs(deep, 512).memory


def test_available_memory_takes_the_cgroup_limit(monkeypatch, tmp_path):
    root = tmp_path / "memory"
    (root / "job").mkdir(parents=True)
    (root / "job" / "memory.limit_in_bytes").write_text("4000000000\n")
    (root / "job" / "memory.usage_in_bytes").write_text("1500000000\n")
    (root / "job" / "memory.stat").write_text("cache 600000000\ntotal_inactive_file 500000000\n")
    monkeypatch.setattr(resources.psutil, "virtual_memory", lambda: Memory(10**11, 20 * 10**9))
    cgroup = resources._cgroup_reading(
        root / "job", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
    )
    assert cgroup == (4_000_000_000, 1_000_000_000)  # page cache the cgroup can reclaim is not in use
    monkeypatch.setattr(resources, "_cgroup_limits", lambda: [cgroup])
    assert resources.available_memory() == 3_000_000_000
    unlimited = root / "unlimited"
    unlimited.mkdir()
    (unlimited / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (unlimited / "memory.usage_in_bytes").write_text("1\n")
    assert resources._cgroup_reading(unlimited, "memory.limit_in_bytes", "memory.usage_in_bytes", "x") is None


@pytest.mark.parametrize(
    "size, shown", [(0, "0 bytes"), (999, "999 bytes"), (2500, "2.5 KB"), (3.2e8, "320.0 MB"), (4.5e9, "4.5 GB")]
)
def test_amount_picks_the_unit_that_shows_the_number(size, shown):
    assert resources.amount(size) == shown

"""onnx_io: graphs past the protobuf limit go to external data inside the artifact folder, and external
data that points outside the folder is refused by the stages and by the runtime."""

from __future__ import annotations

import shutil

import onnx
import pytest

from ortforge import TextGenerator
from ortforge.session import create_session
from tasks.core.errors import StageError
from tasks.graphs import onnx_io


def test_save_uses_external_data_for_large_graphs(built, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_ABOVE_BYTES", 0)  # treat the tiny graph as large
    folder = tmp_path / "big"
    folder.mkdir()
    onnx_io.save(onnx_io.load(built["fp32"]), folder)
    data = folder / "model.onnx.data"
    assert data.stat().st_size > (folder / "model.onnx").stat().st_size
    for name in ("tokenizer.json", "generation_config.json"):
        (folder / name).write_bytes((built["fp32"] / name).read_bytes())
    assert TextGenerator(folder).generate("the", 3) == TextGenerator(built["fp32"]).generate("the", 3)


def test_save_keeps_small_graphs_in_one_file(built, tmp_path):
    onnx_io.save(onnx_io.load(built["fp32"]), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def weights_pointing_to(built, tmp_path, location: str):
    """A copy of the fp32 variant whose largest initializer is read from location (external data)."""
    folder = tmp_path / "variant"
    shutil.copytree(built["fp32"], folder)
    model = onnx.load(str(folder / "model.onnx"))
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    (tmp_path / "outside.bin").write_bytes(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (
        ("location", location),
        ("offset", "0"),
        ("length", str((tmp_path / "outside.bin").stat().st_size)),
    ):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    return folder


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_external_data_outside_the_model_folder_is_refused(built, tmp_path, where):
    location = "../outside.bin" if where == "parent" else str(tmp_path / "outside.bin")
    folder = weights_pointing_to(built, tmp_path, location)
    with pytest.raises(ValueError, match="points its weights outside .*refusing to load it"):
        create_session(folder)
    with pytest.raises(StageError, match="refusing its external data"):
        onnx_io.load(folder)

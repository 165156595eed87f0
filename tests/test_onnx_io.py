"""onnx_io: graphs past the protobuf limit go to external data inside the artifact folder."""

from __future__ import annotations

from ortforge import TextGenerator
from tasks import onnx_io


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

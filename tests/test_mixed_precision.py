"""Mixed precision chosen by measurement: parts are ranked by their measured KL divergence per extra
megabyte, raised to 8 bits within the size budget, recorded, and validated as asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortforge.manifest import read_manifest
from tasks import quantize, validate
from tasks.core.files import folder_bytes
from tasks.core.params import CalibrationConfig
from tasks.core.stage import StageError
from tasks.graphs import onnx_io
from tasks.quantization import coverage
from tasks.quantization.configs import QuantizeConfig, quantize_config
from tests.conftest import REPO

CALIBRATION = CalibrationConfig(text=REPO / "data/calibration/python-docs.txt", samples=2, tokens=32)


def budgeted(mb: float) -> QuantizeConfig:
    return quantize_config(method="weight_only", algorithm="rtn", zero_point="float", output_bits=4, size_budget_mb=mb)


def test_parts_raised_to_eight_bits_by_measured_damage_within_the_budget(built, tmp_path):
    all_four = quantize.run(budgeted(10.0), built["optimized"], built["hf"], tmp_path / "roomy", {}, CALIBRATION)
    roomy = read_manifest(all_four.out_dir)["mixed_precision"]
    assert set(roomy["eight_bit"]) == {"output", "0", "1"}  # everything fits in 10 MB
    floor, everything = roomy["floor_mb"], roomy["estimated_mb"]
    budget = (floor + everything) / 2  # room for some parts, not all
    result = quantize.run(budgeted(budget), built["optimized"], built["hf"], tmp_path / "tight", {}, CALIBRATION)
    manifest = read_manifest(result.out_dir)
    table = manifest["mixed_precision"]
    assert 0 < len(table["eight_bit"]) < 3 and table["estimated_mb"] <= budget
    ratio = {row["part"]: row["kl_at_4_bits"] / row["extra_mb_at_8_bits"] for row in table["parts"]}
    assert min(ratio[part] for part in table["eight_bit"]) >= max(
        ratio[part] for part in ratio if part not in table["eight_bit"]
    )  # the best damage per megabyte went first
    assert folder_bytes(result.out_dir, "model.onnx*") / 1e6 <= budget * 1.05
    found = coverage.weights(onnx_io.load(result.out_dir, with_weights=False))
    for recipe, built_variant in ((budgeted(10.0), all_four), (budgeted(budget), result)):
        checked = validate.measure_coverage(built_variant.out_dir, recipe)  # the widths each budget chose
        assert (checked["share_as_asked"], checked["not_as_asked"]) == (1.0, [])
    eight = {w.layer for w in found if w.role == "linear" and w.bits == 8}
    assert eight == {int(part) for part in table["eight_bit"] if part != "output"}


def test_a_budget_below_the_lowest_widths_is_refused_before_measuring(built, tmp_path):
    with pytest.raises(StageError, match="even at its lowest widths the variant would take about"):
        quantize.run(budgeted(0.01), built["optimized"], built["hf"], tmp_path / "v", {}, CALIBRATION)
    assert not (tmp_path / "v").exists()


def test_measuring_keeps_one_candidate_on_disk_at_a_time(built, tmp_path, monkeypatch):
    """Each part's candidate is a whole model: kept until the end they took parts x model of disk."""
    from tasks.quantization import mixed_precision

    on_disk, decoder = [], mixed_precision._decoder

    def counting(folder, *args):
        on_disk.append(len(list(Path(folder).parent.glob("part-*"))))
        return decoder(folder, *args)

    monkeypatch.setattr(mixed_precision, "_decoder", counting)
    quantize.run(budgeted(10.0), built["optimized"], built["hf"], tmp_path / "v", {}, CALIBRATION)
    assert len(on_disk) > 3 and max(on_disk) == 1

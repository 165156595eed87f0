"""Quantize the optimized graph into one self-contained variant folder.

Reads artifacts/<model>/optimized and artifacts/<model>/hf (tokenizer, configs, source record);
writes artifacts/<model>/variants/<variant>: model.onnx, tokenizer, configs and manifest.json
(source, params, tool versions, sha256 of every file).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from ortforge import names
from ortforge.manifest import write_manifest
from tasks import onnx_io, paths
from tasks.files import atomic_output_dir, folder_bytes, megabytes, read_json
from tasks.params import QuantizeConfig
from tasks.stage import StageError, stage_cli
from tasks.versions import lineage_versions

log = logging.getLogger(__name__)

COPIED_FROM_HF = (*names.TOKENIZER_FILES, names.GENERATION_CONFIG_FILE, names.MODEL_CONFIG_FILE)


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    method: str
    size_mb: float


def quantize_graph(cfg: QuantizeConfig, model_dir: Path):
    """The ModelProto of the variant that cfg describes."""
    if cfg.method == "fp32":
        return onnx_io.load(model_dir)
    if cfg.method == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        # Keeping float32 inputs and outputs lets the same runtime drive every variant.
        return convert_float_to_float16(onnx_io.load(model_dir), keep_io_types=True)
    if cfg.method == "int8_dynamic":
        return _int8_dynamic(cfg, model_dir)
    return _int4(cfg, model_dir)


def _int8_dynamic(cfg: QuantizeConfig, model_dir: Path):
    import tempfile

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / names.MODEL_FILE
        quantize_dynamic(
            model_dir / names.MODEL_FILE,
            out,
            weight_type=QuantType[cfg.weight_type],
            per_channel=cfg.per_channel,
            reduce_range=cfg.reduce_range,
            # The transformer optimizer's graph lacks some type info the quantizer needs.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            use_external_data_format=True,
        )
        return onnx.load(str(out))


def _int4(cfg: QuantizeConfig, model_dir: Path):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx_io.load(model_dir),
        bits=4,
        block_size=cfg.block_size,
        is_symmetric=cfg.symmetric,
        accuracy_level=cfg.accuracy_level,
    )
    quantizer.process()
    return quantizer.model.model


def run(cfg: QuantizeConfig, model_dir: Path, hf_dir: Path, out_dir: Path, record: dict) -> QuantizeResult:
    """Write the variant; record (model, variant, tool versions) goes into its manifest."""
    if not (model_dir / names.MODEL_FILE).is_file():
        raise StageError(f"{model_dir} has no {names.MODEL_FILE}; run the optimize stage first")
    log.info("quantizing %s with %s", model_dir, cfg.model_dump(exclude_defaults=True))
    graph = quantize_graph(cfg, model_dir)
    with atomic_output_dir(out_dir) as tmp:
        onnx_io.save(graph, tmp)
        for name in COPIED_FROM_HF:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / name)
        source = read_json(hf_dir / paths.SOURCE_FILE)
        source.pop("files", None)
        write_manifest(tmp, {**record, "source": source, "params": cfg.model_dump()})
    size = folder_bytes(out_dir, names.MODEL_FILE + "*")
    log.info("wrote %s (model %.1f MB)", out_dir, size / 1e6)
    return QuantizeResult(out_dir, cfg.method, megabytes(size))


def main(argv: list[str] | None = None) -> int:
    flags = {"optimized": paths.optimized_dir, "hf": paths.hf_dir, "out": paths.variant_dir}

    def body(a):
        record = {"model": a.model, "variant": a.variant, "tool_versions": lineage_versions(a.pins_file)}
        run(a.params.variant(a.variant), a.paths["optimized"], a.paths["hf"], a.paths["out"], record)

    return stage_cli("quantize", __doc__, flags, body, argv, variant=True)


if __name__ == "__main__":
    raise SystemExit(main())

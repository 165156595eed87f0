"""Quantize the optimized graph into one self-contained variant folder.

Reads artifacts/<model>/optimized and artifacts/<model>/hf (tokenizer, configs, source record);
writes artifacts/<model>/variants/<variant>: model.onnx, tokenizer, configs and manifest.json
(source, params, tool versions, sha256 of every file).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortforge import names
from ortforge.manifest import write_manifest
from tasks import calibration, onnx_io, paths, smoothing, weight_only
from tasks.files import atomic_output_dir, folder_bytes, megabytes, read_json
from tasks.params import CalibrationConfig, QuantizeConfig
from tasks.stage import StageError, stage_cli
from tasks.versions import lineage_versions

log = logging.getLogger(__name__)

COPIED_FROM_HF = (*names.TOKENIZER_FILES, names.GENERATION_CONFIG_FILE, names.MODEL_CONFIG_FILE)


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    method: str
    size_mb: float


def quantize_graph(cfg: QuantizeConfig, model_dir: Path, calibration: Calibration | None = None):
    """The ModelProto of the variant that cfg describes."""
    if cfg.method == "fp32":
        return onnx_io.load(model_dir)
    if cfg.method == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        # Keeping float32 inputs and outputs lets the same runtime drive every variant.
        return convert_float_to_float16(onnx_io.load(model_dir), keep_io_types=True)
    if cfg.method == "weight_only":
        return _weight_only(cfg, model_dir, calibration)
    return _onnxruntime_int8(cfg, model_dir, calibration)


@dataclass(frozen=True)
class Calibration:
    """What data-aware methods calibrate on: the text settings, the tokenizer that reads them, and
    the head size of the KV cache the prefill feeds start empty."""

    cfg: CalibrationConfig
    tokenizer_json: Path
    head_dim: int

    def chunks(self):
        return calibration.token_chunks(self.cfg, self.tokenizer_json)


def _weight_only(cfg: QuantizeConfig, model_dir: Path, calib: Calibration | None):
    model = onnx_io.load(model_dir)
    inputs = weight_only.calibrated_inputs(model, cfg)
    hessians = calibration.input_hessians(model, inputs, calib.chunks(), calib.head_dim) if inputs else {}
    return weight_only.quantize_model(model, cfg, hessians)


def _onnxruntime_int8(cfg: QuantizeConfig, model_dir: Path, calib: Calibration | None):
    """onnxruntime's own int8 recipes: quantize_dynamic, or quantize_static (QDQ) with calibration."""
    import tempfile

    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    # The transformer optimizer's graph lacks some type info the quantizers need.
    options = {"DefaultTensorType": onnx.TensorProto.FLOAT}
    graph = onnx_io.load(model_dir, with_weights=False)
    keep = [n.name for n in graph.graph.node if n.op_type == "MatMul" and any(p in n.name for p in cfg.keep_float)]
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / names.MODEL_FILE
        source = model_dir / names.MODEL_FILE
        if cfg.smooth_alpha is not None or cfg.outlier_ratio is not None:
            source, outliers = _prepared_for_int8(cfg, model_dir, calib, Path(scratch) / "prepared")
            keep += outliers
        if cfg.method == "int8_dynamic":
            quantize_dynamic(
                source,
                out,
                weight_type=QuantType[cfg.weight_type],
                per_channel=cfg.per_channel,
                reduce_range=cfg.reduce_range,
                nodes_to_exclude=keep,
                extra_options=options,
                use_external_data_format=True,
            )
        else:
            quantize_static(
                source,
                out,
                calibration.data_reader(graph, calib.chunks(), calib.head_dim),
                quant_format=QuantFormat.QDQ,
                per_channel=cfg.per_channel,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"],
                nodes_to_exclude=keep,
                calibrate_method={
                    "minmax": CalibrationMethod.MinMax,
                    "entropy": CalibrationMethod.Entropy,
                    "percentile": CalibrationMethod.Percentile,
                }[cfg.calibrate],
                extra_options=options,
                use_external_data_format=True,
            )
        return onnx.load(str(out))


def _prepared_for_int8(cfg: QuantizeConfig, model_dir: Path, calib: Calibration, folder: Path):
    """The float model, SmoothQuant-rescaled when asked (same function, evened-out input ranges),
    and the MatMuls whose inputs carry outlier tokens: per-tensor int8 cannot hold them."""
    model = onnx_io.load(model_dir)
    weights = {t.name for t in model.graph.initializer}
    linear = {n.name: n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
    ranges = calibration.activation_ranges(model, sorted(set(linear.values())), calib.chunks(), calib.head_dim)
    outliers = []
    if cfg.outlier_ratio is not None:
        outliers = sorted(node for node, x in linear.items() if ranges[x].outlier_ratio > cfg.outlier_ratio)
        log.info("kept float for outlier tokens (ratio > %g): %s", cfg.outlier_ratio, outliers)
    if cfg.smooth_alpha is not None:
        maxima = {x: r.channel_max for x, r in ranges.items()}
        if smoothing.smooth(model, maxima, cfg.smooth_alpha) == 0:
            raise StageError(f"{model_dir}: no MatMul input found that SmoothQuant can rescale; remove smooth_alpha")
    folder.mkdir()
    return onnx_io.save(model, folder, external_data=True), outliers


def add_logits_to_keep(graph) -> None:
    """Give the graph an input logits_to_keep (0: all positions, 1: the last) that slices the hidden
    states before the output layer, so a generation prefill computes one row of logits.

    A required input, not one with a default: onnxruntime treats an input that also has an
    initializer as a constant it may fold away, and then nobody can set it."""
    import onnx
    from onnx import TensorProto, helper

    inputs = {i.name for i in graph.graph.input}
    head = next((n for n in graph.graph.node if n.output[0] == names.LOGITS), None)
    if head is None or names.LOGITS_TO_KEEP in inputs:
        return
    hidden, stem = head.input[0], "/logits_to_keep"
    constants = {
        stem + "/ends": np.array([np.iinfo(np.int64).max], dtype=np.int64),
        stem + "/axes": np.array([1], dtype=np.int64),
    }
    graph.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in constants.items())
    graph.graph.input.append(helper.make_tensor_value_info(names.LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    graph.graph.node.extend(
        [
            helper.make_node("Neg", [names.LOGITS_TO_KEEP], [stem + "/starts"], name=stem + "/Neg"),
            helper.make_node(
                "Slice", [hidden, stem + "/starts", stem + "/ends", stem + "/axes"], [stem + "/hidden"], name=stem
            ),
        ]
    )
    head.input[0] = stem + "/hidden"
    from onnxruntime.transformers.onnx_model import OnnxModel

    OnnxModel(graph).topological_sort()


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def tag_for_runtime(graph, config: dict) -> None:
    """Record in the model's metadata what the runtime needs and the graph does not say: the head
    size (genai graphs leave it symbolic) and whether the KV cache is updated in place."""
    import onnx

    shared = any(node.op_type == "GroupQueryAttention" for node in graph.graph.node)
    props = {p.key: p.value for p in graph.metadata_props}
    layout = names.KV_SHARED if shared else "chained"
    props |= {names.KV_LAYOUT_KEY: layout, names.HEAD_DIM_KEY: str(head_dim_of(config))}
    onnx.helper.set_model_props(graph, props)


def run(
    cfg: QuantizeConfig,
    model_dir: Path,
    hf_dir: Path,
    out_dir: Path,
    record: dict,
    calibration_cfg: CalibrationConfig | None = None,
) -> QuantizeResult:
    """Write the variant; record (model, variant, tool versions) goes into its manifest."""
    if not (model_dir / names.MODEL_FILE).is_file():
        raise StageError(f"{model_dir} has no {names.MODEL_FILE}; run the optimize stage first")
    config = json.loads((hf_dir / names.MODEL_CONFIG_FILE).read_text(encoding="utf-8"))
    calib = Calibration(calibration_cfg or CalibrationConfig(), hf_dir / "tokenizer.json", head_dim_of(config))
    if cfg.needs_calibration:
        calib.chunks()  # a missing or short text fails here, before the slow part
    log.info("quantizing %s with %s", model_dir, cfg.model_dump(exclude_defaults=True))
    graph = quantize_graph(cfg, model_dir, calib)
    add_logits_to_keep(graph)
    tag_for_runtime(graph, config)
    with atomic_output_dir(out_dir) as tmp:
        onnx_io.save(graph, tmp, external_data=True)  # a published variant loads with a lower peak
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
        run(
            a.params.variant(a.variant),
            a.paths["optimized"],
            a.paths["hf"],
            a.paths["out"],
            record,
            a.params.calibration,
        )

    return stage_cli("quantize", __doc__, flags, body, argv, variant=True)


if __name__ == "__main__":
    raise SystemExit(main())

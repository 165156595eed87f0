"""Quantize the optimized graph into one self-contained variant folder.

Reads artifacts/<model>/optimized and artifacts/<model>/hf (tokenizer, configs, source record);
writes artifacts/<model>/variants/<variant>: model.onnx, tokenizer, configs and manifest.json
(source, params, tool versions, sha256 of every file).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortforge import names
from ortforge.manifest import write_manifest
from tasks.core import paths, resources
from tasks.core.files import atomic_output_dir, folder_bytes, megabytes, read_json, scratch_dir
from tasks.core.params import CalibrationConfig
from tasks.core.stage import StageError, stage_cli
from tasks.core.versions import lineage_versions
from tasks.graphs import architecture, decoder_graph, onnx_io
from tasks.graphs.architecture import Architecture
from tasks.graphs.weights import DATA_SUFFIX, ExternalData, WeightStore, copy_into, fold_chains, prune
from tasks.quantization import (
    attention,
    calibration,
    coverage,
    kv_cache,
    layers,
    mixed_precision,
    per_token,
    smoothing,
    torch_statistics,
    weight_only,
)
from tasks.quantization.calibration import MAXIMUM
from tasks.quantization.configs import QuantizeConfig, needs_calibration
from tasks.quantization.writer import GraphWriter, write_float_linears

log = logging.getLogger(__name__)

COPIED_FROM_HF = (*names.TOKENIZER_FILES, names.GENERATION_CONFIG_FILE, names.MODEL_CONFIG_FILE)


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    method: str
    size_mb: float


@dataclass(frozen=True)
class Quantized:
    graph: object  # the variant's ModelProto
    notes: list[str] = field(default_factory=list)  # where a layer could not take the asked setting
    kept_float: dict[str, str] = field(default_factory=dict)  # node -> why its params keep it float
    cfg: QuantizeConfig | None = None  # the settings applied, where measurement chose some of them
    mixed_precision: dict | None = None  # the measurements behind that choice


def quantize_graph(cfg: QuantizeConfig, model_dir: Path, hf_dir: Path, calib: Calibration, out: Path) -> Quantized:
    """The variant that cfg describes; its weights are written into out (model.onnx.data) as they
    are made. fp32, weight-only and per-token int8 recipes read one float tensor at a time;
    onnxruntime's int8 recipes, fp16 and a measured size budget work on the whole float model in
    memory."""
    data = ExternalData(out, names.MODEL_FILE + DATA_SUFFIX)
    if cfg.method == "fp32":
        return Quantized(float_graph(model_dir, data))
    if cfg.method == "weight_only" and cfg.size_budget_mb is None:
        return _weight_only(cfg, model_dir, hf_dir, calib, data)
    if cfg.method == "int8_per_token":
        return _per_token(cfg, model_dir, hf_dir, calib, data)
    with scratch_dir(out) as float_dir:  # the float graph as plain float32 initializers, for tools that load it
        onnx_io.save_graph_only(float_graph(model_dir, ExternalData(float_dir, data.location)), float_dir)
        quantized = _whole_model(cfg, float_dir, calib)
    copy_into(quantized.graph, WeightStore(quantized.graph, None), data)
    return quantized


def float_graph(model_dir: Path, data: ExternalData):
    """The graph in model_dir with every weight as a float32 initializer in data (Cast/Transpose
    chains from the checkpoint's tensors folded), read and written one tensor, or one group of
    sibling linears, at a time.

    An attention's q, k and v projections become one MatMul and a Split, as onnxruntime-genai's
    builder writes them: one call instead of three, and onnxruntime's int8 quantizers see the
    graph they were measured on (its per-tensor scales span what one MatMul reads: apart, and with
    gate and up packed too, quantize_dynamic's cached-decode gap on SmolLM2 moved from 0.50 to 0.72
    and 0.79)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    graph = onnx_io.load(model_dir, with_weights=False)
    store = WeightStore(graph, model_dir)
    linears = [linear for linear in layers.linear_layers(graph) if linear.node.op_type == "MatMul"]
    writer = GraphWriter(graph, data)
    for group in layers.sibling_groups(linears, dict.fromkeys((lin.node.name for lin in linears), 0)):
        if len(group) > 1 and layers.feed_one_attention(graph, group):
            write_float_linears(writer, store, group)
    prune(graph)  # the separate weights (and the nodes reading them) before anything folds them
    fold_chains(graph, store, data)
    copy_into(graph, store, data)
    OnnxModel(graph).topological_sort()
    return graph


def _whole_model(cfg: QuantizeConfig, float_dir: Path, calib: Calibration) -> Quantized:
    if cfg.method == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        # Keeping float32 inputs and outputs lets the same runtime drive every variant.
        return Quantized(convert_float_to_float16(onnx_io.load(float_dir), keep_io_types=True))
    if cfg.method == "weight_only":
        return _measured_mixed_precision(cfg, float_dir, calib)
    return _onnxruntime_int8(cfg, float_dir, calib)


@dataclass(frozen=True)
class Calibration:
    """What data-aware methods calibrate on: the text settings, the tokenizer that reads them, and
    the head size of the KV cache the prefill feeds start empty."""

    cfg: CalibrationConfig
    tokenizer_json: Path
    head_dim: int

    def chunks(self):
        return calibration.token_chunks(self.cfg, self.tokenizer_json)


def statistics(model, wanted: dict[str, str], model_dir: Path, hf_dir: Path, calib: Calibration) -> dict:
    """The calibration statistics the recipe needs: from the PyTorch model, layer by layer, when
    the graph's weights are the checkpoint's (named after its modules); else from onnxruntime."""
    if not wanted:
        return {}
    metadata = {p.key: p.value for p in model.metadata_props}
    if metadata.get(names.WEIGHTS_SOURCE_KEY) == decoder_graph.WEIGHTS_FROM_CHECKPOINT:
        readers = layers.input_readers(model)
        modules = {tensor: decoder_graph.module_of(readers[tensor].name) for tensor in wanted}
        return torch_statistics.checkpoint_statistics(modules, wanted, hf_dir, calib.chunks())
    return calibration.input_hessians(model, wanted, calib.chunks(), calib.head_dim, model_dir)


def _weight_only(cfg: QuantizeConfig, model_dir: Path, hf_dir: Path, calib: Calibration, data: ExternalData):
    model = onnx_io.load(model_dir, with_weights=False)
    store = WeightStore(model, model_dir)
    source = {tensor.name for tensor in model.graph.initializer}
    layers.layer_blocks(layers.linear_layers(model), cfg.block_size)  # refuses a bad K before calibrating
    stats = statistics(model, layers.calibrated_inputs(model, cfg), model_dir, hf_dir, calib)
    graph, notes = weight_only.quantize_model(model, cfg, stats, store=store, data=data)
    fold_chains(graph, store, data, among=source)  # what stays float (norms, biases) as plain float32
    copy_into(graph, store, data)
    return Quantized(graph, notes)


def _per_token(cfg: QuantizeConfig, model_dir: Path, hf_dir: Path, calib: Calibration, data: ExternalData):
    model = onnx_io.load(model_dir, with_weights=False)
    add_logits_to_keep(model)  # before: the output layer must quantize the kept rows, not slice their codes
    store = WeightStore(model, model_dir)
    source = {tensor.name for tensor in model.graph.initializer}
    if cfg.smooth_alpha is not None:
        wanted = dict.fromkeys((group.activation for group in smoothing.smoothable_groups(model)), MAXIMUM)
        maxima = statistics(model, wanted, model_dir, hf_dir, calib)
        store = smoothing.SmoothedStore(store, smoothing.plan(model, maxima, cfg.smooth_alpha, store.array))
        store.settle_inline()
    graph, notes = per_token.quantize_model(model, cfg.output_bits == 32, store, data)
    fold_chains(graph, store, data, among=source)  # what stays float (norms, biases) as plain float32
    copy_into(graph, store, data)
    return Quantized(graph, notes)


def _measured_mixed_precision(cfg: QuantizeConfig, model_dir: Path, calib: Calibration) -> Quantized:
    """weight_only with a size budget: each part's damage measured on the float model in memory."""
    model = onnx_io.load(model_dir)
    linears = layers.linear_layers(model)
    layers.layer_blocks(linears, cfg.block_size)  # refuses a bad K before calibrating
    wanted = layers.calibrated_inputs(model, cfg)
    hessians = calibration.input_hessians(model, wanted, calib.chunks(), calib.head_dim) if wanted else {}
    blocks = 1 + max((linear.layer for linear in linears if linear.layer is not None), default=0)
    measure = mixed_precision.Measure(model, model_dir, calib.chunks(), calib.head_dim, hessians)
    cfg, choice = mixed_precision.choose(measure, cfg, blocks)
    graph, notes = weight_only.quantize_model(model, cfg, hessians)
    return Quantized(graph, notes, cfg=cfg, mixed_precision=choice)


def _onnxruntime_int8(cfg: QuantizeConfig, model_dir: Path, calib: Calibration | None):
    """onnxruntime's own int8 recipes: quantize_dynamic, or quantize_static (QDQ) with calibration."""
    import tempfile

    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    # The transformer optimizer's graph lacks some type info the quantizers need.
    options = {"DefaultTensorType": onnx.TensorProto.FLOAT}
    graph = onnx_io.load(model_dir, with_weights=False)
    kept = {
        n.name: f"matches keep_float `{pattern}`"
        for n in graph.graph.node
        for pattern in cfg.keep_float
        if n.op_type == "MatMul" and pattern in n.name
    }
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / names.MODEL_FILE
        source = model_dir / names.MODEL_FILE
        if cfg.smooth_alpha is not None or cfg.outlier_ratio is not None:
            source, outliers = _prepared_for_int8(cfg, model_dir, calib, Path(scratch) / "prepared")
            kept |= outliers
        keep = sorted(kept)
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
        return Quantized(onnx.load(str(out)), kept_float=kept)


def _prepared_for_int8(cfg: QuantizeConfig, model_dir: Path, calib: Calibration, folder: Path):
    """The float model, SmoothQuant-rescaled when asked (same function, evened-out input ranges),
    and the MatMuls whose inputs carry outlier tokens: per-tensor int8 cannot hold them."""
    model = onnx_io.load(model_dir)
    weights = {t.name for t in model.graph.initializer}
    linear = {n.name: n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
    ranges = calibration.activation_ranges(model, sorted(set(linear.values())), calib.chunks(), calib.head_dim)
    outliers = {}
    if cfg.outlier_ratio is not None:
        outliers = {
            node: f"an input token {ranges[x].outlier_ratio:.0f}x the median token's peak (above {cfg.outlier_ratio:g})"
            for node, x in linear.items()
            if ranges[x].outlier_ratio > cfg.outlier_ratio
        }
        log.info("kept float for outlier tokens (ratio > %g): %s", cfg.outlier_ratio, sorted(outliers))
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
    head = onnx_io.output_matmul(graph)
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


def tag_for_runtime(graph, arch: Architecture, kv_bits: int | None = None) -> None:
    """Record in the model's metadata what the runtime needs and the graph does not say: the head
    size (genai graphs leave it symbolic), whether the KV cache is updated in place (and its bits
    when stored quantized), and how many positions the model takes (past them, rotary tables run
    out or the model was never trained)."""
    import onnx

    shared = any(node.op_type == "GroupQueryAttention" for node in graph.graph.node)
    props = {
        p.key: p.value for p in graph.metadata_props if p.key != names.WEIGHTS_SOURCE_KEY
    }  # a variant holds its own
    props |= {
        names.KV_LAYOUT_KEY: names.KV_SHARED if shared else "chained",
        names.HEAD_DIM_KEY: str(arch.head_dim),
        names.CONTEXT_LENGTH_KEY: str(arch.context_length),
    }
    if kv_bits is not None:
        props[names.KV_CACHE_BITS_KEY] = str(kv_bits)
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
    arch = architecture.read(hf_dir)
    calib = Calibration(calibration_cfg or CalibrationConfig(), hf_dir / "tokenizer.json", arch.head_dim)
    if needs_calibration(cfg):
        calib.chunks()  # a missing or short text fails here, before the slow part
    if cfg.kv_bits is not None:
        kv_cache.check_supported(onnx_io.load(model_dir, with_weights=False), model_dir, cfg.kv_cache)
    if cfg.attention == "ortforge":
        attention.check_supported(onnx_io.load(model_dir, with_weights=False), model_dir, arch.head_dim)
    log.info("quantizing %s with %s", model_dir, cfg.model_dump(exclude_defaults=True))
    with atomic_output_dir(out_dir) as tmp:
        quantized = quantize_graph(cfg, model_dir, hf_dir, calib, tmp)
        graph = quantized.graph
        add_logits_to_keep(graph)
        if cfg.kv_bits is not None:
            kv_cache.quantize(graph, tmp, calib, arch.context_length, arch.head_dim, cfg.kv_bits, cfg.kv_headroom)
        tag_for_runtime(graph, arch, cfg.kv_bits)
        if cfg.attention == "ortforge":
            attention.use_ortforge_kernel(graph)
        stored = coverage.weights(graph)
        for note in quantized.notes:
            log.warning("%s", note)
        onnx_io.save_graph_only(graph, tmp)  # its weights are in model.onnx.data already
        for name in COPIED_FROM_HF:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / name)
        source = read_json(hf_dir / paths.SOURCE_FILE)
        source.pop("files", None)
        write_manifest(
            tmp,
            {
                **record,
                "source": source,
                "params": (quantized.cfg or cfg).recorded(),
                "coverage": coverage.summary(stored),
                **({"mixed_precision": quantized.mixed_precision} if quantized.mixed_precision else {}),
                "kept_float": quantized.kept_float,
                "notes": quantized.notes,
            },
        )
    size = folder_bytes(out_dir, names.MODEL_FILE + "*")
    log.info("wrote %s (model %.1f MB; %s)", out_dir, size / 1e6, coverage.describe(coverage.summary(stored)))
    return QuantizeResult(out_dir, cfg.method, megabytes(size))


def variant_bytes(cfg: QuantizeConfig, size: resources.ModelSize) -> float:
    """About what the variant stores: its weights at the recipe's widths, scales and zero points."""
    bits = {"fp32": 32, "fp16": 16}.get(cfg.method, cfg.bits if cfg.method == "weight_only" else 8)
    return size.total / 4 * bits / 8 * 1.15


def needs(a) -> resources.Needs:
    """Streamed recipes (fp32, weight-only, per-token int8) hold the largest weight a few times
    (float32, its float64 slices, its codes) or, while calibrating, PyTorch with one layer; the
    others hold the whole float model (and write it to a scratch folder first)."""
    cfg, size = a.params.variant(a.variant), resources.ModelSize.of(a.paths["hf"])
    stored = variant_bytes(cfg, size)
    largest = resources.amount(size.largest)
    streamed = cfg.method in ("fp32", "int8_per_token") or (cfg.method == "weight_only" and cfg.size_budget_mb is None)
    if streamed:
        memory = resources.BASE_MEMORY + 3 * size.largest
        basis = f"one weight at a time, the largest {largest} in float32"
        if needs_calibration(cfg):
            from tasks.evaluation.torch_decoder import torch_needs

            memory = max(memory, torch_needs(size, 0).memory)
            basis += ", and calibration through PyTorch"
        if cfg.kv_bits is not None:
            memory += 1.5 * stored
            basis += ", and the variant run to calibrate its KV cache"
        return resources.Needs(memory, stored, basis)
    basis = f"the whole {resources.amount(size.total)} float32 model in memory"
    return resources.Needs(resources.BASE_MEMORY + 4 * size.total, stored + size.total, basis)


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

    return stage_cli("quantize", __doc__, flags, body, argv, variant=True, needs=needs)


if __name__ == "__main__":
    raise SystemExit(main())

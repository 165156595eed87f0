"""Fuse the exported graph with onnxruntime's transformer optimizer, and record what it fused.

Reads artifacts/<model>/onnx; writes artifacts/<model>/optimized (model.onnx) and
reports/<model>/optimize.json (op counts before and after, fused-operator counts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ortforge.names import MODEL_FILE
from tasks.core import paths, resources
from tasks.core.files import atomic_output_dir, atomic_write_json, folder_bytes, link_or_copy, megabytes
from tasks.core.params import OptimizeConfig
from tasks.core.stage import StageError, stage_cli
from tasks.graphs import architecture, onnx_io, rotary
from tasks.graphs.architecture import Architecture
from tasks.graphs.weights import WeightStore, external_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizeResult:
    out_dir: Path
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    fused: dict[str, int]
    size_mb: float
    rotary_computed: list[dict]  # rotary tables the graph now computes at load (tasks/graphs/rotary.py)


def run(cfg: OptimizeConfig, onnx_dir: Path, hf_dir: Path, out_dir: Path) -> OptimizeResult:
    if not (onnx_dir / MODEL_FILE).is_file():
        raise StageError(f"{onnx_dir} has no {MODEL_FILE}; run the export stage first (dvc repro export@<model>)")
    arch = architecture.read(hf_dir)
    exported = onnx_io.load(onnx_dir, with_weights=False)
    ops_before = onnx_io.op_counts(exported)
    started = time.perf_counter()
    if cfg.model_type == "none":
        # The weights stay where they are: the output links the input's data files.
        log.info("keeping %s as exported (model_type none)", onnx_dir)
        graph, fused, weights_dir = exported, {}, onnx_dir
    else:
        graph, fused, weights_dir = *fuse(cfg, onnx_dir, arch), None
    store = WeightStore(graph, weights_dir or onnx_dir)
    trim_rotary_caches(graph, arch.context_length, store)
    computed = rotary.compute_at_load(graph, arch.rope_thetas, store.array)
    with atomic_output_dir(out_dir) as tmp:
        if weights_dir is None:
            onnx_io.save(graph, tmp, external_data=True)
        else:
            for file in external_files(graph):
                link_or_copy(weights_dir / file, tmp / file)
            onnx_io.save_graph_only(graph, tmp)
    ops_after = onnx_io.op_counts(graph)
    log.info("fused %s in %.0f s; wrote %s", fused or "nothing", time.perf_counter() - started, out_dir)
    return OptimizeResult(out_dir, ops_before, ops_after, fused, megabytes(folder_bytes(out_dir)), computed)


def fuse(cfg: OptimizeConfig, onnx_dir: Path, arch: Architecture):
    """onnxruntime's transformer optimizer; returns the graph (weights loaded) and the fused-operator counts."""
    from onnxruntime.transformers.optimizer import optimize_model

    log.info("fusing %s as model_type %s (takes about a minute per 100M parameters)", onnx_dir, cfg.model_type)
    optimized = optimize_model(
        onnx_io.load(onnx_dir),  # onnx's own loader refuses hard-linked weight files
        model_type=cfg.model_type,
        num_heads=arch.num_heads,
        hidden_size=arch.hidden_size,
        opt_level=cfg.opt_level,
    )
    optimized.topological_sort()
    return optimized.model, {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}


def trim_rotary_caches(model, max_positions: int, store: WeightStore) -> None:
    """Cut the fused RotaryEmbedding cos/sin tables to the model's context length.

    The fusion sizes them for 131,072 positions whatever the model supports: 33 MB of dead weight
    for SmolLM2, more than a tenth of an int4 artifact.
    """
    from onnx import numpy_helper

    names = {name for node in model.graph.node if node.op_type == "RotaryEmbedding" for name in node.input[2:4]}
    for tensor in model.graph.initializer:
        if tensor.name in names and tensor.dims[0] > max_positions:
            table = store.array(tensor.name)[:max_positions]
            tensor.CopyFrom(numpy_helper.from_array(table, tensor.name))


def summary(result: OptimizeResult) -> dict:
    return {
        "nodes_before": sum(result.ops_before.values()),
        "nodes_after": sum(result.ops_after.values()),
        "fused": result.fused,
        "rotary_computed": result.rotary_computed,
        "ops_before": result.ops_before,
        "ops_after": result.ops_after,
        "size_mb": result.size_mb,
    }


def needs(a) -> resources.Needs:
    """model_type none links the graph's weights; fusing loads the whole graph several times."""
    size = resources.ModelSize.of(a.paths["hf"])
    if a.params.optimize.model_type == "none":
        return resources.Needs(resources.BASE_MEMORY, 1e6, "the graph alone; its weights are linked")
    basis = f"onnxruntime's optimizer on the whole {resources.amount(size.total)} float32 graph"
    return resources.Needs(resources.BASE_MEMORY + 3 * size.total, 1.1 * size.total, basis)


def main(argv: list[str] | None = None) -> int:
    flags = {"onnx": paths.export_dir, "hf": paths.hf_dir, "out": paths.optimized_dir, "report": paths.optimize_json}

    def body(a):
        result = run(a.params.optimize, a.paths["onnx"], a.paths["hf"], a.paths["out"])
        atomic_write_json(a.paths["report"], summary(result))

    return stage_cli("optimize", __doc__, flags, body, argv, needs=needs)


if __name__ == "__main__":
    raise SystemExit(main())

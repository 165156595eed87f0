"""Mixed precision chosen by measurement: which parts of a 4-bit model keep 8 bits within a size
budget.

Like llama.cpp's Q4_K_M, a 4-bit variant spends more bits where they matter most; unlike its
fixed recipe (attn_v and ffn_down of some layers at Q6_K), the parts are ranked by measuring them
on the model at hand. Each part (the output layer with its tied embedding; each decoder block's
linears) is quantized to 4 bits alone, the rest of the model float, and its mean KL divergence
from the float model on the calibration text is its damage. Parts are raised to 8 bits in order
of damage per extra megabyte while the variant's estimated size stays within size_budget_mb.

Reads the optimized float graph and calibration chunks; returns the QuantizeConfig with
eight_bit_blocks and output_bits chosen, and the measurements (recorded in the manifest).
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortforge import names
from tasks.core.errors import StageError
from tasks.core.params import EvalConfig
from tasks.evaluation import metrics
from tasks.graphs import onnx_io
from tasks.quantization import coverage, layers, weight_only
from tasks.quantization.configs import QuantizeConfig

log = logging.getLogger(__name__)

MB = 1e6
OUTPUT = "output"
# Each calibration chunk is one sequence; the float model's 32 most likely tokens per position
# carry the KL divergence (tasks/evaluation/metrics.py).
MEASURE = EvalConfig(window=512, top_k=32)


def _decoder(folder: Path, head_dim: int, layout: str):
    from ortforge.decoder import Decoder
    from ortforge.session import create_session

    return Decoder(create_session(folder), head_dim=head_dim, layout=layout)


def _layout(model) -> str:
    return names.KV_SHARED if any(n.op_type == "GroupQueryAttention" for n in model.graph.node) else "chained"


@dataclass(frozen=True)
class Measure:
    """What the measurements run on: the float graph (and its folder), calibration chunks, the KV
    head size, and the calibration statistics the chosen algorithms need."""

    model: object
    model_dir: Path
    chunks: list
    head_dim: int
    hessians: dict


def _damage(measure: Measure, cfg: QuantizeConfig, part, reference, scratch: Path) -> tuple[float, int]:
    """(KL from the float model, stored bytes) with only `part` quantized to cfg.bits."""
    candidate = copy.deepcopy(measure.model)
    if part == OUTPUT:
        weight_only.quantize_model(candidate, cfg, measure.hessians, only_blocks=set())
    else:
        float_output = cfg.model_copy(update={"output_bits": 32})
        weight_only.quantize_model(candidate, float_output, measure.hessians, only_blocks={part})
    folder = scratch / f"part-{part}"
    folder.mkdir()
    onnx_io.save(candidate, folder, external_data=True)  # moves the copy's weights to the file
    decoder = _decoder(folder, measure.head_dim, _layout(measure.model))
    kl = np.mean([metrics.compare(decoder, ref, MEASURE, len(ref.ids) - 1)["kl_divergence"] for ref in reference])
    del decoder  # its session maps the candidate's weights: release them before the folder goes
    # One candidate on disk at a time: kept, they took a whole model per part (Gemma 3 270M: 19 GB).
    shutil.rmtree(folder)
    stored = sum(
        w.stored_bytes
        for w in coverage.weights(candidate)
        if (w.role != "linear") == (part == OUTPUT) and (part == OUTPUT or w.layer == part) and w.bits == cfg.bits
    )
    return float(kl), stored


def _references(model_dir: Path, layout: str, chunks, head_dim: int) -> list[metrics.TextReference]:
    decoder = _decoder(model_dir, head_dim, layout)
    empty = np.zeros(0, dtype=np.int64)
    found = []
    for chunk in chunks:
        ids = np.concatenate([chunk, chunk[-1:]])  # every token of the chunk scored (the last one twice)
        scores, _ = metrics.score_reference(decoder, ids, MEASURE, len(ids) - 1)
        found.append(metrics.TextReference(ids=ids, greedy_prompt=empty, greedy_tokens=empty, **scores))
    return found


def bytes_per_weight(bits: int, block: int, zero_point: str) -> float:
    """What one weight costs as the writer stores it: its code, a float16 scale and (unless
    symmetric) a zero point per block; float zero points add a row of offsets per block of K."""
    zero = 0.0 if zero_point == "none" else bits / 8
    rows = 1 + 1 / block if zero_point == "float" else 1.0
    return (bits / 8 + (2 + zero) / block) * rows


def widen(bytes_at_4: int, block: int, zero_point: str) -> int:
    """The bytes a part stored at 4 bits takes at 8."""
    ratio = bytes_per_weight(8, block, zero_point) / bytes_per_weight(4, block, zero_point)
    return int(bytes_at_4 * ratio)


def choose(measure: Measure, cfg: QuantizeConfig, num_layers: int) -> tuple[QuantizeConfig, dict]:
    """cfg with the measured choice of 8-bit parts, and the table behind it."""
    # An output layer asked at 8 bits stays there: only what starts at 4 bits is measured.
    parts: list[object] = [OUTPUT] * (cfg.output_bits == 4) + list(range(num_layers))
    check_floor_fits(measure.model, cfg)
    reference = _references(measure.model_dir, _layout(measure.model), measure.chunks, measure.head_dim)
    with tempfile.TemporaryDirectory(prefix="ortforge-mixed-") as scratch:
        measured = {}
        for index, part in enumerate(parts):
            measured[part] = _damage(measure, cfg, part, reference, Path(scratch))
            log.info("mixed precision: part %s damage KL %.4g (%d/%d)", part, measured[part][0], index + 1, len(parts))
    floor = _floor_bytes(measure.model, cfg, measured)
    rows = [
        {"part": str(part), "kl_at_4_bits": kl, "mb_at_4_bits": size / MB, "extra_mb_at_8_bits": extra / MB}
        for part, (kl, size) in measured.items()
        for extra in [widen(size, cfg.block_size, _zero_point(cfg, part)) - size]
    ]
    total, chosen = floor, []
    for row in sorted(rows, key=lambda r: r["kl_at_4_bits"] / max(r["extra_mb_at_8_bits"], 1e-9), reverse=True):
        if (total + row["extra_mb_at_8_bits"] * MB) / MB <= cfg.size_budget_mb:
            total += row["extra_mb_at_8_bits"] * MB
            chosen.append(row["part"])
    blocks = tuple(sorted(int(part) for part in chosen if part != OUTPUT))
    output_bits = 8 if OUTPUT in chosen else cfg.output_bits
    log.info(
        "mixed precision: 8 bits for %s (about %.0f MB of %g)", chosen or "nothing", total / MB, cfg.size_budget_mb
    )
    table = {"parts": rows, "eight_bit": chosen, "estimated_mb": total / MB, "floor_mb": floor / MB}
    return cfg.model_copy(update={"eight_bit_blocks": blocks, "output_bits": output_bits}), table


def _zero_point(cfg: QuantizeConfig, part) -> str:
    # The vocabulary matrix takes integer zero points: GatherBlockQuantized reads no float ones.
    if part == OUTPUT:
        return "none" if cfg.zero_point == "none" else "integer"
    return cfg.zero_point


def lowest_widths_bytes(model, cfg: QuantizeConfig) -> dict[str, float]:
    """Estimated bytes of every initializer with each quantized matrix at its lowest width (codes,
    a float16 scale and a zero point per block), the rest float."""
    parts = _quantized_names(model)
    head = layers.output_layer(model)
    output = {head.weight_initializer} if head is not None else set()
    sizes = {}
    for tensor in model.graph.initializer:
        count = int(np.prod(tensor.dims))
        if tensor.name not in parts:
            sizes[tensor.name] = count * 4.0
            continue
        bits = 8 if tensor.name in output and cfg.output_bits == 8 else 4
        sizes[tensor.name] = count * bytes_per_weight(
            bits, cfg.block_size, _zero_point(cfg, OUTPUT if tensor.name in output else 0)
        )
    sizes["graph"] = float(model.ByteSize() - sum(t.ByteSize() for t in model.graph.initializer))  # nodes, names
    return sizes


def check_floor_fits(model, cfg: QuantizeConfig) -> None:
    """StageError before any measurement when the variant cannot fit even at its lowest widths."""
    floor = sum(lowest_widths_bytes(model, cfg).values())
    if floor / MB > cfg.size_budget_mb:
        raise StageError(
            f"even at its lowest widths the variant would take about {floor / MB:.0f} MB, over size_budget_mb "
            f"{cfg.size_budget_mb:g}; raise the budget"
        )


def _quantized_names(model) -> set[str]:
    """The initializers a weight-only variant stores as codes: linears, output layer, token embedding."""
    names = {lin.weight_name for lin in layers.linear_layers(model)}
    head, embedding = layers.output_layer(model), layers.token_embedding(model)
    names |= {head.weight_initializer} if head is not None else set()
    names |= {embedding[1].initializer} if embedding is not None else set()
    return names


def _floor_bytes(model, cfg: QuantizeConfig, measured: dict) -> float:
    """The variant's size with every part at its lowest width: the estimate, with the measured
    parts' own stored bytes in place of theirs."""
    estimate = lowest_widths_bytes(model, cfg)
    head = layers.output_layer(model)
    by_part = {OUTPUT: {head.weight_initializer} if head is not None else set()}
    for linear in layers.linear_layers(model):
        by_part.setdefault(linear.layer, set()).add(linear.weight_name)
    embedding = layers.token_embedding(model)
    if embedding is not None:
        by_part[OUTPUT].add(embedding[1].initializer)
    replaced = {name for part in measured for name in by_part.get(part, ())}
    return sum(size for name, size in estimate.items() if name not in replaced) + sum(
        size for _, size in measured.values()
    )

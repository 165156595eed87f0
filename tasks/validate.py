"""Check one variant against the original model's reference figures, and fail on any threshold.

Reads artifacts/<model>/variants/<variant>, artifacts/<model>/reference and params.yaml
`validate.eval` and `validate.thresholds.<variant>`; writes reports/<model>/variants/<variant>/
validate.json (a DVC metric) whether or not the variant passes. A passing variant gets the stamp
artifacts/<model>/variants/<variant>.valid.json (bench and applications require it); a failing one
gets none, and the stage exits non-zero with one message naming every failed check, its value and
its threshold.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortforge.manifest import read_manifest, sha256_file, validation_stamp
from ortforge.names import MANIFEST_FILE, MODEL_FILE
from tasks.core import paths, resources
from tasks.core.files import atomic_write_json
from tasks.core.params import EvalConfig, Thresholds
from tasks.core.stage import StageError, stage_cli
from tasks.evaluation.metrics import (
    Reference,
    TextReference,
    cached_decode_gap,
    compare,
    full_pass_logits,
    greedy,
    matching_prefix,
)
from tasks.quantization import coverage, kv_cache
from tasks.quantization.configs import quantize_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Check:
    name: str
    value: float
    threshold: float
    upper_bound: bool  # True: value must be <= threshold; False: value must be >= threshold

    @property
    def passed(self) -> bool:
        if math.isnan(self.value):  # NaN logits compare False both ways; never let them pass
            return False
        return self.value <= self.threshold if self.upper_bound else self.value >= self.threshold

    def describe(self) -> str:
        relation = ">" if self.upper_bound else "<"
        return f"{self.name} {self.value:.4g} {relation} {self.threshold:.4g}"


class ValidationFailed(StageError):
    pass


GATES = (  # (name, the worst value over the texts, whether the value must stay at or below the limit)
    ("ppl_ratio", max, True),
    ("kl_divergence", max, True),
    ("top1_agreement", min, False),
    ("greedy_agreement", min, False),
)


def greedy_agreement(decoder, text: TextReference) -> float:
    """The share of the reference's greedy tokens the variant predicts given the reference's own
    prefix (one pass over prompt + tokens): a near tie flips one token here, not all that follow."""
    sequence = np.concatenate([text.greedy_prompt, text.greedy_tokens[:-1]])
    predicted = full_pass_logits(decoder, sequence)[len(text.greedy_prompt) - 1 :].argmax(-1)
    return float(np.mean(predicted == text.greedy_tokens))


def measure_text(decoder, text: TextReference, cfg: EvalConfig, sequence: int, reference_ppl: float) -> dict:
    figures = compare(decoder, text, cfg, sequence)
    matched = matching_prefix(greedy(decoder, text.greedy_prompt, len(text.greedy_tokens)), text.greedy_tokens)
    return figures | {
        "reference_perplexity": reference_ppl,
        "ppl_ratio": figures["perplexity"] / reference_ppl,
        "greedy_agreement": greedy_agreement(decoder, text),
        "greedy_tokens_matched": matched,  # free-running: how long the two continuations stay equal
        "greedy_steps": len(text.greedy_tokens),
    }


def measure(variant_dir: Path, reference: Reference, cfg: EvalConfig) -> dict:
    """Per text, then the worst over the texts of each gated measure (the figures reports show)."""
    from ortforge.decoder import Decoder
    from ortforge.session import create_session

    decoder = Decoder(create_session(variant_dir))
    per_text = {
        name: measure_text(decoder, text, cfg, reference.sequence_tokens, reference.perplexity[name])
        for name, text in reference.texts.items()
    }
    first = next(iter(per_text.values()))
    worst = {name: pick(figures[name] for figures in per_text.values()) for name, pick, _ in GATES}
    return {
        **worst,
        "perplexity": first["perplexity"],  # of the first text, the one the report shows
        "reference_perplexity": first["reference_perplexity"],
        "greedy_tokens_matched": first["greedy_tokens_matched"],
        "greedy_steps": first["greedy_steps"],
        "max_logit_diff": max(figures["max_logit_diff"] for figures in per_text.values()),
        "kv_max_prob_diff": cached_decode_gap(
            decoder, next(iter(reference.texts.values())).ids, cfg.kv_prefill, cfg.kv_steps
        ),
        "sequence_tokens": reference.sequence_tokens,
        "tokens_scored": first["tokens_scored"],  # per text
        "texts": per_text,
    }


def recorded_params(manifest: dict) -> dict:
    """The params a variant was written with. A size budget records the widths its measurement
    chose (eight_bit_blocks, output_bits); the budget is spent, so those widths are what to check."""
    return {key: value for key, value in manifest["params"].items() if key != "size_budget_mb"}


def measure_coverage(variant_dir: Path) -> dict:
    """What the graph stores at which width, against what the variant's params asked (manifest)."""
    import onnx

    manifest = read_manifest(variant_dir)
    params = quantize_config(**recorded_params(manifest))
    graph = onnx.load(str(variant_dir / MODEL_FILE), load_external_data=False)
    found = coverage.weights(graph)
    share, wrong = coverage.shortfall(params, found, set(manifest.get("kept_float", {})))
    stored, asked = kv_cache.stored_bits(graph), params.kv_bits
    as_asked = stored == asked if asked else stored >= 16  # "float": float32, or float16 in an fp16 graph
    return {
        "share_as_asked": share,
        "not_as_asked": wrong,
        "by_role": coverage.summary(found),
        "kv_cache": {"asked": params.kv_cache, "stored_bits": stored, "as_asked": as_asked},
    }


def checks(figures: dict, limits: Thresholds) -> list[Check]:
    found = [
        Check(f"{name}[{text}]", values[name], getattr(limits, name), upper_bound=upper)
        for text, values in figures["texts"].items()
        for name, _, upper in GATES
    ]
    found.append(Check("kv_max_prob_diff", figures["kv_max_prob_diff"], limits.kv_max_prob_diff, upper_bound=True))
    found.append(Check("coverage", figures["coverage"]["share_as_asked"], 1.0, upper_bound=False))
    found.append(Check("kv_cache_as_asked", float(figures["coverage"]["kv_cache"]["as_asked"]), 1.0, upper_bound=False))
    if limits.max_logit_diff is not None:
        found.append(Check("max_logit_diff", figures["max_logit_diff"], limits.max_logit_diff, upper_bound=True))
    return found


def run(
    cfg: EvalConfig, limits: Thresholds, variant_dir: Path, reference_dir: Path, report: Path, variant: str
) -> dict:
    """Measure and write the report; on pass stamp the variant valid, else raise ValidationFailed."""
    if not (variant_dir / "model.onnx").is_file():
        raise StageError(
            f"{variant_dir} has no model.onnx; run the quantize stage first (dvc repro quantize@<model>-{variant})"
        )
    reference = Reference.load(reference_dir)
    figures = measure(variant_dir, reference, cfg) | {"coverage": measure_coverage(variant_dir)}
    results = checks(figures, limits)
    failed = [check for check in results if not check.passed]
    atomic_write_json(
        report,
        {
            **figures,
            "passed": not failed,
            "checks": {c.name: {"value": c.value, "threshold": c.threshold, "passed": c.passed} for c in results},
        },
    )
    summary = ", ".join(f"{c.name}={c.value:.4g}" for c in results)
    stamp = validation_stamp(variant_dir)
    stamp.unlink(missing_ok=True)
    if failed:
        unquantized = figures["coverage"]["not_as_asked"]
        detail = f" (not as asked: {', '.join(unquantized[:3])}{' ...' if len(unquantized) > 3 else ''})"
        raise ValidationFailed(
            f"variant {variant} failed validation: {'; '.join(c.describe() for c in failed)}"
            f"{detail if unquantized else ''} (thresholds: params.yaml validate.thresholds.{variant}, or the "
            f"build's own; report: {report})"
        )
    atomic_write_json(
        stamp,
        {
            "variant": variant,
            "passed": True,
            "manifest_sha256": sha256_file(variant_dir / MANIFEST_FILE),
            "perplexity": figures["perplexity"],
            "ppl_ratio": figures["ppl_ratio"],
            "thresholds": limits.model_dump(),
        },
    )
    log.debug("variant %s passed: %s", variant, summary)
    log.info(
        "variant %s passed (worst text: perplexity x%.3f, KL %.3g, top-1 %.3f; coverage %.0f%%); stamped %s",
        variant,
        figures["ppl_ratio"],
        figures["kl_divergence"],
        figures["top1_agreement"],
        100 * figures["coverage"]["share_as_asked"],
        stamp,
    )
    return figures


def needs(a) -> resources.Needs:
    return resources.runtime_needs(a.paths["variant-dir"], a.params.validation.eval.window, "scoring windows")


def main(argv: list[str] | None = None) -> int:
    flags = {"variant-dir": paths.variant_dir, "reference": paths.reference_dir, "report": paths.validate_json}
    # The stamp lands beside the variant folder (paths.validation_stamp); it has no flag of its own.

    def body(a):
        p = a.paths
        limits = a.params.thresholds(a.model, a.variant)
        run(a.params.validation.eval, limits, p["variant-dir"], p["reference"], p["report"], a.variant)

    return stage_cli("validate", __doc__, flags, body, argv, variant=True, needs=needs)


if __name__ == "__main__":
    raise SystemExit(main())

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

from ortforge.manifest import sha256_file, validation_stamp
from ortforge.names import MANIFEST_FILE
from tasks import paths
from tasks.evaluation import Reference, cached_decode_gap, full_pass_logits, greedy, matching_prefix, perplexity
from tasks.files import atomic_write_json
from tasks.params import EvalConfig, Thresholds
from tasks.stage import StageError, stage_cli

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


def measure(variant_dir: Path, reference: Reference, cfg: EvalConfig) -> dict:
    from ortforge import Decoder, create_session

    decoder = Decoder(create_session(variant_dir))
    logits = full_pass_logits(decoder, reference.random_ids)
    tokens = greedy(decoder, reference.greedy_prompt, len(reference.greedy_tokens))
    ppl = perplexity(decoder, reference.text_ids, cfg.window)
    return {
        "max_logit_diff": float(np.abs(logits - reference.random_logits).max()),
        "perplexity": ppl,
        "reference_perplexity": reference.perplexity,
        "ppl_ratio": ppl / reference.perplexity,
        "greedy_tokens_matched": matching_prefix(tokens, reference.greedy_tokens),
        "greedy_steps": len(reference.greedy_tokens),
        "greedy_match": matching_prefix(tokens, reference.greedy_tokens) / len(reference.greedy_tokens),
        "kv_max_diff": cached_decode_gap(decoder, reference.text_ids, cfg.kv_prefill, cfg.kv_steps),
        "tokens_scored": len(reference.text_ids) - 1,
    }


def checks(figures: dict, limits: Thresholds) -> list[Check]:
    return [
        Check("max_logit_diff", figures["max_logit_diff"], limits.max_logit_diff, upper_bound=True),
        Check("ppl_ratio", figures["ppl_ratio"], limits.ppl_ratio, upper_bound=True),
        Check("greedy_match", figures["greedy_match"], limits.greedy_match, upper_bound=False),
        Check("kv_max_diff", figures["kv_max_diff"], limits.kv_max_diff, upper_bound=True),
    ]


def run(
    cfg: EvalConfig, limits: Thresholds, variant_dir: Path, reference_dir: Path, report: Path, variant: str
) -> dict:
    """Measure and write the report; on pass stamp the variant valid, else raise ValidationFailed."""
    if not (variant_dir / "model.onnx").is_file():
        raise StageError(
            f"{variant_dir} has no model.onnx; run the quantize stage first (dvc repro quantize@<model>-{variant})"
        )
    reference = Reference.load(reference_dir)
    figures = measure(variant_dir, reference, cfg)
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
        raise ValidationFailed(
            f"variant {variant} failed validation: {'; '.join(c.describe() for c in failed)} "
            f"(thresholds: params.yaml validate.thresholds.{variant}; report: {report})"
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
    log.info("variant %s passed: %s, perplexity %.3f; stamped %s", variant, summary, figures["perplexity"], stamp)
    return figures


def main(argv: list[str] | None = None) -> int:
    flags = {"variant-dir": paths.variant_dir, "reference": paths.reference_dir, "report": paths.validate_json}
    # The stamp lands beside the variant folder (paths.validation_stamp); it has no flag of its own.

    def body(a):
        section = a.params.validation
        p = a.paths
        run(section.eval, section.thresholds[a.variant], p["variant-dir"], p["reference"], p["report"], a.variant)

    return stage_cli("validate", __doc__, flags, body, argv, variant=True)


if __name__ == "__main__":
    raise SystemExit(main())

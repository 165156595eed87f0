"""Check one variant against the original model's reference figures, and fail on any threshold.

Reads artifacts/<model>/variants/<variant>, artifacts/<model>/reference and params.yaml:
`validate.eval`, the variant's limits (`validate.thresholds.<variant>`, or its build's own), whether
it is a goal variant or a comparison point (`validate.comparison`), and its recipe
(`quantize.<variant>`, what coverage checks the graph against, not what quantize recorded).
Writes reports/<model>/variants/<variant>/validate.json (a DVC metric) whether or not the variant
passes: every check's value, limit and margin, the shared limit a build replaced, and whether a goal
variant met its goal. A passing variant gets the stamp artifacts/<model>/variants/<variant>.valid.json
(bench and applications require it); a failing one gets none, and the stage exits non-zero with one
message naming every failed check, its value and its threshold.
"""

from __future__ import annotations

import gc
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortforge.manifest import read_manifest, sha256_file, validation_stamp
from ortforge.names import DEPLOYMENT_KEY, LOGITS, MANIFEST_FILE, MODEL_CONFIG_FILE, MODEL_FILE
from tasks.core import paths, resources
from tasks.core.files import atomic_write_json, folder_bytes, link_or_copy
from tasks.core.params import EvalConfig, Thresholds
from tasks.core.stage import StageError, stage_cli
from tasks.evaluation import deployment
from tasks.evaluation.metrics import (
    Reference,
    TextReference,
    cached_decode_gap,
    compare,
    full_pass_logits,
    greedy,
    matching_prefix,
    windowed_kl,
)
from tasks.graphs import onnx_io
from tasks.graphs.weights import ExternalData, WeightStore, external_files
from tasks.quantization import coverage, kv_cache, per_token, weight_only
from tasks.quantization.configs import QuantizeConfig

log = logging.getLogger(__name__)
FLOAT_COMPUTE_DATA = "float_compute.data"  # the 4-bit codes float compute writes (weight_only, per_token)


@dataclass(frozen=True)
class Check:
    gate: str
    value: float
    threshold: float
    upper_bound: bool  # True: value must be <= threshold; False: value must be >= threshold
    text: str | None = None  # the evaluation text, for a gate measured per text
    goal: float | None = None  # the variant's shared limit, where the build replaced it with threshold

    @property
    def name(self) -> str:
        return f"{self.gate}[{self.text}]" if self.text else self.gate

    def within(self, limit: float) -> bool:
        if math.isnan(self.value):  # NaN logits compare False both ways; never let them pass
            return False
        return self.value <= limit if self.upper_bound else self.value >= limit

    @property
    def passed(self) -> bool:
        return self.within(self.threshold)

    @property
    def margin(self) -> float:
        """How far inside the limit the value is; negative when it fails."""
        return self.threshold - self.value if self.upper_bound else self.value - self.threshold

    @property
    def meets_goal(self) -> bool:
        return self.within(self.threshold if self.goal is None else self.goal)

    def describe(self) -> str:
        relation = ">" if self.upper_bound else "<"
        return f"{self.name} {self.value:.4g} {relation} {self.threshold:.4g}"

    def record(self) -> dict:
        found = {"gate": self.gate, "text": self.text, "value": self.value, "limit": self.threshold}
        found |= {"margin": self.margin, "upper_bound": self.upper_bound, "passed": self.passed}
        if self.goal is not None:
            found |= {"shared_limit": self.goal, "meets_shared_limit": self.meets_goal}
        return found


@dataclass(frozen=True)
class Asked:
    """What params.yaml asks of one variant of one model: its recipe (what the graph must store),
    the build's limits, the variant's shared limits where the build replaced some (for a goal
    variant, its quality goal), and whether it is a comparison point rather than a goal."""

    recipe: QuantizeConfig
    limits: Thresholds
    shared: Thresholds | None = None
    comparison: bool = False

    @classmethod
    def from_params(cls, params, model: str, variant: str) -> Asked:
        shared, limits = params.validation.thresholds[variant], params.thresholds(model, variant)
        return cls(params.variant(variant), limits, None if limits == shared else shared, params.is_comparison(variant))

    def goal(self, gate: str) -> float | None:
        """The shared limit of gate where the build replaced it, else None."""
        if self.shared is None or getattr(self.shared, gate) == getattr(self.limits, gate):
            return None
        return getattr(self.shared, gate)


class ValidationFailed(StageError):
    pass


GATES = (  # (name, the worst value over the texts, whether the value must stay at or below the limit)
    ("ppl_ratio", max, True),
    ("kl_divergence", max, True),
    ("top1_agreement", min, False),
    ("greedy_agreement", min, False),
    ("kv_max_prob_diff", max, True),
    ("kv_cache_kl", max, True),  # a quantized KV cache's only
)


def greedy_agreement(decoder, text: TextReference) -> float:
    """The share of the reference's greedy tokens the variant predicts given the reference's own
    prefix (one pass over prompt + tokens): a near tie flips one token here, not all that follow."""
    sequence = np.concatenate([text.greedy_prompt, text.greedy_tokens[:-1]])
    predicted = full_pass_logits(decoder, sequence)[len(text.greedy_prompt) - 1 :].argmax(-1)
    return float(np.mean(predicted == text.greedy_tokens))


def measure_text(decoder, text: TextReference, cfg: EvalConfig, sequence: int, reference_ppl: float) -> dict:
    """The variant's figures on one text (the cache checks' come after, cache_figures)."""
    figures = compare(decoder, text, cfg, sequence)
    matched = matching_prefix(greedy(decoder, text.greedy_prompt, len(text.greedy_tokens)), text.greedy_tokens)
    return figures | {
        "reference_perplexity": reference_ppl,
        "ppl_ratio": figures["perplexity"] / reference_ppl,
        "greedy_agreement": greedy_agreement(decoder, text),
        "greedy_tokens_matched": matched,  # free-running: how long the two continuations stay equal
        "greedy_steps": len(text.greedy_tokens),
    }


def cache_figures(checked, float_cache, ids: np.ndarray, cfg: EvalConfig, sequence: int) -> dict:
    """kv_max_prob_diff: the cache as a mechanism, cached decode against a full pass of the same
    graph; kv_cache_kl, for a quantized cache: what storing it costs, the mean KL of the whole text
    run through it from the same run over a float cache (both with float compute)."""
    figures = {"kv_max_prob_diff": cached_decode_gap(checked, ids, cfg.kv_prefill, cfg.kv_steps)}
    if float_cache is not None:
        figures["kv_cache_kl"] = windowed_kl(float_cache, checked, ids, cfg.window, sequence)
    return figures


def cache_check_decoders(variant_dir: Path, scratch: Path) -> tuple:
    """The decoders the cache checks run, over the variant's graph with float compute
    (weight_only.float_compute, per_token.float_compute: int8-activation kernels round one token
    differently from many, which would hide the cache's own behaviour): one with the variant's cache
    (the variant itself where there is no MatMulNBits or per-token matmul to change), for a
    quantized cache one with a float cache (None for a float cache), the folder of the first one's
    graph, and the folder of the graph the deployment proof runs on: the float-cache one where there
    is one. Over an int8 cache a batch's float rounding (about 1e-7: other matmul kernels for 3 rows
    than for 1) flips whole codes where a value sits on a rounding boundary (a 0.011 probability gap
    on SmolLM2's w8a8_attn_kv8, 2.6e-7 on the variant as built), which would hide what the proof
    asks: whether rows and pieces couple. Static per-channel codes are a function of each position's
    own value, so they cannot couple them, and the kernels' int8-cache batching is held to
    onnxruntime's code for code by tests/test_custom_ops.py."""
    from ortforge.decoder import Decoder
    from ortforge.session import create_session

    weights = scratch / "weights"  # the variant's files, linked, and the codes float compute writes
    weights.mkdir()
    graph = structure(variant_dir)
    variant_files = external_files(graph)

    def decoder_over(graph, name: str) -> Decoder:
        # Linked only where a rewritten graph needs them: a second name for the variant's data
        # makes onnx.load refuse the file while the scratch folder lives.
        for file in variant_files:
            if not (weights / file).exists():
                link_or_copy(variant_dir / file, weights / file)
        folder = scratch / name
        folder.mkdir()
        onnx_io.save_runnable(graph, weights, folder)
        return Decoder(create_session(folder))

    written = ExternalData(weights, FLOAT_COMPUTE_DATA)
    store = WeightStore(graph, variant_dir)
    exact = weight_only.float_compute(graph, store, written) + per_token.float_compute(graph, store, written) > 0
    checked = decoder_over(graph, "cached") if exact else Decoder(create_session(variant_dir))
    full = decoder_over(kv_cache.float_cache(graph), "float-cache") if quantized_cache(graph) else None
    checked_dir = scratch / "cached" if exact else variant_dir
    return checked, full, checked_dir, scratch / "float-cache" if full else checked_dir


def measure(variant_dir: Path, reference: Reference, cfg: EvalConfig) -> dict:
    """Per text, then the worst over the texts of each gated measure (the figures reports show).
    Three phases, each closing its sessions before the next opens its own: the variant scored on
    each text, the cache checked on each, and the deployment proven (a random-weight Llama 3.2 1B's
    int8 peaked at 5.8 GB holding the first two phases' sessions together, 3.8 GB one at a time)."""
    from ortforge.decoder import Decoder
    from ortforge.session import create_session

    texts, sequence = reference.texts, reference.sequence_tokens
    decoder = Decoder(create_session(variant_dir))
    per_text = {
        name: measure_text(decoder, text, cfg, sequence, reference.perplexity[name]) for name, text in texts.items()
    }
    del decoder
    gc.collect()
    with tempfile.TemporaryDirectory() as scratch:
        checked, float_cache, checked_dir, proof_dir = cache_check_decoders(variant_dir, Path(scratch))
        for name, text in texts.items():
            per_text[name] |= cache_figures(checked, float_cache, text.ids, cfg, sequence)
        kv_check = {
            "float_compute": checked_dir != variant_dir,  # the cache check's graph computes in float32
            "quantized_cache_against_float_cache": float_cache is not None,
            "deployment_proven_over_float_cache": float_cache is not None,
        }
        del checked, float_cache
        gc.collect()
        proof = prove_deployment(variant_dir, proof_dir, next(iter(texts.values())).ids)
    first = next(iter(per_text.values()))
    worst = {name: pick(figures[name] for figures in per_text.values()) for name, pick, _ in GATES if name in first}
    return {
        **worst,
        "perplexity": first["perplexity"],  # of the first text, the one the report shows
        "reference_perplexity": first["reference_perplexity"],
        "greedy_tokens_matched": first["greedy_tokens_matched"],
        "greedy_steps": first["greedy_steps"],
        "max_logit_diff": max(figures["max_logit_diff"] for figures in per_text.values()),
        "kv_check": kv_check,
        "sequence_tokens": sequence,
        "tokens_scored": first["tokens_scored"],  # per text
        "texts": per_text,
        DEPLOYMENT_KEY: proof.record(),
    }


def prove_deployment(variant_dir: Path, checked_dir: Path, ids: np.ndarray) -> deployment.Proof:
    """Which ways of running its tokens the runtime may use for this variant (tasks/evaluation/
    deployment.py), on the cache check's float-compute graph (over a float cache: cache_check_decoders)."""
    import json

    from ortforge.decoder import length_dependent_rope
    from ortforge.session import SessionSettings, create_session

    def session_of(threads: int, level: str):
        return create_session(checked_dir, SessionSettings(intra_op_threads=threads, graph_level=level))

    config = json.loads((variant_dir / MODEL_CONFIG_FILE).read_text(encoding="utf-8"))
    return deployment.prove(session_of, length_dependent_rope(variant_dir), ids, config, deployment.PREFILL_CHUNKS)


def asked_widths(recipe: QuantizeConfig, manifest: dict) -> QuantizeConfig:
    """What the recipe asks of each matrix. A size budget asks for the widths its measurement chose
    within it (the manifest records them as eight_bit_blocks and output_bits)."""
    if getattr(recipe, "size_budget_mb", None) is None:
        return recipe
    chosen = {key: manifest["params"][key] for key in ("eight_bit_blocks", "output_bits")}
    return recipe.model_copy(update=chosen)


def measure_coverage(variant_dir: Path, recipe: QuantizeConfig) -> dict:
    """What the graph stores at which width, against what params.yaml's recipe asks (not what the
    quantize stage recorded: a stage that ignored a key would agree with itself)."""
    manifest = read_manifest(variant_dir)
    params = asked_widths(recipe, manifest)
    graph = structure(variant_dir)
    found = coverage.weights(graph)
    stored, asked = kv_cache.stored_bits(graph), params.kv_bits
    as_asked = stored == asked if asked else stored >= 16  # "float": float32, or float16 in an fp16 graph
    return coverage.against_recipe(params, found, manifest.get("kept_float", {})) | {
        "by_role": coverage.summary(found),
        "kv_cache": {"asked": params.kv_cache, "stored_bits": stored, "as_asked": as_asked},
    }


def checks(figures: dict, asked: Asked) -> list[Check]:
    limits = asked.limits
    if "kv_cache_kl" in figures and limits.kv_cache_kl is None:
        raise StageError("a quantized KV cache needs a kv_cache_kl limit (params.yaml validate.thresholds.<variant>)")
    found = [
        Check(name, values[name], getattr(limits, name), upper, text=text, goal=asked.goal(name))
        for text, values in figures["texts"].items()
        for name, _, upper in GATES
        if name in values
    ]
    covered = figures["coverage"]
    found.append(Check("coverage", covered["share_as_asked"], 1.0, upper_bound=False))
    kept = covered["kept_float"]
    found.append(Check("kept_float_share", kept["share"], kept["limit"], upper_bound=True))
    found.append(Check("kv_cache_as_asked", float(covered["kv_cache"]["as_asked"]), 1.0, upper_bound=False))
    if limits.max_logit_diff is not None:
        goal = asked.goal("max_logit_diff")
        found.append(Check("max_logit_diff", figures["max_logit_diff"], limits.max_logit_diff, True, goal=goal))
    return found


def verdict(results: list[Check], asked: Asked) -> dict:
    """Passed (against the build's limits) and, for a goal variant, whether its quality goal (the
    shared limits) is met: a build that replaced a limit may pass a variant that misses its goal."""
    replaced = {
        check.gate: {"limit": check.threshold, "shared": check.goal} for check in results if check.goal is not None
    }
    return {
        "passed": all(check.passed for check in results),
        "role": "comparison" if asked.comparison else "goal",
        "goal_met": None if asked.comparison else all(check.meets_goal for check in results),
        "limits_replaced_by_build": replaced,
    }


def run(cfg: EvalConfig, asked: Asked, variant_dir: Path, reference_dir: Path, report: Path, variant: str) -> dict:
    """Measure and write the report; on pass stamp the variant valid, else raise ValidationFailed."""
    if not (variant_dir / "model.onnx").is_file():
        raise StageError(
            f"{variant_dir} has no model.onnx; run the quantize stage first (dvc repro quantize@<model>-{variant})"
        )
    reference = Reference.load(reference_dir)
    figures = measure(variant_dir, reference, cfg) | {"coverage": measure_coverage(variant_dir, asked.recipe)}
    results = checks(figures, asked)
    failed = [check for check in results if not check.passed]
    atomic_write_json(report, {**figures, **verdict(results, asked), "checks": {c.name: c.record() for c in results}})
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
            DEPLOYMENT_KEY: {key: figures[DEPLOYMENT_KEY][key] for key in deployment.STAMPED},
            "thresholds": asked.limits.model_dump(),
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


def structure(variant_dir: Path):
    """The variant's graph without its weights."""
    import onnx

    return onnx.load(str(variant_dir / MODEL_FILE), load_external_data=False)


def quantized_cache(graph) -> bool:
    return kv_cache.stored_bits(graph) < 16


def cache_check_sessions(graph) -> int:
    """How many sessions the cache checks hold at once (cache_check_decoders): the one they check
    (over float compute where the graph (structure) has int8-activation matmuls, else the variant
    itself) and, where the cache is quantized, one over a float cache."""
    return 1 + int(quantized_cache(graph))


def float_compute_bytes(graph) -> int:
    """The bytes of 4-bit codes the cache check's float compute writes (on temporary disk)."""
    return weight_only.float_compute_bytes(graph) + per_token.float_compute_bytes(graph)


# What the quantized cache's KL check (windowed_kl) adds per logit of a window: both decoders'
# float32 logits and mean_kl's float64 temporaries (measured: 6.1 GB over 512 x 262,144 logits,
# Gemma 3 270M int8_kv8, on top of the scoring's peak).
KL_BYTES_PER_LOGIT = 48


def kv_kl_bytes(graph, window: int) -> int:
    """The memory the KL check of a quantized cache holds beyond the scoring (0 for a float cache)."""
    if not quantized_cache(graph):
        return 0
    (logits,) = [output for output in graph.graph.output if output.name == LOGITS]
    return KL_BYTES_PER_LOGIT * window * logits.type.tensor_type.shape.dim[-1].dim_value


def needs(a) -> resources.Needs:
    """What validate holds at once, in sessions (each loads the weights and prepacks its own copy,
    resources.runtime_needs), the largest of its three phases (measure): scoring the texts (the
    variant's session and its logits windows), checking the cache (its sessions, and for a quantized
    cache its KL check's windows), and proving the deployment (tasks/evaluation/deployment.py: one
    session of the cache check's graph at a time)."""
    variant_dir, window = a.paths["variant-dir"], a.params.validation.eval.window
    one = resources.runtime_needs(variant_dir, window, "scoring windows")
    if not (variant_dir / MODEL_FILE).is_file():
        return one  # run() says which stage to run first
    graph = structure(variant_dir)
    sessions, written = cache_check_sessions(graph), float_compute_bytes(graph)
    session = 2 * folder_bytes(variant_dir, "model.onnx*")  # float compute holds the same bytes of codes
    checking = resources.RUNTIME_MEMORY + sessions * session + kv_kl_bytes(graph, window)  # the proof's one fits
    held = f"1 session while scoring, {sessions} while checking the cache, 1 while proving its deployment"
    rewritten = f", its 8-bit codes rewritten as {resources.amount(written)} of 4-bit ones" if written else ""
    return resources.Needs(max(one.memory, checking), one.disk + written, f"{one.basis}, {held}{rewritten}")


def main(argv: list[str] | None = None) -> int:
    flags = {"variant-dir": paths.variant_dir, "reference": paths.reference_dir, "report": paths.validate_json}
    # The stamp lands beside the variant folder (paths.validation_stamp); it has no flag of its own.

    def body(a):
        p = a.paths
        asked = Asked.from_params(a.params, a.model, a.variant)
        run(a.params.validation.eval, asked, p["variant-dir"], p["reference"], p["report"], a.variant)

    return stage_cli("validate", __doc__, flags, body, argv, variant=True, needs=needs)


if __name__ == "__main__":
    raise SystemExit(main())

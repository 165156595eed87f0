"""A variant's recipe, one config per quantization method with only its own keys (as Olive keeps
a config per pass): params.yaml `quantize.<variant>` names the method and what differs from the
defaults here. The defaults are part of the quantize stage's code (this module is one of its DVC
dependencies), so changing one rebuilds what it shapes, and the manifest records every setting
the variant was built with.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, model_validator

from tasks.core.schema import Bool, Float, Int, Strict

KV_CACHE_BITS = {"float": None, "int8": 8, "int4": 4}
ORTFORGE_KERNEL_CACHES = ("float", "int8")  # what ortforge/csrc/gqa.c reads (no packed 4-bit codes)


class Recipe(Strict):
    """A method's config: a key of another method is named as such. Every method's graph may store
    its KV cache quantized (tasks/quantization/kv_cache.py) and run its attention on ortforge's own
    kernel (tasks/quantization/attention.py); both need GroupQueryAttention graphs."""

    kv_cache: Literal["float", "int8", "int4"] = Field(
        "float", description="the KV cache's storage: float as the graph computes it, or int8 / int4 codes"
    )
    kv_headroom: Float = Field(
        1.5, ge=1.0, le=8.0, description="value scales: this many times the calibration's largest value"
    )

    attention: Literal["onnxruntime", "ortforge"] = Field(
        "onnxruntime",
        description="GroupQueryAttention's kernel: onnxruntime's, or ortforge's (ortforge/custom_ops.py), "
        "which the runtime compiles with the machine's C compiler",
    )

    @property
    def kv_bits(self) -> int | None:
        return KV_CACHE_BITS[self.kv_cache]

    @model_validator(mode="after")
    def _attention_kernel_takes_the_cache(self) -> Recipe:
        if self.attention == "ortforge" and self.kv_cache not in ORTFORGE_KERNEL_CACHES:
            raise ValueError(
                f"attention: ortforge reads a float or int8 KV cache and kv_cache is {self.kv_cache}: "
                "set kv_cache: int8, or attention: onnxruntime"
            )
        return self

    def recorded(self) -> dict:
        """Every setting, for the manifest; the attention kernel only where it is not onnxruntime's,
        so a variant built before the key existed keeps its bytes (and DVC its cache)."""
        values = self.model_dump()
        if self.attention == "onnxruntime":
            del values["attention"]
        return values

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: object) -> object:
        if isinstance(data, dict):
            own = [name for name in cls.model_fields if name != "method"]
            foreign = [key for key in data if key not in cls.model_fields]
            for key in foreign:
                near = difflib.get_close_matches(str(key), own, n=1)
                if near:  # a typo rather than another method's key
                    raise ValueError(f"unknown key `{key}`; did you mean `{near[0]}`? allowed keys: {', '.join(own)}")
            if foreign:
                verb = "does" if len(foreign) == 1 else "do"
                keys = ", ".join(f"`{key}`" for key in foreign)
                raise ValueError(
                    f"{keys} {verb} not apply to method {data.get('method')}; its keys: {', '.join(own) or 'none'}"
                )
        return data


class Fp32(Recipe):
    """The optimized graph as it is."""

    method: Literal["fp32"]


class Fp16(Recipe):
    """Weights and activations in float16, inputs and outputs kept float32."""

    method: Literal["fp16"]


class _OnnxruntimeInt8(Recipe):
    keep_float: tuple[str, ...] = Field((), description="MatMuls whose node name contains one of these stay float")
    smooth_alpha: Float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="SmoothQuant first (tasks/quantization/smoothing.py): how much range moves to weights",
    )
    outlier_ratio: Float | None = Field(
        None, gt=1.0, description="MatMuls whose input has a token this many times the median token's peak stay float"
    )
    per_channel: Bool = False
    max_float_share: Float = Field(
        0.0, ge=0.0, lt=1.0, description="largest share of matmul weights keep_float and outlier_ratio may leave float"
    )

    @model_validator(mode="after")
    def _float_share_capped(self) -> _OnnxruntimeInt8:
        # What a recipe leaves float is part of what its name promises: say how much, up front.
        if (self.keep_float or self.outlier_ratio is not None) and self.max_float_share == 0:
            raise ValueError(
                "keep_float and outlier_ratio leave MatMuls float: set max_float_share to the largest share of "
                "matmul weights you accept in float (e.g. 0.25); validate fails a variant above it"
            )
        return self


class Int8Dynamic(_OnnxruntimeInt8):
    """onnxruntime's quantize_dynamic: int8 weights, activations quantized per run."""

    method: Literal["int8_dynamic"]
    weight_type: Literal["QInt8", "QUInt8"] = "QUInt8"
    reduce_range: Bool = False


class Int8Static(_OnnxruntimeInt8):
    """onnxruntime's quantize_static (QDQ), activation ranges calibrated on the calibration text."""

    method: Literal["int8_static"]
    calibrate: Literal["minmax", "entropy", "percentile"] = "minmax"


class WeightOnly(Recipe):
    """Weight-only block quantization to MatMulNBits (tasks/quantization/weight_only.py)."""

    method: Literal["weight_only"]
    bits: Literal[4, 8] = 4
    algorithm: Literal["rtn", "imatrix", "hqq", "gptq"] = Field(
        "rtn", description="linear layers: round-to-nearest, importance-weighted range search, HQQ or GPTQ"
    )
    block_size: Int = Field(32, ge=16, le=256, description="weights per block along K (a power of two)")
    zero_point: Literal["none", "integer", "float"] = Field(
        "float", description="none: symmetric; integer: uint zero points; float: the range exactly (offset rows)"
    )
    accuracy_level: Int = Field(4, ge=0, le=4, description="MatMulNBits compute: 0 float32, 4 int8 activations")
    output_bits: Literal[4, 8, 32] = Field(4, description="the output layer and tied embedding; 32 keeps float")
    output_algorithm: Literal["rtn", "imatrix"] = "rtn"
    eight_bit_blocks: tuple[Int, ...] = Field((), description="decoder blocks kept at 8 bits; -1 is the last")
    size_budget_mb: Float | None = Field(
        None, gt=0, description="mixed precision chosen by measurement: raise parts to 8 bits within this size"
    )

    @model_validator(mode="after")
    def _consistent(self) -> WeightOnly:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size {self.block_size} is not a power of two; use 16, 32, 64, 128 or 256")
        if self.algorithm == "hqq" and self.zero_point != "float":
            raise ValueError("algorithm hqq solves for float zero points; set zero_point: float")
        if self.algorithm == "gptq" and self.zero_point == "float":
            raise ValueError("algorithm gptq works on an integer grid; set zero_point: integer or none")
        if self.eight_bit_blocks and self.bits != 4:
            raise ValueError("eight_bit_blocks mixes 8-bit blocks into a 4-bit model; it needs bits: 4")
        if self.size_budget_mb is not None and (self.bits != 4 or self.eight_bit_blocks or self.output_bits == 32):
            raise ValueError(
                "size_budget_mb chooses the 8-bit parts of a 4-bit model by measurement: it needs bits: 4, "
                "output_bits 4 or 8 (the output layer's lowest width) and no eight_bit_blocks"
            )
        return self


class Int8PerToken(Recipe):
    """Int8 weights per output channel and int8 activations per token, through MatMulInteger
    (tasks/quantization/per_token.py): each row's codes are its own, so batched rows and prompt
    pieces compute what a whole batch-1 run computes."""

    method: Literal["int8_per_token"]
    output_bits: Literal[8, 32] = Field(8, description="the output layer and tied embedding; 32 keeps float")
    # Per-token scales still lose the channels a few outlier channels dwarf; SmoothQuant moves that
    # range into the per-channel weight scales (SmolLM2: perplexity x1.044 without, x1.018 at 0.5).
    smooth_alpha: Float | None = Field(
        0.5, ge=0.0, le=1.0, description="SmoothQuant first (tasks/quantization/smoothing.py); null: none"
    )


QuantizeConfig = Annotated[
    Fp32 | Fp16 | Int8Dynamic | Int8Static | WeightOnly | Int8PerToken, Field(discriminator="method")
]
_ADAPTER = TypeAdapter(QuantizeConfig)
METHODS = ("fp32", "fp16", "int8_dynamic", "int8_static", "weight_only", "int8_per_token")


def quantize_config(**values):
    """The config of the method values name, with values validated as params.yaml's are."""
    return _ADAPTER.validate_python(values)


def needs_calibration(cfg) -> bool:
    """Whether the recipe reads calibration text (data-aware ranges, measurement, static ranges,
    KV cache scales)."""
    if cfg.kv_bits is not None:
        return True
    if isinstance(cfg, WeightOnly):
        data_aware = cfg.algorithm in ("gptq", "imatrix") or cfg.output_algorithm == "imatrix"
        return data_aware or cfg.size_budget_mb is not None
    if isinstance(cfg, _OnnxruntimeInt8):
        return isinstance(cfg, Int8Static) or cfg.smooth_alpha is not None or cfg.outlier_ratio is not None
    if isinstance(cfg, Int8PerToken):
        return cfg.smooth_alpha is not None
    return False


def kept_float_patterns(cfg) -> tuple[str, ...]:
    return getattr(cfg, "keep_float", ())

"""Tiny random models of each architecture family ortforge builds, from the families' real config
classes (each with its own spelling of the dimensions: GPT-2's n_layer and n_positions, Gemma's
head_dim apart from hidden / heads, Gemma 3's per-layer attention kinds), in seconds and offline.

Sliding windows are made short (8 tokens) so that the checks that run longer sequences see them.
Gemma 2 and Gemma 3 get a layer pattern onnxruntime-genai's builder does not follow: `exporter:
auto` must notice and fall back to optimum. The mixture-of-experts families route each token to 2
of 4 experts (Qwen2-MoE also through a shared expert; Qwen3-MoE with one dense layer, as
mlp_only_layers allows), and Qwen2-MoE keeps the top-2 weights unnormalized as its config says.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_models import SPECIAL_TOKENS, VOCAB_SIZE, train_tokenizer

SLIDING_WINDOW = 8
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# family: (config class, model class, config values beyond COMMON)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {"sliding_window": SLIDING_WINDOW, "tie_word_embeddings": False},
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"tie_word_embeddings": False, "pad_token_id": 0, "original_max_position_embeddings": 1024},
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 32, "sliding_window": SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "norm_topk_prob": False,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            "tie_word_embeddings": True,
        },
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 1024, "n_inner": 128},
    ),
    # Its token embedding is narrower than the hidden size and projected in and out (OPT-350M's layout).
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 32, "tie_word_embeddings": True}),
    # ALiBi instead of rotary positions, and no max_position_embeddings (its trained context is used).
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "n_head": 4}),
}
# Families no exporter writes faithfully here: each export is refused in one line, with the
# exporters' reasons (Falcon's new decoder architecture fails optimum's trace; optimum exports
# StarCoder2 without a KV cache only, and genai's builder does not take it).
REFUSED: dict[str, tuple[str, str, dict]] = {
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": SLIDING_WINDOW}),
}
# A configuration of a family that changes how it computes: Phi-3.5-mini's and Phi-4-mini's
# LongRoPE, whose graph takes the long factors once a run passes the original context
# (tests/test_longrope.py, and its own row in benchmarks/architectures.py).
LONGROPE_LIMIT = 32  # original_max_position_embeddings: short enough that prompts and replies cross it
LONGROPE_HALF_HEAD = 8  # 64 hidden / 4 heads / 2: one factor per rotary frequency
LONGROPE = {
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0] * LONGROPE_HALF_HEAD,
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    },
    "original_max_position_embeddings": LONGROPE_LIMIT,
    "max_position_embeddings": 8 * LONGROPE_LIMIT,
}
# name: (family, config overrides, prompt tokens the runtime-vs-PyTorch check prefills: past the
# LongRoPE limit, where one PyTorch pass over prompt and steps takes the long factors throughout).
CONFIGURATIONS: dict[str, tuple[str, dict, int]] = {
    "phi3 (LongRoPE)": ("phi3", LONGROPE, LONGROPE_LIMIT + 8),
}
GPT2_NAMES = {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "pad_token_id",
}
BLOOM_ABSENT = {"max_position_embeddings", "num_key_value_heads", "intermediate_size"}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
# Weights' spread: larger than the default gives logits with real spread; routed models need more
# still, or the greedy tokens of a tiny random model sit on near ties that any rounding flips.
WEIGHT_STD = {family: 0.12 if family in MOE else 0.08 for family in FAMILIES | REFUSED}
# A random router puts most tokens near a tie between experts, where any rounding flips the choice
# and the output with it; trained routers are confident, and so is this one.
ROUTER_STD = 0.6


def config_for(family: str, **overrides):
    import transformers

    config_class, _, extra = (FAMILIES | REFUSED)[family]
    values = dict(COMMON)
    if family == "gpt2":  # GPT-2 spells its dimensions itself and has no grouped KV heads
        values = {key: value for key, value in values.items() if key not in GPT2_NAMES}
    if family == "bloom":  # ALiBi: Bloom's configs declare no position count (nor grouped KV heads)
        values = {key: value for key, value in values.items() if key not in BLOOM_ABSENT}
    return getattr(transformers, config_class)(**(values | extra | overrides))


def build(family: str, folder: Path, text_path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of the family (config values overridden) with a byte-level BPE
    tokenizer as an HF folder."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = getattr(transformers, (FAMILIES | REFUSED)[family][1])(config_for(family, **overrides)).eval()
    with torch.no_grad():  # larger-than-default weights give logits with real spread
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, ROUTER_STD if name.endswith(".gate.weight") else WEIGHT_STD[family])
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(text_path),
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[2],
    )
    tokenizer.save_pretrained(folder)
    return folder


def through_every_stage(
    family: str, root: Path, variants=("fp32", "int8", "int4"), recipes: dict | None = None, **overrides
) -> dict:
    """Build the family's tiny model (config values overridden) through download, export (auto),
    optimize, reference, quantize and validate (the tiny thresholds of tests/conftest.py); return
    the folders and the reports. recipes: more variants, {name: (recipe, thresholds)}."""
    from tasks import download, export, optimize, quantize, reference, validate
    from tasks.core.params import Params
    from tests.conftest import EVAL_TEXT, tiny_params

    values = tiny_params(build(family, root / "src", EVAL_TEXT, **overrides))
    for name, (recipe, limits) in (recipes or {}).items():
        values["quantize"][name] = recipe
        values["validate"]["thresholds"][name] = limits
        values["builds"][f"tiny-{name}"] = {"model": "tiny", "variant": name}
    params = Params.model_validate(values)
    out = {name: root / name for name in ("hf", "onnx", "optimized", "reference")}
    download.run(params.model("tiny"), out["hf"])
    export.run(params.export, "auto", out["hf"], out["onnx"])
    optimize.run(params.optimize, out["onnx"], out["hf"], out["optimized"])
    reference.run(params.validation.eval, out["hf"], out["reference"])
    reports = {}
    for variant in variants:
        out[variant] = root / "variants" / variant
        quantize.run(params.variant(variant), out["optimized"], out["hf"], out[variant], {"model": family})
        asked = validate.Asked.from_params(params, "tiny", variant)
        report = root / f"{variant}.json"
        reports[variant] = validate.run(params.validation.eval, asked, out[variant], out["reference"], report, variant)
    return {"folders": out, "reports": reports}


def runtime_gap(variant_dir: Path, hf_dir: Path, prefill: int = 14, steps: int = 6) -> float:
    """Largest |runtime logit - PyTorch logit| relative to PyTorch's largest, over a prefill and
    cached one-token steps through ortforge's runtime against one eager PyTorch pass."""
    import numpy as np

    from ortforge import Decoder
    from tasks.evaluation.torch_decoder import TorchDecoder

    ids = np.random.default_rng(1).integers(3, VOCAB_SIZE, prefill + steps)
    torch_decoder = TorchDecoder(hf_dir, attention="eager")
    expected, _ = torch_decoder.forward(ids, torch_decoder.empty_cache())
    decoder = Decoder.for_artifact(variant_dir)
    logits, cache = decoder.forward(ids[:prefill], decoder.empty_cache())
    stepped = [logits]
    for token in ids[prefill:]:
        logits, cache = decoder.forward([int(token)], cache)
        stepped.append(logits)
    return float(np.abs(np.concatenate(stepped) - expected).max() / np.abs(expected).max())

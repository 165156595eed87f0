"""A model's dimensions, read through transformers' config classes, never from raw config.json keys.

Families spell the same thing differently (GPT-2: n_layer, n_embd, n_head, n_positions; Gemma:
head_dim apart from hidden_size / heads; a multimodal config nests its text model). The config
classes map them to one vocabulary (attribute_map, get_text_config), which is what every stage
reads here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ortforge.names import MODEL_CONFIG_FILE
from tasks.core import paths
from tasks.core.errors import StageError


@dataclass(frozen=True)
class Architecture:
    model_type: str
    architecture: str  # the HF class, e.g. LlamaForCausalLM
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int  # positions the model was built for (max_position_embeddings)
    vocab_size: int
    tied_embeddings: bool
    sliding_window: int | None  # tokens a local-attention layer sees, where the family has them
    layer_types: tuple[str, ...] | None  # "sliding_attention" / "full_attention" per layer, where declared
    rope_thetas: tuple[float, ...] = ()  # rotary bases (Gemma 3: a global and a local one)


def read(hf_dir: Path, trust_remote_code: bool | None = None) -> Architecture:
    """The dimensions of the model in hf_dir; StageError when its config lacks one we need.
    trust_remote_code: None takes what download recorded (paths.remote_code_allowed)."""
    from transformers import AutoConfig

    if not (Path(hf_dir) / MODEL_CONFIG_FILE).is_file():
        raise StageError(
            f"{hf_dir} has no {MODEL_CONFIG_FILE}; run the download stage first (dvc repro download@<model>)"
        )
    if trust_remote_code is None:
        trust_remote_code = paths.remote_code_allowed(hf_dir)
    try:
        full = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    except (KeyError, ValueError) as error:  # an unknown model_type, remote code not opted in
        first_sentence = " ".join(str(error).split()).split(". ")[0]
        fix = "use a supported causal LM architecture"
        if not trust_remote_code and '"auto_map"' in (Path(hf_dir) / MODEL_CONFIG_FILE).read_text(encoding="utf-8"):
            fix = "it ships its own Python (auto_map): set models.<name>.trust_remote_code: true to run it"
        raise StageError(
            f"{hf_dir / MODEL_CONFIG_FILE}: transformers {installed_transformers()} cannot read it ({first_sentence}); "
            f"{fix}"
        ) from None
    return from_config(full, full.get_text_config(), hf_dir)


# Positions a family was trained on where its config has no max_position_embeddings: ALiBi needs
# no position table, so Bloom's configs never declare one (BLOOM's paper: 2,048-token sequences).
TRAINED_CONTEXT = {"bloom": 2048}


def from_config(full, config, hf_dir: Path | str = "<config>") -> Architecture:
    """The dimensions of a loaded config (full) and its text model's config."""
    heads = _required(config, "num_attention_heads", hf_dir)
    hidden = _required(config, "hidden_size", hf_dir)
    layer_types = getattr(config, "layer_types", None)
    return Architecture(
        model_type=config.model_type,
        architecture=(full.architectures or [type(full).__name__])[0],
        num_layers=_required(config, "num_hidden_layers", hf_dir),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        context_length=_context_length(config, hf_dir),
        vocab_size=_required(config, "vocab_size", hf_dir),
        tied_embeddings=bool(getattr(full, "tie_word_embeddings", False)),
        sliding_window=getattr(config, "sliding_window", None),
        layer_types=tuple(layer_types) if layer_types else None,
        rope_thetas=tuple(
            float(value) for name in ("rope_theta", "rope_local_base_freq") if (value := getattr(config, name, None))
        ),
    )


def expected_windows(arch: Architecture) -> list[int]:
    """Per layer, the tokens its attention sees (-1: all), as transformers' config declares."""
    if arch.sliding_window is None:
        return [-1] * arch.num_layers
    if arch.layer_types is None:  # e.g. Mistral: every layer slides
        return [arch.sliding_window] * arch.num_layers
    return [arch.sliding_window if kind == "sliding_attention" else -1 for kind in arch.layer_types]


def installed_transformers() -> str:
    import transformers

    return transformers.__version__


def _context_length(config, hf_dir: Path) -> int:
    """max_position_embeddings, or the family's trained context where its configs declare none."""
    if getattr(config, "max_position_embeddings", None) is None and config.model_type in TRAINED_CONTEXT:
        return TRAINED_CONTEXT[config.model_type]
    return _required(config, "max_position_embeddings", hf_dir)


def _required(config, name: str, hf_dir: Path) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        where = Path(hf_dir) / MODEL_CONFIG_FILE
        raise StageError(f"{where} ({config.model_type}) declares no {name}; add it to the config")
    return value

"""Random-weight models of real sizes, from real published configs, written straight to disk.

The scale benchmark and the memory tests need checkpoints the size of the models people run (0.5B
to 8B parameters) without a model hub. Each is the architecture's published config.json with
random weights (normal, std 0.02; norms at 1), stored as bfloat16 safetensors in shards of at most
5 GB, as the Hub's checkpoints are. Tensors are generated and written one at a time, so making an
8B model needs memory for one tensor, not 16 GB.

The tokenizer is SmolLM2's (49,152 tokens, copied from an HF folder given by the caller): every id
it produces is inside each config's own, larger vocabulary, whose full size the embedding keeps.
Random weights give near-flat logits: quality gates mean nothing on these models; sizes, memory
and speed do.

    python benchmarks/random_models.py --config llama-3.2-1b --tokenizer artifacts/smollm2-135m/hf --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np


# The published config.json of each model (Hugging Face Hub, Dec 2026), trimmed of generation-only keys.
def llama3(hidden: int, ffn: int, layers: int, heads: int, head_dim: int, tied: bool, rope_factor: float) -> dict:
    """A Llama 3.x config.json: the family's shared keys and one size's dimensions."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": head_dim,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": rope_factor,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": tied,
        "vocab_size": 128256,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 21,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "hidden_act": "silu",
    },
    "llama-3.2-1b": llama3(hidden=2048, ffn=8192, layers=16, heads=32, head_dim=64, tied=True, rope_factor=32.0),
    "llama-3.2-3b": llama3(hidden=3072, ffn=8192, layers=28, heads=24, head_dim=128, tied=True, rope_factor=32.0),
    "llama-3.1-8b": llama3(hidden=4096, ffn=14336, layers=32, heads=32, head_dim=128, tied=False, rope_factor=8.0),
    # 30.5B parameters, 3.3B active: 128 experts of 768 per layer, 8 routed per token.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
        "hidden_act": "silu",
        "attention_bias": False,
    },
}
SHARD_BYTES = 5_000_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
STD = 0.02


def mlp_shapes(stem: str, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{stem}.gate_proj.weight": (ffn, hidden),
        f"{stem}.up_proj.weight": (ffn, hidden),
        f"{stem}.down_proj.weight": (hidden, ffn),
    }


def sparse_layer(config: dict, index: int) -> bool:
    """Whether a Qwen-MoE layer routes to experts (else a dense MLP), as transformers decides."""
    return (
        config.get("num_experts", 0) > 0
        and index not in config.get("mlp_only_layers", [])
        and (index + 1) % config.get("decoder_sparse_step", 1) == 0
    )


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a LLaMA-style checkpoint (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE) holds, in the
    Hub's names and order."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    biased = config["model_type"] == "qwen2" or config.get("attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        stem = f"model.layers.{i}"
        shapes |= {
            f"{stem}.input_layernorm.weight": (hidden,),
            f"{stem}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{stem}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{stem}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{stem}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{stem}.post_attention_layernorm.weight": (hidden,),
        }
        if config["model_type"] in ("qwen3", "qwen3_moe"):  # an RMS norm over each head of q and k
            shapes |= {f"{stem}.self_attn.q_norm.weight": (head_dim,), f"{stem}.self_attn.k_norm.weight": (head_dim,)}
        if sparse_layer(config, i):
            shapes[f"{stem}.mlp.gate.weight"] = (config["num_experts"], hidden)
            for expert in range(config["num_experts"]):
                shapes |= mlp_shapes(f"{stem}.mlp.experts.{expert}", hidden, config["moe_intermediate_size"])
        else:
            shapes |= mlp_shapes(f"{stem}.mlp", hidden, ffn)
        if biased:
            for name, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                shapes[f"{stem}.self_attn.{name}_proj.bias"] = (rows,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def checkpoint_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))


def parameter_count(config: dict) -> int:
    return sum(int(np.prod(shape)) for shape in tensor_shapes(config).values())


def active_parameter_count(config: dict) -> int:
    """Weights one token reads: all but the experts it is not routed to."""
    shapes = tensor_shapes(config)
    routed = sum(int(np.prod(shape)) for name, shape in shapes.items() if ".experts." in name)
    reached = routed * config.get("num_experts_per_tok", 0) // max(config.get("num_experts", 1), 1)
    return parameter_count(config) - routed + reached


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even as torch does."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


CHUNK_VALUES = 1 << 24  # generated and converted at a time: 64 MB of float32


def random_values(rng: np.random.Generator, name: str, count: int) -> Iterator[np.ndarray]:
    """The tensor's values in chunks: a vocabulary matrix of 8B is 2 GB of float32 alone."""
    for start in range(0, count, CHUNK_VALUES):
        size = min(CHUNK_VALUES, count - start)
        if name.endswith("norm.weight"):
            yield np.ones(size, np.float32)
        else:
            yield rng.standard_normal(size, dtype=np.float32) * np.float32(STD)


def shards(shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """Tensor names per file, in order, each file at most SHARD_BYTES of bfloat16 data."""
    files, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if current and size + nbytes > SHARD_BYTES:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return files + [current]


def write_safetensors(path: Path, names: list[str], shapes: dict, rng: np.random.Generator) -> None:
    """One safetensors file, its header first, then each tensor generated and written in turn."""
    header, offset = {}, 0
    for name in names:
        nbytes = 2 * int(np.prod(shapes[name]))
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name in names:
            for chunk in random_values(rng, name, int(np.prod(shapes[name]))):
                handle.write(to_bfloat16_bits(chunk).tobytes())


def write_model(config: str | dict, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """A random-weight HF folder of a config (a name from CONFIGS, or a config.json's content), with
    the tokenizer in tokenizer_dir."""
    config = dict(CONFIGS[config] if isinstance(config, str) else config)
    tokenizer_config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    ids = {token["content"]: int(i) for i, token in tokenizer_config.get("added_tokens_decoder", {}).items()}
    config |= {
        "torch_dtype": "bfloat16",
        "bos_token_id": ids.get(tokenizer_config.get("bos_token"), 1),
        "eos_token_id": ids.get(tokenizer_config.get("eos_token"), 2),
    }
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    files = shards(shapes)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for index, names in enumerate(files):
        file = "model.safetensors" if len(files) == 1 else f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
        write_safetensors(out / file, names, shapes, rng)
        weight_map |= {name: file for name in names}
    if len(files) > 1:
        total = 2 * sum(int(np.prod(shape)) for shape in shapes.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2), encoding="utf-8")
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--tokenizer", type=Path, required=True, help="an HF folder whose tokenizer to copy")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_model(args.config, args.tokenizer, args.out, args.seed)
    print(f"{args.out}: {args.config}, {parameter_count(CONFIGS[args.config]) / 1e9:.2f}B parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tiny random models for tests, built from real architecture configs in seconds and offline:
a byte-level BPE tokenizer trained on the evaluation text, a LLaMA-style model (and a Qwen2-style
one, for a repository that builds two architectures), and the LLaMA model written as a GGUF file
the way llama.cpp's converter lays it out, with that byte-level vocabulary or with a SentencePiece
BPE one (as Gemma and LLaMA 2 ship)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
VOCAB_SIZE = 384
# The SentencePiece vocabulary: turn markers as Gemma's (CONTROL) and pieces matched on the raw text
# before anything else (USER_DEFINED), among them Gemma's newline run and an HTML tag.
SPM_CONTROL = ["<start_of_turn>", "<end_of_turn>"]
SPM_USER_DEFINED = ["\n\n", "<table>"]


def train_tokenizer(text_path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(text_path)], trainer)
    return tokenizer


def llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaConfig(**(values | overrides))


def qwen2_config(**overrides):
    """A Qwen2-style config: biased q/k/v projections, a different rotary base, untied output layer."""
    from transformers import Qwen2Config

    values = llama_config().to_dict() | {"rope_theta": 1000000.0, "tie_word_embeddings": False}
    for key in ("architectures", "model_type", "transformers_version", "head_dim", "mlp_bias", "attention_bias"):
        values.pop(key, None)
    return Qwen2Config(**(values | overrides))


def build_hf_model(
    folder: Path, text_path: Path, seed: int = 0, architecture: str = "llama", **config_overrides
) -> Path:
    """Save a tiny random model (LLaMA- or Qwen2-style) with its tokenizer as a plain HF folder."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if architecture == "qwen2":
        model = Qwen2ForCausalLM(qwen2_config(**config_overrides)).eval()
    else:
        model = LlamaForCausalLM(llama_config(**config_overrides)).eval()
    with torch.no_grad():  # larger-than-default weights give logits with real spread
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.08)
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases start at zero; make them matter
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(text_path),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tokenizer.save_pretrained(folder)
    return folder


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its rotary layout; transformers undoes it on load.
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(hf_dir: Path, path: Path, add_bos: bool = False, pre: str = "gpt2") -> Path:
    """Write the HF model in hf_dir as a float32 GGUF file with a gpt2-style tokenizer."""
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    writer = _llama_writer(path, config)
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([token for token, _ in vocab])
    special = {i for i, _ in enumerate(SPECIAL_TOKENS)}
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(vocab))]
    )
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos)
    _finish_gguf(writer, config, load_file(hf_dir / "model.safetensors"))
    return path


def train_sentencepiece(text_path: Path, prefix: Path, add_dummy_prefix: bool = False) -> Path:
    """Train a tiny SentencePiece BPE model (<prefix>.model) with byte fallback on text_path."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        input=str(text_path),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # llama.cpp applies no normalizer; nor may the original
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        control_symbols=SPM_CONTROL,
        user_defined_symbols=SPM_USER_DEFINED,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def write_spm_gguf(path: Path, text_path: Path, add_space_prefix: bool = False, seed: int = 0) -> Path:
    """Write a tiny random LLaMA as a float32 GGUF file with a SentencePiece ("llama") vocabulary.

    The SentencePiece model it is converted from is trained on text_path and left beside the GGUF
    file as <name>.model (trained with add_dummy_prefix = add_space_prefix), to compare against."""
    import sentencepiece
    import torch
    from transformers import LlamaForCausalLM

    processor = sentencepiece.SentencePieceProcessor(
        model_file=str(train_sentencepiece(text_path, path.with_suffix(""), add_space_prefix))
    )
    tokens, scores, types = _sentencepiece_vocab(processor)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab_size=len(tokens), pad_token_id=None)).eval()
    tensors = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    writer = _llama_writer(path, model.config.to_dict())
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(processor.bos_id())
    writer.add_eos_token_id(processor.eos_id())
    writer.add_unk_token_id(processor.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    _finish_gguf(writer, model.config.to_dict(), tensors)
    return path


def _sentencepiece_vocab(processor) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and types as llama.cpp's converter writes them (user-defined pieces as listed
    in an HF tokenizer_config: USER_DEFINED, with U+2581 written back as a space)."""
    import gguf

    tokens, scores, types = [], [], []
    for i in range(processor.get_piece_size()):
        piece, kind = processor.id_to_piece(i), gguf.TokenType.NORMAL
        if processor.is_unknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif processor.is_control(i):
            kind = gguf.TokenType.CONTROL
        elif processor.is_byte(i):
            kind = gguf.TokenType.BYTE
        elif piece in SPM_USER_DEFINED:
            kind, piece = gguf.TokenType.USER_DEFINED, piece.replace("\u2581", " ")
        tokens.append(piece)
        scores.append(processor.get_score(i))
        types.append(kind)
    return tokens, scores, types


def _llama_writer(path: Path, config: dict):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    return writer


def _finish_gguf(writer, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """Add the LLaMA weights under llama.cpp's names, write the file and close it."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    for i in range(config["num_hidden_layers"]):
        prefix, block = f"model.layers.{i}.", f"blk.{i}."
        names |= {
            prefix + "input_layernorm.weight": block + "attn_norm.weight",
            prefix + "self_attn.q_proj.weight": block + "attn_q.weight",
            prefix + "self_attn.k_proj.weight": block + "attn_k.weight",
            prefix + "self_attn.v_proj.weight": block + "attn_v.weight",
            prefix + "self_attn.o_proj.weight": block + "attn_output.weight",
            prefix + "post_attention_layernorm.weight": block + "ffn_norm.weight",
            prefix + "mlp.gate_proj.weight": block + "ffn_gate.weight",
            prefix + "mlp.up_proj.weight": block + "ffn_up.weight",
            prefix + "mlp.down_proj.weight": block + "ffn_down.weight",
        }
    for hf_name, gguf_name in names.items():
        weights = tensors[hf_name].astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            weights = _llama_cpp_permute(weights, heads)
        elif hf_name.endswith("k_proj.weight"):
            weights = _llama_cpp_permute(weights, kv_heads)
        writer.add_tensor(gguf_name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

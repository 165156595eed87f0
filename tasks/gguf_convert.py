"""Turn a GGUF file into a plain HF folder: dequantized safetensors weights, config, and a tokenizer
that matches the GGUF's own metadata.

transformers 4.57 converts GGUF tokenizers wrongly for gpt2-style vocabularies: it adds a BOS token
the model never saw (tokenizer.ggml.add_bos_token is false), takes the BOS id as end-of-sequence,
and can leave a copy of the whole GGUF as tokenizer.model. The metadata is the truth; we rebuild the
special tokens and the post-processor from it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ortforge.manifest import sha256_file
from tasks.errors import StageError
from tasks.weights import check_gguf_header

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    tokenizer_model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    tokens: list[str]
    special_ids: dict[str, int]  # bos/eos/unk/pad -> id, as far as the file declares them
    add_bos: bool
    chat_template: str | None


def read_info(path: Path) -> GGUFInfo:
    """Parse the GGUF header and check every tensor's bytes are in the file (truncation shows here)."""
    from gguf import GGUFReader

    check_gguf_header(path)
    try:
        reader = GGUFReader(path)
    except Exception as error:  # the reader raises bare ValueError/IndexError on damaged files
        raise StageError(f"GGUF file {path} is truncated or corrupt ({error}); re-download it") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise StageError(f"GGUF file {path} is truncated at tensor {tensor.name}; re-download it")

    def field(key: str, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    special = {}
    for name in ("bos", "eos", "unknown", "padding"):
        value = field(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            special[name] = int(value)
    return GGUFInfo(
        architecture=str(field("general.architecture", "")),
        tokenizer_model=str(field("tokenizer.ggml.model", "")),
        tokens=list(field("tokenizer.ggml.tokens", [])),
        special_ids=special,
        add_bos=bool(field("tokenizer.ggml.add_bos_token", True)),
        chat_template=field("tokenizer.chat_template"),
    )


def check_supported(info: GGUFInfo, path: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if info.architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise StageError(
            f"GGUF file {path} holds architecture `{info.architecture}`, which transformers cannot load; "
            f"supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}"
        )


def inspect(path: Path, expected_sha256: str | None = None) -> tuple[GGUFInfo, dict]:
    """Check the file (hash, structure, architecture) without loading weights; return its record."""
    digest = sha256_file(path)
    if expected_sha256 and digest != expected_sha256:
        raise StageError(
            f"GGUF file {path} has sha256 {digest}, params.yaml expects {expected_sha256}; "
            f"re-download the file or update source.sha256"
        )
    info = read_info(path)
    check_supported(info, path)
    return info, {"kind": "gguf", "file": path.name, "sha256": digest, "architecture": info.architecture}


def convert(path: Path, info: GGUFInfo, out_dir: Path) -> None:
    """Write weights, config and tokenizer of the (inspected) GGUF at path into out_dir."""
    from transformers import AutoModelForCausalLM

    log.info("dequantizing %s (%s) to float32", path.name, info.architecture)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    _set_special_ids(model, info)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(path, info, out_dir)


def _set_special_ids(model, info: GGUFInfo) -> None:
    ids = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    for attr, key in ids.items():
        if key in info.special_ids:
            setattr(model.config, attr, info.special_ids[key])
            setattr(model.generation_config, attr, info.special_ids[key])


def save_tokenizer(path: Path, info: GGUFInfo, out_dir: Path) -> None:
    from tokenizers import decoders, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    converted = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    backend = converted.backend_tokenizer
    byte_level = info.tokenizer_model == "gpt2"
    if byte_level:
        backend.decoder = decoders.ByteLevel()
    if not info.add_bos:
        backend.post_processor = processors.ByteLevel(trim_offsets=False) if byte_level else processors.Sequence([])

    def token(key: str) -> str | None:
        index = info.special_ids.get(key)
        return info.tokens[index] if index is not None and index < len(info.tokens) else None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=info.chat_template,
    )
    tokenizer.save_pretrained(out_dir)

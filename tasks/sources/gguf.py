"""Turn a GGUF file into a plain HF folder: dequantized safetensors weights, config, and a tokenizer
that matches the GGUF's own metadata.

transformers loads the weights; the tokenizer is built by tasks/sources/tokenizer.py (transformers 4.57
converts GGUF tokenizers wrongly) and checked against an independent reference on the parity text
before anything is written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ortforge.manifest import sha256_file
from tasks.core.errors import StageError
from tasks.core.paths import PARITY_TEXT
from tasks.sources import tokenizer, tokenizer_reference
from tasks.sources.tokenizer import Vocab
from tasks.sources.weight_files import check_gguf_header

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    vocab: Vocab


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

    architecture = reader.fields.get("general.architecture")
    return GGUFInfo(
        architecture=str(architecture.contents()) if architecture is not None else "",
        vocab=tokenizer.read_vocab(reader, path),
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


def convert(path: Path, info: GGUFInfo, out_dir: Path) -> dict:
    """Write weights, config and tokenizer of the (inspected) GGUF at path into out_dir; return the
    tokenizer parity check's record."""
    import torch
    from transformers import AutoModelForCausalLM

    built = tokenizer.build(info.vocab)
    parity = tokenizer_reference.check_parity(built.backend_tokenizer, info.vocab, tokenizer_reference.parity_text())
    log.info("tokenizer equals %s on %d tokens of %s", parity["reference"], parity["tokens"], PARITY_TEXT)
    log.info("dequantizing %s (%s) to float32", path.name, info.architecture)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    _set_special_ids(model, info.vocab.special_ids)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save(built, out_dir)
    return {**parity, "parity_text": PARITY_TEXT.as_posix(), "equal": True}


def _set_special_ids(model, special_ids: dict[str, int]) -> None:
    ids = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    for attr, key in ids.items():
        if key in special_ids:
            setattr(model.config, attr, special_ids[key])
            setattr(model.generation_config, attr, special_ids[key])

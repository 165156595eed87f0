"""Build the Hugging Face tokenizer of a GGUF file from the file's own tokenizer metadata.

Reads the tokenizer.ggml.* keys of a GGUF file (tokens, scores, token types, merges, pre-tokenizer
name, BOS/EOS/space-prefix flags, special ids) and tokenizer.chat_template; writes tokenizer.json,
tokenizer_config.json and special_tokens_map.json (and chat_template.jinja) into an HF folder.

We don't use transformers' GGUF converter: 4.57 builds a Unigram model for SentencePiece BPE
vocabularies (Gemma 3 splits "The capital of France is" into 11 tokens instead of 6), ignores the
pre-tokenizer of byte-level ones (SmolLM2 must split digits one by one) and adds a BOS the file says
not to add. Instead we build what llama.cpp runs, for the two vocabulary kinds it calls "llama"
(SentencePiece BPE with scores) and "gpt2" (byte-level BPE with merges and a named pre-tokenizer);
tasks/sources/tokenizer_reference.py checks the result against independent implementations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tasks.core.errors import StageError

log = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (gguf.TokenType; llama.cpp's LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp splits these off the text before tokenizing the rest (tokenizer_st_partition)
SPECIAL_TYPES = (CONTROL, USER_DEFINED, UNKNOWN)

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]  # applied in turn; matches and the text between them both become pieces
    ignore_merges: bool = False  # a piece that is a token as a whole is taken as it is
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_LLAMA3 = PreTokenizer((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2_REGEX,))
_GPT2 = PreTokenizer((GPT2_REGEX,))
# tokenizer.ggml.pre values, with the regexes llama.cpp (llm_tokenizer_bpe) uses for each
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": PreTokenizer((r"\p{N}", GPT2_REGEX)),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
KINDS = {"llama": "SentencePiece BPE", "gpt2": "byte-level BPE"}  # tokenizer.ggml.model values


@dataclass(frozen=True, eq=False)
class Vocab:
    """A GGUF file's tokenizer, as llama.cpp reads it (defaults included)."""

    model: str  # a KINDS key
    tokens: list[str]
    types: list[int]  # a token type per token
    scores: list[float]  # "llama": the higher, the earlier two pieces merge into this token
    merges: list[str]  # "gpt2": "left right", earliest first
    pre: str  # "gpt2": a PRE_TOKENIZERS key
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool  # "llama": a space goes before the text and after each special token
    special_ids: dict[str, int]  # bos/eos/unknown/padding -> id, as far as the file declares them
    chat_template: str | None

    def token(self, key: str) -> str | None:
        index = self.special_ids.get(key)
        return self.tokens[index] if index is not None else None

    def special(self) -> list[int]:
        return [i for i, kind in enumerate(self.types) if kind in SPECIAL_TYPES]


def read_vocab(reader, path: Path) -> Vocab:
    """The tokenizer of the GGUF file at path (opened as reader); refuses kinds we cannot rebuild."""

    def field(key: str, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    model, pre = str(field("tokenizer.ggml.model", "")), str(field("tokenizer.ggml.pre", "default"))
    _check_kind(path, model, pre)
    tokens = field("tokenizer.ggml.tokens", [])
    vocab = Vocab(
        model=model,
        tokens=tokens,
        types=field("tokenizer.ggml.token_type") or [NORMAL] * len(tokens),
        scores=field("tokenizer.ggml.scores") or [],
        merges=field("tokenizer.ggml.merges") or [],
        pre=pre,
        **_flags(field, model, pre),
        special_ids=_special_ids(field, path, len(tokens)),
        chat_template=field("tokenizer.chat_template"),
    )
    if model == "llama" and len(vocab.scores) != len(tokens):
        raise StageError(f"GGUF file {path} has a SentencePiece vocabulary without a score per token; re-convert it")
    if model == "gpt2" and not vocab.merges:
        raise StageError(f"GGUF file {path} has a byte-level BPE vocabulary without merges; re-convert it")
    return vocab


def _check_kind(path: Path, model: str, pre: str) -> None:
    if model not in KINDS:
        kinds = ", ".join(f"{name} ({kind})" for name, kind in KINDS.items())
        raise StageError(
            f"GGUF file {path} has tokenizer.ggml.model `{model}`, which ortforge cannot rebuild; supported: {kinds}"
        )
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise StageError(
            f"GGUF file {path} has tokenizer.ggml.pre `{pre}`, a pre-tokenizer ortforge does not know; "
            f"known: {', '.join(PRE_TOKENIZERS)}"
        )


def _flags(field, model: str, pre: str) -> dict[str, bool]:
    """add_bos/add_eos/add_space_prefix as the file says, or llama.cpp's defaults."""
    llama = model == "llama"
    default_bos = True if llama else PRE_TOKENIZERS[pre].add_bos
    return {
        "add_bos": bool(field("tokenizer.ggml.add_bos_token", default_bos)),
        "add_eos": bool(field("tokenizer.ggml.add_eos_token", False)),
        "add_space_prefix": llama and bool(field("tokenizer.ggml.add_space_prefix", True)),
    }


def _special_ids(field, path: Path, n_tokens: int) -> dict[str, int]:
    special = {}
    for name in ("bos", "eos", "unknown", "padding"):
        value = field(f"tokenizer.ggml.{name}_token_id")
        if value is None:
            continue
        if not 0 <= int(value) < n_tokens:
            raise StageError(f"GGUF file {path} declares {name} token id {value}, outside its {n_tokens} tokens")
        special[name] = int(value)
    return special


def build(vocab: Vocab):
    """The transformers tokenizer (PreTrainedTokenizerFast) that tokenizes as llama.cpp does."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = _sentencepiece_bpe(vocab) if vocab.model == "llama" else _byte_level_bpe(vocab)
    tokenizer.add_tokens(  # matched on the raw text, leftmost-longest; add_tokens keeps `special`
        [AddedToken(vocab.tokens[i], special=vocab.types[i] != USER_DEFINED, normalized=False) for i in vocab.special()]
    )
    tokenizer.post_processor = _post_processor(vocab)
    template = {"chat_template": vocab.chat_template} if vocab.chat_template else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=vocab.token("bos"),
        eos_token=vocab.token("eos"),
        unk_token=vocab.token("unknown"),
        pad_token=vocab.token("padding"),
        add_bos_token=vocab.add_bos,  # recorded for readers of tokenizer_config.json; the post-processor acts
        add_eos_token=vocab.add_eos,
        **template,
    )


def _sentencepiece_bpe(vocab: Vocab):
    """BPE whose merge order is the pieces' scores, with byte fallback: SentencePiece BPE as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    unk = vocab.special_ids.get("unknown")
    model = models.BPE(
        _token_ids(vocab),
        _merges_by_score(vocab),
        unk_token=vocab.tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    prefix = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    return tokenizer


def _token_ids(vocab: Vocab) -> dict[str, int]:
    return {token: i for i, token in enumerate(vocab.tokens)}  # a repeated token keeps its last id, as in llama.cpp


def _merges_by_score(vocab: Vocab) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, the best-scored token first (as transformers orders them)."""
    ids = _token_ids(vocab)
    merges = []
    for i, token in enumerate(vocab.tokens):
        if ids[token] != i:
            continue
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ids and right in ids:
                merges.append((vocab.scores[i], k, len(right), left, right))
    merges.sort(key=lambda merge: merge[:3], reverse=True)  # stable: equal scores keep token order
    return [(left, right) for *_, left, right in merges]


def _byte_level_bpe(vocab: Vocab):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = PRE_TOKENIZERS[vocab.pre]
    try:
        model = models.BPE(_token_ids(vocab), split_merges(vocab.merges), ignore_merges=pre.ignore_merges)
    except Exception as error:  # tokenizers raises a bare Exception for a merge outside the vocabulary
        raise StageError(f"the GGUF's tokenizer merges do not fit its tokens ({error}); re-convert the file") from None
    tokenizer = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
    bytes_ = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits + [bytes_])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """("left", "right") per "left right" merge; the separator is the first space after the first character."""
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut > 0:
            pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _post_processor(vocab: Vocab):
    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)] if vocab.model == "gpt2" else []
    if vocab.add_bos or vocab.add_eos:
        steps.append(_template(vocab))
    return processors.Sequence(steps) if steps else None


def _template(vocab: Vocab):
    from tokenizers import processors

    wanted = [key for flag, key in ((vocab.add_bos, "bos"), (vocab.add_eos, "eos")) if flag]
    for key in wanted:
        if key not in vocab.special_ids:
            raise StageError(f"the GGUF's tokenizer.ggml.add_{key}_token is true but it declares no {key} token id")

    def sequence(name: str, type_id: int) -> list[str]:
        bos = [f"{vocab.token('bos')}:{type_id}"] if vocab.add_bos else []
        eos = [f"{vocab.token('eos')}:{type_id}"] if vocab.add_eos else []
        return bos + [f"${name}:{type_id}"] + eos

    return processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=sequence("A", 0) + sequence("B", 1),
        special_tokens=[(vocab.token(key), vocab.special_ids[key]) for key in wanted],
    )


def save(tokenizer, out_dir: Path) -> None:
    """Write the tokenizer files of an HF folder (never a tokenizer.model)."""
    tokenizer.save_pretrained(out_dir)
    log.info("wrote %s (%.1f MB)", out_dir / "tokenizer.json", (out_dir / "tokenizer.json").stat().st_size / 1e6)

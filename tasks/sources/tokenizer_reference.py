"""Independent tokenizers for the vocabulary of a GGUF file, to check the tokenizer.json built from
it: for SentencePiece BPE ("llama") the sentencepiece library on a model rebuilt from the file's
pieces, scores and types; for byte-level BPE ("gpt2") a small Python port of llama.cpp's
llm_tokenizer_bpe. Both first split the text on special tokens as llama.cpp does when it parses
them (tokenizer_st_partition), so `<start_of_turn>` in the text is one token.

Reads and writes no files; check_parity raises StageError at the first fragment whose ids differ.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tasks.core.errors import StageError
from tasks.core.paths import PARITY_TEXT
from tasks.sources.tokenizer import KINDS, PRE_TOKENIZERS, UNKNOWN, Vocab, split_merges

Encoder = Callable[[str], list[int]]


def parity_text(path: Path = PARITY_TEXT) -> str:
    if not path.is_file():
        raise StageError(f"the tokenizer parity text {path} is missing; run the stage from the repository root")
    return path.read_bytes().decode("utf-8")  # not read_text, which would turn its "\r\n" into "\n"


def reference_ids(vocab: Vocab, text: str) -> list[int]:
    """The ids llama.cpp gives text for this vocabulary (special tokens parsed, BOS/EOS as the file says)."""
    return reference_encoder(vocab)(text)


def reference_encoder(vocab: Vocab) -> Encoder:
    """reference_ids for many texts: the reference is built once."""
    encode_raw = _sentencepiece(vocab) if vocab.model == "llama" else _byte_level_bpe(vocab)
    specials = sorted(vocab.special(), key=lambda i: len(vocab.tokens[i].encode()), reverse=True)

    def encode(text: str) -> list[int]:
        ids = [vocab.special_ids["bos"]] if vocab.add_bos else []
        after_special = True
        for fragment in partition(text, specials, vocab.tokens):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids += encode_raw(" " + fragment if vocab.add_space_prefix and after_special else fragment)
            after_special = isinstance(fragment, int)
        return ids + ([vocab.special_ids["eos"]] if vocab.add_eos else [])

    return encode


def partition(text: str, specials: list[int], tokens: list[str]) -> list[str | int]:
    """text as raw fragments and special token ids: each special token, longest first, cut out of every fragment."""
    fragments: list[str | int] = [text] if text else []
    for token_id in specials:
        token, out = tokens[token_id], []
        for fragment in fragments:
            if isinstance(fragment, int) or token not in fragment:
                out.append(fragment)
                continue
            for k, part in enumerate(fragment.split(token)):
                out += ([token_id] if k else []) + ([part] if part else [])
        fragments = out
    return fragments


def _sentencepiece(vocab: Vocab) -> Encoder:
    from sentencepiece import SentencePieceProcessor

    try:
        processor = SentencePieceProcessor(model_proto=_model_proto(vocab).SerializeToString())
    except RuntimeError as error:
        raise StageError(f"sentencepiece cannot load the GGUF's vocabulary ({error}); re-convert the file") from None
    return processor.encode


def _model_proto(vocab: Vocab):
    """A SentencePiece BPE model of exactly the GGUF's pieces, normalizing nothing but spaces (to U+2581)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    piece = pb.ModelProto.SentencePiece
    kinds = {1: piece.NORMAL, 2: piece.UNKNOWN, 3: piece.CONTROL, 4: piece.USER_DEFINED, 5: piece.UNUSED, 6: piece.BYTE}
    # sentencepiece wants exactly one UNKNOWN piece; Gemma declares its <unk> as CONTROL
    unk = vocab.special_ids.get("unknown", vocab.types.index(UNKNOWN) if UNKNOWN in vocab.types else 0)
    proto = pb.ModelProto()
    spec = proto.trainer_spec
    spec.model_type, spec.byte_fallback, spec.vocab_size, spec.unk_id = pb.TrainerSpec.BPE, True, len(vocab.tokens), unk
    spec.bos_id = spec.eos_id = spec.pad_id = -1  # not looked up; BOS/EOS are added by reference_encoder
    normalizer = proto.normalizer_spec
    normalizer.name, normalizer.add_dummy_prefix, normalizer.remove_extra_whitespaces = "identity", False, False
    normalizer.escape_whitespaces = True
    for i, (token, score, kind) in enumerate(zip(vocab.tokens, vocab.scores, vocab.types, strict=True)):
        kind = piece.UNKNOWN if i == unk else piece.CONTROL if kind == UNKNOWN else kinds.get(kind, piece.NORMAL)
        proto.pieces.add(piece=token, score=score, type=kind)
    return proto


def _byte_level_bpe(vocab: Vocab) -> Encoder:
    """llama.cpp's llm_tokenizer_bpe_session::tokenize: regex pieces, bytes as GPT-2 characters, merges by rank."""
    import regex

    pre = PRE_TOKENIZERS[vocab.pre]
    patterns = [regex.compile(expression) for expression in pre.regexes]
    ranks = {pair: rank for rank, pair in reversed(list(enumerate(split_merges(vocab.merges))))}
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    chars = _bytes_to_unicode()

    def encode(text: str) -> list[int]:
        out = []
        for word in _split(text, patterns):
            word = "".join(chars[byte] for byte in word.encode("utf-8"))
            symbols = [word] if pre.ignore_merges and word in ids else _merge(list(word), ranks)
            for symbol in symbols:  # a symbol outside the vocabulary falls back to its characters
                out += [ids[symbol]] if symbol in ids else [ids[c] for c in symbol if c in ids]
        return out

    return encode


def _split(text: str, patterns) -> list[str]:
    """Each pattern in turn splits every piece into its matches and the text between them."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            start = 0
            for match in pattern.finditer(piece):
                out += [piece[start : match.start()]] if match.start() > start else []
                out += [match.group()] if match.end() > match.start() else []
                start = match.end()
            out += [piece[start:]] if start < len(piece) else []
        pieces = out
    return pieces


def _merge(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the adjacent pair of lowest rank (the leftmost of equals) until no pair has a rank."""
    while len(symbols) > 1:
        pairs = ((ranks.get(pair), i) for i, pair in enumerate(zip(symbols, symbols[1:], strict=False)))
        best = min(((rank, i) for rank, i in pairs if rank is not None), default=None)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte (the alphabet byte-level BPE tokens are spelled in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (byte for byte in range(256) if byte not in printable)
    return {byte: chr(byte) for byte in printable} | {byte: chr(256 + n) for n, byte in enumerate(extra)}


def check_parity(tokenizer, vocab: Vocab, text: str) -> dict:
    """Raise StageError unless tokenizer (a tokenizers.Tokenizer) gives the reference's ids on each line of
    text and on the whole of it (where runs of newlines and tokens across lines show); return what
    was compared, for the download record."""
    encode = reference_encoder(vocab)
    lines = text.split("\n")
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    starts = [sum(len(line) for line in lines[:n]) for n in range(len(lines))]
    for start, fragment in [*zip(starts, lines, strict=True), (0, text)]:
        encoding, theirs = tokenizer.encode(fragment), encode(fragment)
        if encoding.ids != theirs:
            raise StageError(_difference(vocab, text, start, fragment, encoding, theirs))
    reference = "sentencepiece" if vocab.model == "llama" else "llama.cpp's BPE (Python port)"
    return {"kind": KINDS[vocab.model], "reference": reference, "lines": len(lines), "tokens": len(encode(text))}


def _difference(vocab: Vocab, text: str, start: int, fragment: str, encoding, theirs: list[int]) -> str:
    """One line: where the ids first differ, both sides' ids from there, and what to do."""
    ours = encoding.ids
    first = next((k for k, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    at = encoding.offsets[first][0] if first < len(ours) else len(fragment)
    line = text.count("\n", 0, start + at) + 1
    where = f"line {line} {_shorten(fragment)}" if fragment != text else f"the whole text (first at line {line})"
    reference = "sentencepiece" if vocab.model == "llama" else "llama.cpp's BPE (Python port)"
    return (
        f"the tokenizer built from the GGUF's {KINDS[vocab.model]} vocabulary differs from {reference} on the "
        f"parity text, {where} at {_shorten(fragment[at:], 24)} (token {first}): ours {ours[first : first + 8]}, "
        f"reference {theirs[first : first + 8]}; the model would see other ids than it was trained on, so use its "
        f"Hugging Face repository as the source (kind: hub) or teach tasks/sources/tokenizer.py this vocabulary"
    )


def _shorten(fragment: str, limit: int = 60) -> str:
    return repr(fragment[:limit] + ("…" if len(fragment) > limit else ""))

"""gguf_tokenizer and tokenizer_reference: the tokenizer built from a GGUF file's metadata gives the
ids of an independent reference (and of the original SentencePiece model) on the parity text, for
both vocabulary kinds; a tokenizer that differs, or a vocabulary we cannot rebuild, is refused in one
line before anything is written."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tasks import download
from tasks.core.params import ModelSpec
from tasks.core.stage import StageError
from tasks.sources import gguf, tokenizer_reference
from tasks.sources import tokenizer as gguf_tokenizer  # `tokenizer` names the built ones below
from tasks.sources.tokenizer import CONTROL
from tests import tiny_models
from tests.conftest import EVAL_TEXT, REPO

PARITY = tokenizer_reference.parity_text(REPO / tokenizer_reference.PARITY_TEXT)
LINES = [line for line in re.split(r"(?<=\n)", PARITY) if line]  # as check_parity cuts it: at "\n" only
KINDS = ["gpt2", "llama", "llama+space"]  # byte-level BPE; SentencePiece BPE without and with add_space_prefix


@pytest.fixture(scope="module")
def ggufs(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf_tokenizer")
    return {
        "gpt2": tiny_models.write_gguf(tiny_hf, folder / "bpe.gguf"),
        "llama": tiny_models.write_spm_gguf(folder / "spm.gguf", EVAL_TEXT),
        "llama+space": tiny_models.write_spm_gguf(folder / "spm_space.gguf", EVAL_TEXT, add_space_prefix=True),
    }


@pytest.fixture(scope="module")
def vocabs(ggufs) -> dict[str, gguf_tokenizer.Vocab]:
    return {kind: gguf.read_info(path).vocab for kind, path in ggufs.items()}


def backend(vocab: gguf_tokenizer.Vocab):
    return gguf_tokenizer.build(vocab).backend_tokenizer


def sentencepiece_of(gguf: Path):
    from sentencepiece import SentencePieceProcessor

    return SentencePieceProcessor(model_file=str(gguf.with_suffix(".model")))


def test_parity_text_holds_every_kind_of_text():
    kinds = [
        "\r\n",
        "\t\t",
        " " * 40,
        "\n" * 32,
        "<start_of_turn>",
        "<|im_end|>",
        "<table>",
        "\u200d",
        "\ufffd",
        "한국어",
    ]
    assert all(kind in PARITY for kind in kinds)
    assert 60 <= len(LINES) <= 110


@pytest.mark.parametrize("kind", KINDS)
def test_build_gives_reference_ids_on_parity_text(vocabs, kind):
    vocab = vocabs[kind]
    tokenizer = backend(vocab)
    assert tokenizer.encode(PARITY).ids == tokenizer_reference.reference_ids(vocab, PARITY)
    tokenizer_reference.check_parity(tokenizer, vocab, PARITY)


@pytest.mark.parametrize("kind", ["llama", "llama+space"])
def test_build_gives_original_sentencepiece_ids_away_from_special_tokens(ggufs, vocabs, kind):
    """Where the two differ by design: llama.cpp (and so we) read a control token written in the text
    as that token, where sentencepiece spells it out; and with add_space_prefix llama.cpp puts a space
    after every special or user-defined token and none before one that starts the text, where
    sentencepiece adds one space at the start."""
    vocab, original = vocabs[kind], sentencepiece_of(ggufs[kind])
    tokenizer = gguf_tokenizer.build(vocab)
    avoided = [vocab.tokens[i] for i in vocab.special() if vocab.add_space_prefix or vocab.types[i] == CONTROL]
    plain = [line for line in LINES if not any(token in line for token in avoided)]
    assert len(plain) > 0.8 * len(LINES)
    for line in plain:
        assert tokenizer(line, add_special_tokens=False).input_ids == original.encode(line), line
    if not vocab.add_space_prefix:  # user-defined "\n\n" and "<table>" match in both, across lines too
        assert tokenizer("".join(plain), add_special_tokens=False).input_ids == original.encode("".join(plain))
    assert len(tokenizer("<start_of_turn>", add_special_tokens=False).input_ids) == 1
    assert len(original.encode("<start_of_turn>")) > 1


def drop_first_merge(monkeypatch):
    merges_by_score = gguf_tokenizer._merges_by_score
    monkeypatch.setattr(gguf_tokenizer, "_merges_by_score", lambda vocab: merges_by_score(vocab)[1:])


def without_first_sentencepiece_merge(vocab, monkeypatch):
    drop_first_merge(monkeypatch)
    return vocab


DIFFERING = [
    ("byte-level with the wrong pre-tokenizer", "gpt2", lambda v, mp: dataclasses.replace(v, pre="default")),
    ("byte-level without its first merge", "gpt2", lambda v, mp: dataclasses.replace(v, merges=v.merges[1:])),
    ("sentencepiece without its first merge", "llama", without_first_sentencepiece_merge),
    ("sentencepiece with a space prefix", "llama", lambda v, mp: dataclasses.replace(v, add_space_prefix=True)),
    ("sentencepiece without BOS", "llama", lambda v, mp: dataclasses.replace(v, add_bos=False)),
]


@pytest.mark.parametrize("case, kind, spoil", DIFFERING, ids=[case[0] for case in DIFFERING])
def test_check_parity_names_first_differing_line(vocabs, monkeypatch, case, kind, spoil):
    vocab = vocabs[kind]
    tokenizer = backend(spoil(vocab, monkeypatch))
    with pytest.raises(StageError) as raised:
        tokenizer_reference.check_parity(tokenizer, vocab, PARITY)
    message = str(raised.value)
    assert "\n" not in message
    assert "on the parity text, line " in message and "kind: hub" in message
    assert "ours [" in message and "reference [" in message


def metadata_gguf(path: Path, model: str = "gpt2", pre: str = "gpt2") -> Path:
    """A GGUF file with a three-token vocabulary and no weights: enough for read_info."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_scores([0.0, 0.0, 1.0])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


REFUSED = [
    (
        "unknown tokenizer model",
        dict(model="bert"),
        r"tokenizer.ggml.model `bert`, which ortforge cannot rebuild; supported: llama \(SentencePiece BPE\), "
        r"gpt2 \(byte-level BPE\)$",
    ),
    (
        "unknown pre-tokenizer",
        dict(pre="mystery"),
        r"tokenizer.ggml.pre `mystery`, a pre-tokenizer ortforge does not know; known: default, gpt2, .*smollm",
    ),
]


@pytest.mark.parametrize("case, fields, message", REFUSED, ids=[case[0] for case in REFUSED])
def test_run_refuses_vocabulary_it_cannot_rebuild_in_one_line(tmp_path, case, fields, message):
    source = {"kind": "gguf", "path": str(metadata_gguf(tmp_path / "odd.gguf", **fields))}
    with pytest.raises(StageError, match=message) as raised:
        download.run(ModelSpec.model_validate({"source": source}), tmp_path / "out" / "hf")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("add_bos, add_eos", [(False, False), (True, False), (False, True), (True, True)])
def test_build_adds_bos_and_eos_as_the_file_says(vocabs, kind, add_bos, add_eos):
    vocab = dataclasses.replace(vocabs[kind], add_bos=add_bos, add_eos=add_eos)
    ids = gguf_tokenizer.build(vocab)("Hello world").input_ids
    bos, eos = vocab.special_ids["bos"], vocab.special_ids["eos"]
    assert (ids[0] == bos, ids[-1] == eos) == (add_bos, add_eos)
    assert ids == tokenizer_reference.reference_ids(vocab, "Hello world")


def test_reference_ids_when_unknown_token_is_declared_control(vocabs):
    """Gemma declares <unk> as CONTROL; sentencepiece needs one UNKNOWN piece, the declared unknown id."""
    vocab = vocabs["llama"]
    unknown = vocab.special_ids["unknown"]
    vocab = dataclasses.replace(vocab, types=[CONTROL if i == unknown else t for i, t in enumerate(vocab.types)])
    assert backend(vocab).encode(PARITY).ids == tokenizer_reference.reference_ids(vocab, PARITY)


def test_read_info_takes_flags_and_special_ids_from_the_file(vocabs):
    gpt2, llama = vocabs["gpt2"], vocabs["llama"]
    assert (gpt2.add_bos, gpt2.add_eos, gpt2.pre) == (False, False, "gpt2")  # write_gguf's add_bos_token: false
    assert (llama.add_bos, llama.add_eos, llama.add_space_prefix) == (True, False, False)
    assert vocabs["llama+space"].add_space_prefix
    assert gpt2.special_ids == {"bos": 1, "eos": 2, "unknown": 0, "padding": 2}
    assert (llama.token("bos"), llama.token("eos"), llama.token("unknown")) == ("<s>", "</s>", "<unk>")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decode_of_encode_gives_parity_text_back(vocabs, kind):
    tokenizer = gguf_tokenizer.build(vocabs[kind])
    ids = tokenizer(PARITY, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == PARITY


def test_decode_of_encode_gives_lines_back_with_space_prefix_away_from_special_tokens(vocabs):
    """With add_space_prefix each special token is followed by the space the tokenizer put there."""
    vocab = vocabs["llama+space"]
    tokenizer = gguf_tokenizer.build(vocab)
    specials = [vocab.tokens[i] for i in vocab.special()]
    for line in LINES:
        back = tokenizer.decode(tokenizer(line, add_special_tokens=False).input_ids, skip_special_tokens=False)
        assert (back == line) or any(token in line for token in specials), line


def test_run_writes_checked_sentencepiece_tokenizer(ggufs, vocabs, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.chdir(REPO)  # the parity text is a repository path, as dvc runs the stage
    out = tmp_path / "hf"
    download.run(ModelSpec.model_validate({"source": {"kind": "gguf", "path": str(ggufs["llama"])}}), out)
    assert not (out / "tokenizer.model").exists()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["tokenizer_class"], config["add_bos_token"], config["add_eos_token"]) == (
        "PreTrainedTokenizerFast",
        True,
        False,
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    line = "The licenses for most software<end_of_turn>\n\nare designed"
    assert tokenizer(line).input_ids == tokenizer_reference.reference_ids(vocabs["llama"], line)
    assert AutoConfig.from_pretrained(out).vocab_size == len(vocabs["llama"].tokens)


def test_run_fails_before_writing_when_tokenizer_differs_from_reference(ggufs, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    drop_first_merge(monkeypatch)
    source = {"kind": "gguf", "path": str(ggufs["llama"])}
    with pytest.raises(StageError, match=r"differs from sentencepiece on the parity text, line \d+ "):
        download.run(ModelSpec.model_validate({"source": source}), tmp_path / "out" / "hf")
    assert not (tmp_path / "out").exists()

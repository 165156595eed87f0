"""Greedy generation through the KV cache, and text streaming that never splits a character.

This is what an application imports to run an artifact: it needs onnxruntime, numpy and tokenizers
only (no torch, transformers, Prefect or DVC).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer

from ortforge.decoder import NOT_PICKLABLE, Decoder
from ortforge.greedy import greedy_tokens
from ortforge.names import GENERATION_CONFIG_FILE
from ortforge.session import SessionSettings, create_session


class IncrementalDetokenizer:
    """Turns a growing token sequence into text pieces, holding back bytes of an unfinished character.

    Decoding token by token would cut multi-byte UTF-8 characters (emoji, Hangul) in half; decoding
    a short window that ends in U+FFFD means the character is not complete yet.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        text = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]


class TextGenerator:
    """An artifact folder (model.onnx, tokenizer.json, generation_config.json) ready to generate.

    Safe to share between threads: the onnxruntime session is shared (its runs are thread-safe),
    and each thread gets its own decoder, so its own KV buffers and I/O binding. Not picklable: a
    process (spawn, fork or a worker pool) creates its own TextGenerator from the folder.
    """

    def __init__(self, model_dir: Path, settings: SessionSettings | None = None, prompt_lookup: int = 0):
        """prompt_lookup: check up to this many draft tokens looked up in the text per step (0: off)."""
        if prompt_lookup < 0:
            raise ValueError(f"prompt_lookup {prompt_lookup} must be >= 0 (0 turns prompt lookup off)")
        model_dir = Path(model_dir)
        self.prompt_lookup = prompt_lookup
        self.settings = settings or SessionSettings.for_artifact(model_dir)
        self.session = create_session(model_dir, self.settings)
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json; an artifact folder carries its model's tokenizer")
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.stop_ids = _eos_ids(model_dir / GENERATION_CONFIG_FILE)
        self._per_thread = threading.local()

    def __reduce__(self):
        raise TypeError(NOT_PICKLABLE)

    @property
    def decoder(self) -> Decoder:
        """This thread's decoder over the shared session, created on first use."""
        decoder = getattr(self._per_thread, "decoder", None)
        if decoder is None:
            decoder = self._per_thread.decoder = Decoder(self.session, prefill_chunk=self.settings.prefill_chunk)
        return decoder

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_prompt(self, prompt: str) -> list[int]:
        if not prompt:  # a tokenizer that adds BOS would turn it into a one-token prompt
            raise ValueError("the prompt is empty; give some text to continue")
        return self.encode(prompt)

    def checked_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """The prompt, once it is known to be non-empty and to leave room for max_new_tokens."""
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens); give some text to continue")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} must be at least 1")
        try:
            self.decoder.check_fits(len(prompt_ids) + max_new_tokens)
        except ValueError:
            raise ValueError(
                f"a {len(prompt_ids)}-token prompt plus {max_new_tokens} new tokens does not fit the model's "
                f"context of {self.decoder.context_length} positions; shorten the prompt or ask for fewer tokens"
            ) from None
        return prompt_ids

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        prompt_ids = self.checked_prompt(prompt_ids, max_new_tokens)
        return list(greedy_tokens(self.decoder, prompt_ids, max_new_tokens, self.stop_ids, self.prompt_lookup))

    def stream(self, prompt: str, max_new_tokens: int) -> Iterator[str]:
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        prompt_ids = self.checked_prompt(self.encode_prompt(prompt), max_new_tokens)
        tokens = greedy_tokens(self.decoder, prompt_ids, max_new_tokens, self.stop_ids, self.prompt_lookup)
        for token in tokens:
            piece = detokenizer.push(token)
            if piece:
                yield piece

    def generate(self, prompt: str, max_new_tokens: int) -> str:
        ids = self.generate_ids(self.encode_prompt(prompt), max_new_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _eos_ids(path: Path) -> tuple[int, ...]:
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)

"""Generation through the KV cache (greedy, or sampled; from a prompt or chat messages through the
model's chat template; up to stop strings), and text streaming that never splits a character.

This is what an application imports to run an artifact: it needs onnxruntime, numpy, tokenizers
and (for chat templates) Jinja2 only (no torch, transformers, Prefect or DVC).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from ortforge.chat import chat_pieces, render_chat, stop_strings, until_stop
from ortforge.decoder import NOT_PICKLABLE, Decoder, length_dependent_rope, proven_runs
from ortforge.greedy import greedy_tokens
from ortforge.names import GENERATION_CONFIG_FILE
from ortforge.sampling import Sampling, sampled_tokens
from ortforge.session import SessionSettings, create_session

GREEDY = Sampling()
# The most prompt tokens one run prefills where the artifact's measured prefill_chunk is 0 (whole:
# tuning measures a short prompt). onnxruntime's CPU GroupQueryAttention scores every query of a
# run against every key the run sees, the masked half too, so a prompt of N tokens in one run
# costs N x N scores (and holds them), where pieces of P cost about N x N / 2 + N x P / 2
# (benchmarks/prefill_pieces.py). Pieces are taken only where validate proved them.
LONG_PROMPT_PIECE = 256


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

    def flush(self) -> str:
        """What is held back once the tokens have ended (bytes that never completed a character
        decode as U+FFFD, as a whole decode shows them)."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        text = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
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
        model_dir = self.model_dir = Path(model_dir)
        self.prompt_lookup = prompt_lookup
        self.settings = settings or SessionSettings.for_artifact(model_dir)
        self.session = create_session(model_dir, self.settings)
        if not (model_dir / "tokenizer.json").is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json; an artifact folder carries its model's tokenizer")
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._plain: Tokenizer | None = None
        added = self.tokenizer.get_added_tokens_decoder().values()
        self._specials = [token.content for token in added if token.special]
        self.stop_ids = _eos_ids(model_dir / GENERATION_CONFIG_FILE)
        self.prefill_chunk = self.settings.prefill_chunk or LONG_PROMPT_PIECE  # tokens per prefill run, at most
        self.rope = length_dependent_rope(model_dir)  # past its limit, prompts run whole (ortforge.decoder)
        self.proven = proven_runs(model_dir)  # what validate proved: pieces, batched rows
        self._per_thread = threading.local()

    def __reduce__(self):
        raise TypeError(NOT_PICKLABLE)

    @property
    def decoder(self) -> Decoder:
        """This thread's decoder over the shared session, created on first use."""
        decoder = getattr(self._per_thread, "decoder", None)
        if decoder is None:
            decoder = Decoder(self.session, prefill_chunk=self.prefill_chunk, rope=self.rope, proven=self.proven)
            self._per_thread.decoder = decoder
        return decoder

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, prompt: str) -> list[int]:
        if not prompt:  # a tokenizer that adds BOS would turn it into a one-token prompt
            raise ValueError("the prompt is empty; give some text to continue")
        return self.encode(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """messages [{role, content}] through the model's chat template, up to the reply's start.
        The template writes the special tokens itself (transformers' apply_chat_template). A
        message that contains a special token's text (`<|im_end|>`...) is read as that text, never
        as the control token: a user cannot close their turn and open a system one."""
        if not any(self._special_text(message.get("content")) for message in messages):
            return self.encode(render_chat(self.model_dir, messages), add_special_tokens=False)
        ids: list[int] = []
        for text, is_content in chat_pieces(self.model_dir, messages):
            tokenizer = self._plain_text_tokenizer() if is_content else self.tokenizer
            ids += tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def _special_text(self, content) -> bool:
        return isinstance(content, str) and any(special in content for special in self._specials)

    def _plain_text_tokenizer(self) -> Tokenizer:
        """A copy of the tokenizer that reads special tokens' text as text (its own copy: a flag on
        the shared one would race with other threads' encodes)."""
        if self._plain is None:
            self._plain = Tokenizer.from_str(self.tokenizer.to_str())
            self._plain.encode_special_tokens = True
        return self._plain

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

    def tokens(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> Iterator[int]:
        """New token ids, lazily: greedy (with prompt lookup when asked) or sampled."""
        prompt_ids = self.checked_prompt(prompt_ids, max_new_tokens)
        if sampling.plain_greedy:
            return greedy_tokens(self.decoder, prompt_ids, max_new_tokens, self.stop_ids, self.prompt_lookup)
        if self.prompt_lookup:
            raise ValueError("prompt lookup drafts greedy tokens; drop prompt_lookup to sample or penalize repetition")
        return sampled_tokens(self.decoder, prompt_ids, max_new_tokens, self.stop_ids, sampling)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> list[int]:
        return list(self.tokens(prompt_ids, max_new_tokens, sampling))

    def stream_ids(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY, stop: Sequence[str] = ()
    ) -> Iterator[str]:
        """Text pieces of the continuation of prompt_ids, never splitting a character, ending before
        the first stop string (which is never shown)."""
        stops = stop_strings(stop)
        detokenizer = IncrementalDetokenizer(self.tokenizer)

        def pieces() -> Iterator[str]:
            for token in self.tokens(prompt_ids, max_new_tokens, sampling):
                if piece := detokenizer.push(token):
                    yield piece
            if rest := detokenizer.flush():
                yield rest

        yield from until_stop(pieces(), stops)

    def stream(
        self, prompt: str, max_new_tokens: int, sampling: Sampling = GREEDY, stop: Sequence[str] = ()
    ) -> Iterator[str]:
        return self.stream_ids(self.encode_prompt(prompt), max_new_tokens, sampling, stop)

    def generate(self, prompt: str, max_new_tokens: int, sampling: Sampling = GREEDY, stop: Sequence[str] = ()) -> str:
        if stop:
            return "".join(self.stream(prompt, max_new_tokens, sampling, stop))
        ids = self.generate_ids(self.encode_prompt(prompt), max_new_tokens, sampling)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(
        self, messages: list[dict], max_new_tokens: int, sampling: Sampling = GREEDY, stop: Sequence[str] = ()
    ) -> Iterator[str]:
        """The assistant's reply to messages, streamed."""
        return self.stream_ids(self.encode_chat(messages), max_new_tokens, sampling, stop)


def _eos_ids(path: Path) -> tuple[int, ...]:
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)

"""Structured output for `ortforge serve`: OpenAI's `response_format` (`json_object`, `json_schema`)
through llguidance, a maintained constrained-decoding library (Rust, no torch): each step, the
grammar's mask of the tokens that can continue a valid output sets every other logit to -inf before
the request's own sampler picks, so greedy and sampled replies alike parse and meet the schema
(unless max_tokens cuts them short: finish_reason "length", as OpenAI's). Once the grammar is
complete only an end-of-sequence token is allowed, so the reply ends there.

llguidance rather than outlines-core: both are on PyPI without torch; benchmarks/structured.py
measures both on the served model's tokenizer (the grammar's build and a step's mask) and
llguidance's mask is the one computed fast enough to sit in the decode loop. xgrammar needs torch.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from ortforge.api import RequestError, quoted
from ortforge.sampling import Sampler

# Compact JSON (no whitespace between tokens): a model cannot fill its reply with the whitespace a
# flexible grammar allows anywhere between tokens. A schema's own "x-guidance" options win.
FIXED_WHITESPACE = {"whitespace_flexible": False}


class Grammars:
    """Compiles response formats into matchers over one model's tokenizer (built once, on first use:
    about a second for a 50k-token vocabulary)."""

    def __init__(self, tokenizer_file: Path, stop_ids: tuple[int, ...]):
        self.tokenizer_file, self.stop_ids = Path(tokenizer_file), stop_ids
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                text = self.tokenizer_file.read_text(encoding="utf-8")
                self._tokenizer = llguidance.LLTokenizer(text, eos_token=list(self.stop_ids) or None)
        return self._tokenizer

    def matcher(self, schema: dict):
        """A fresh matcher for replies that are JSON meeting `schema`; RequestError when the
        schema cannot be compiled (its error quoted)."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=FIXED_WHITESPACE)
            matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        except (ValueError, TypeError) as error:
            raise RequestError(f"response_format: the schema cannot be used ({quoted(str(error))})") from None
        if matcher.is_error():
            message = quoted(matcher.get_error())
            raise RequestError(f"response_format: the schema cannot be used ({message})", param="response_format")
        return matcher


class ConstrainedSampler:
    """A request's sampler that only ever picks tokens the grammar allows, advancing the grammar
    with each pick (it stands in for ortforge.sampling.Sampler in the scheduler's Job)."""

    def __init__(self, sampler: Sampler, matcher):
        self.sampler, self.matcher = sampler, matcher

    def pick(self, logits: np.ndarray, seen) -> int:
        allowed = self.allowed(logits.shape[-1])
        token = self.sampler.pick(np.where(allowed, logits, -np.inf), seen)
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused the token it allowed ({self.matcher.get_error()})")
        return token

    def allowed(self, vocab: int) -> np.ndarray:
        """One boolean per logit: whether the grammar lets that token come next (a logit past the
        tokenizer's vocabulary, the model's padding, never does)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.zeros(vocab, dtype=bool)
        allowed[: min(vocab, bits.size)] = bits[:vocab].astype(bool)
        if not allowed.any():
            raise RuntimeError(f"the grammar allows no token ({self.matcher.get_error() or 'it has stopped'})")
        return allowed

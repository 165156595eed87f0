"""OpenAI's `logprobs` for `ortforge serve`: each reply token's log-probability and, when asked, the
most likely alternatives at that step.

The figures are the model's own distribution at each step (the log-softmax of its logits, in
float64), before temperature, top-k/top-p, the repetition penalty or a response_format's mask
shape what is sampled: what the model thought of each token, as vLLM's default ("raw") logprobs.
A sampled token the model found unlikely shows as such.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ortforge.sampling import finite

MAX_TOP_CHAT = 20  # OpenAI's limits on top_logprobs (chat) and logprobs (completions)
MAX_TOP_COMPLETIONS = 5


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the step's most likely tokens, most likely first


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    values = finite(logits)
    shifted = values - values.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(-logprobs, min(top, logprobs.size - 1))[:top]
        ids = ids[np.argsort(-logprobs[ids], kind="stable")]
        best = tuple((int(i), float(logprobs[i])) for i in ids)
    return TokenLogprob(token, float(logprobs[token]), best)


class LogprobSampler:
    """A request's sampler (ortforge.sampling.Sampler, or a ConstrainedSampler around one) that also
    notes each picked token's log-probability, in pick order, for the server to take (`taken`)."""

    def __init__(self, sampler, top: int):
        self.sampler, self.top = sampler, top
        self.noted: deque[TokenLogprob] = deque()

    def pick(self, logits: np.ndarray, seen) -> int:
        token = self.sampler.pick(logits, seen)
        self.noted.append(token_logprob(logits, token, self.top))
        return token

    def taken(self) -> TokenLogprob:
        return self.noted.popleft()


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(tokenizer, noted: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs` object for these tokens."""

    def entry(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(item.token, item.logprob), "top_logprobs": [entry(token, value) for token, value in item.top]}
        for item in noted
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, noted: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's completions `logprobs` object for these tokens; offset: the characters of the reply
    before them (text_offset counts from the reply's start)."""
    tokens = [token_text(tokenizer, item.token) for item in noted]
    offsets = list(np.cumsum([0, *map(len, tokens)])[:-1] + offset) if tokens else []
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in noted],
        "top_logprobs": [{token_text(tokenizer, t): value for t, value in item.top} for item in noted],
        "text_offset": [int(o) for o in offsets],
    }

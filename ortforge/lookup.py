"""Prompt lookup decoding: greedy generation that checks several tokens per model run where the
text repeats itself (quotes from the prompt, code being edited, a model repeating its own lines).

After each token, the tokens that followed the latest earlier occurrence of the text's last
NGRAM_SIZES tokens are a draft. One run scores the new token and the draft together; the draft's
longest prefix that greedy decoding would have produced is kept, plus the model's own next token.
A run costs more than a one-token step (about 1.6x for four tokens on SmolLM2 int4), so it pays
when drafts are accepted; where nothing repeats no draft is proposed and a step is a plain step.

The tokens are greedy decoding's as far as a many-token run computes the same logits as one-token
steps: exactly so in float, to rounding in weight-only variants (their kernels sum in another
order, which can flip a near tie: SmolLM2 int4 first differs at token 32 of the bench workload).
Dynamic int8 variants (int8_dynamic, int8_smooth) quantize all rows of a run with one scale, so
their tokens drift sooner (int8_smooth: token 5 to 8).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

NGRAM_SIZES = (3, 2)  # longest match first: a longer context predicts its continuation better


class PromptLookup:
    """Where each n-gram of the text last occurred, updated as tokens arrive (O(1) per token)."""

    def __init__(self, tokens: Iterable[int]):
        self.tokens: list[int] = []
        self.continued_at: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAM_SIZES}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            # The n-grams that end just before the new token now have a continuation; the text's
            # last n-gram has none yet, so a draft never proposes the text's own end.
            end = len(self.tokens) - 1
            for n, positions in self.continued_at.items():
                if end >= n:
                    positions[tuple(self.tokens[end - n : end])] = end

    def draft(self, limit: int) -> list[int]:
        """Up to limit tokens that followed the latest earlier occurrence of the last n tokens."""
        if limit <= 0:
            return []
        for n, positions in self.continued_at.items():
            start = positions.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + limit]
        return []


def accepted_prefix(predicted: np.ndarray, draft: list[int]) -> int:
    """How many draft tokens agree with the model's argmax before the first disagreement."""
    count = 0
    while count < len(draft) and int(predicted[count]) == draft[count]:
        count += 1
    return count


def lookup_greedy_tokens(
    decoder, prompt_ids: list[int], max_new_tokens: int, stop_ids: Iterable[int] = (), draft_tokens: int = 3
) -> Iterator[int]:
    """Yield up to max_new_tokens greedy tokens, checking up to draft_tokens looked-up tokens per run."""
    stop = set(stop_ids)
    lookup = PromptLookup(prompt_ids)
    logits, cache = decoder.forward(prompt_ids, decoder.empty_cache(), last_only=True)
    pending, produced = [int(np.argmax(logits[-1]))], 0
    while True:
        for token in pending:
            yield token
            produced += 1
            if token in stop or produced == max_new_tokens:
                return
        lookup.extend(pending)
        draft = lookup.draft(min(draft_tokens, max_new_tokens - produced - 1))
        if not decoder.runs_like_any(cache.length + 1 + len(draft)):
            draft = []  # past a length-dependent rope's limit only one-token steps are the reference's
        logits, cache = decoder.forward([pending[-1], *draft], cache, last_only=not draft)
        predicted = np.argmax(logits, axis=-1)
        accepted = accepted_prefix(predicted, draft)
        cache = decoder.rewind(cache, cache.length - len(draft) + accepted)
        pending = [*draft[:accepted], int(predicted[accepted])]

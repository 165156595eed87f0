"""Greedy decoding over any decoder with `empty_cache()` and `forward(token_ids, cache, last_only)`:
one prefill pass, then one step per token (or, with prompt lookup, several). Apart from the
runtime's session so that the build's reference stage, which runs it on PyTorch, does not depend
on onnxruntime."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from ortforge.lookup import lookup_greedy_tokens


def greedy_tokens(
    decoder,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    prompt_lookup: int = 0,
) -> Iterator[int]:
    """Yield up to max_new_tokens argmax tokens; one prefill pass, then one step per token, or with
    prompt_lookup > 0 up to that many looked-up draft tokens checked per step (ortforge.lookup)."""
    if prompt_lookup > 0:
        yield from lookup_greedy_tokens(decoder, prompt_ids, max_new_tokens, stop_ids, prompt_lookup)
        return
    stop = set(stop_ids)
    logits, cache = decoder.forward(prompt_ids, decoder.empty_cache(), last_only=True)
    for produced in range(1, max_new_tokens + 1):
        token = int(np.argmax(logits[-1]))
        yield token
        if token in stop or produced == max_new_tokens:
            return
        logits, cache = decoder.forward([token], cache, last_only=True)

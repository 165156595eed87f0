"""Choosing each next token: greedy, or sampled with temperature, top-k, top-p and a repetition
penalty from a seeded generator (the same seed gives the same tokens).

The order is Hugging Face generate's and llama.cpp's: the penalty on the raw logits, then the
temperature, then top-k, then top-p over what is left. Greedy (temperature 0) stays the default,
and what validate and bench measure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 keeps every token; top_p 1 keeps the whole distribution;
    repetition_penalty 1 is none (above 1 makes tokens already in the text less likely)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature {self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1] (1 keeps the whole distribution)")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty {self.repetition_penalty} must be > 0 (1 is none)")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            raise ValueError("top_k and top_p apply when sampling; give a temperature above 0 (e.g. 0.7)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty: argmax of the logits as they are (prompt lookup can draft it)."""
        return self.greedy and self.repetition_penalty == 1


class Sampler:
    """Picks tokens for one sequence with its own random generator."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)

    def pick(self, logits: np.ndarray, seen: Iterable[int]) -> int:
        """The next token. Works on float64 log-probabilities shifted so the largest is 0 before the
        temperature divides them: any temperature above 0 and any penalty stay finite. A NaN logit
        (a model fault) counts as impossible; if every logit is, ValueError names it."""
        s = self.sampling
        if s.plain_greedy and (token := plain_argmax(logits)) is not None:
            return token
        logits = penalized(finite(logits), seen, s.repetition_penalty)
        if s.greedy:
            return int(np.argmax(logits))
        scaled = (logits - logits.max()) / s.temperature  # <= 0: exp never overflows
        probabilities = truncated(np.exp(scaled) / np.exp(scaled).sum(), s.top_k, s.top_p)
        return int(self.rng.choice(probabilities.size, p=probabilities))


def plain_argmax(logits: np.ndarray) -> int | None:
    """The most likely token straight from the logits as they come (no float64 copy of the
    vocabulary: the largest share of a greedy row's Python time, a millisecond at Gemma's 262k),
    or None when they hold what finite() must settle: numpy's argmax lands on the first NaN if
    there is one, and on -inf only when every logit is -inf."""
    token = int(np.argmax(logits))
    value = logits[token]
    return None if np.isnan(value) or value == -np.inf else token


def finite(logits: np.ndarray) -> np.ndarray:
    """float64 logits with NaN as impossible (-inf) and +inf as the largest finite value."""
    largest = np.finfo(np.float64).max
    values = np.nan_to_num(logits.astype(np.float64), nan=-np.inf, posinf=largest, neginf=-np.inf)
    if not np.isfinite(values).any():
        raise ValueError("the model returned no finite logit (NaN or -inf everywhere); check its weights")
    return values


def penalized(logits: np.ndarray, seen: Iterable[int], penalty: float) -> np.ndarray:
    """CTRL's repetition penalty: a seen token's positive logit divided by it, a negative one
    multiplied, so the token always becomes less likely."""
    if penalty == 1:
        return logits
    ids = np.unique(np.fromiter(seen, dtype=np.int64))
    if ids.size:
        logits = logits.copy()
        values = logits[ids]
        with np.errstate(over="ignore"):  # a huge logit over a tiny penalty: the largest float, not inf
            changed = np.where(values > 0, values / penalty, values * penalty)
        logits[ids] = np.clip(changed, -np.finfo(np.float64).max, np.finfo(np.float64).max)
    return logits


def truncated(probabilities: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The distribution kept to its top_k most likely tokens, then to the smallest set of most
    likely tokens whose mass reaches top_p (the most likely token always stays), renormalized."""
    order = np.argsort(-probabilities, kind="stable")
    keep = order[:top_k] if top_k else order
    if top_p < 1:
        mass = np.cumsum(probabilities[keep]) / probabilities[keep].sum()
        keep = keep[: int(np.searchsorted(mass, top_p)) + 1]
    kept = np.zeros_like(probabilities)
    kept[keep] = probabilities[keep]
    return kept / kept.sum()


def sampled_tokens(
    decoder, prompt_ids: list[int], max_new_tokens: int, stop_ids: Iterable[int], sampling: Sampling
) -> Iterator[int]:
    """Yield up to max_new_tokens tokens chosen by sampling; one prefill pass, then one step each."""
    sampler, stop, seen = Sampler(sampling), set(stop_ids), list(prompt_ids)
    logits, cache = decoder.forward(prompt_ids, decoder.empty_cache(), last_only=True)
    for produced in range(1, max_new_tokens + 1):
        token = sampler.pick(logits[-1], seen)
        seen.append(token)
        yield token
        if token in stop or produced == max_new_tokens:
            return
        logits, cache = decoder.forward([token], cache, last_only=True)

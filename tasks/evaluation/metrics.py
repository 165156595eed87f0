"""Engine-agnostic measurements of a decoder: anything with `empty_cache()` and
`forward(token_ids, cache) -> (logits, cache)` (ortforge.Decoder, tasks.evaluation.torch_decoder.TorchDecoder).
The reference and validate stages run the very same code on PyTorch and on ONNX Runtime.

Each evaluation text is scored in sequences no longer than the model's context (each from an empty
cache), a window of tokens per forward pass with the cache carrying the rest. The reference keeps,
per scored position, its top_k logits and the log-sum-exp of all of them: enough for perplexity,
top-1 agreement and the KL divergence of a variant without storing vocabulary-sized rows (a
262,144-token vocabulary would take 2 GB per 2,048 positions).

The KL divergence is computed over the reference's top_k tokens plus one bucket holding the rest of
each distribution. Merging tokens never increases KL, so this is a lower bound of the full
divergence, exact when the tokens outside the top_k carry no probability in either model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ortforge.greedy import greedy_tokens
from tasks.core.errors import StageError
from tasks.core.files import atomic_write_json, read_json
from tasks.core.params import EvalConfig

ARRAYS_FILE = "reference.npz"
FIGURES_FILE = "reference.json"


@dataclass(frozen=True)
class TextReference:
    """The original model's outputs on one evaluation text, and those exact inputs."""

    ids: np.ndarray  # max_tokens + 1 tokens: each but the last is scored on predicting the next
    top_ids: np.ndarray  # [positions, top_k], most likely first
    top_logits: np.ndarray  # [positions, top_k]
    logsumexp: np.ndarray  # [positions]: log-probabilities are top_logits - logsumexp
    greedy_prompt: np.ndarray
    greedy_tokens: np.ndarray


@dataclass(frozen=True)
class Reference:
    texts: dict[str, TextReference]  # by file name
    perplexity: dict[str, float]
    sequence_tokens: int  # tokens per scored sequence: the text length, or the model's context if shorter

    def save(self, folder: Path, extra: dict) -> None:
        arrays = {
            f"{index}.{field.name}": getattr(text, field.name)
            for index, text in enumerate(self.texts.values())
            for field in fields(TextReference)
        }
        np.savez(folder / ARRAYS_FILE, **arrays)
        figures = {"texts": list(self.texts), "perplexity": self.perplexity, "sequence_tokens": self.sequence_tokens}
        atomic_write_json(folder / FIGURES_FILE, figures | extra)

    @classmethod
    def load(cls, folder: Path) -> Reference:
        if not (folder / ARRAYS_FILE).is_file():
            raise StageError(
                f"{folder} has no {ARRAYS_FILE}; run the reference stage first (dvc repro reference@<model>)"
            )
        figures = read_json(folder / FIGURES_FILE)
        with np.load(folder / ARRAYS_FILE) as arrays:
            texts = {
                name: TextReference(**{f.name: arrays[f"{index}.{f.name}"] for f in fields(TextReference)})
                for index, name in enumerate(figures["texts"])
            }
        return cls(texts, figures["perplexity"], figures["sequence_tokens"])


def text_ids(cfg: EvalConfig, text: Path, tokenizer_json: Path) -> tuple[np.ndarray, np.ndarray]:
    """The scored tokens of one text and its greedy prompt; StageError before any model work when
    the text is too short or a setting does not fit the model's context."""
    from tokenizers import Tokenizer

    if not Path(text).is_file():
        raise StageError(f"evaluation text {text} does not exist; fix validate.eval.texts")
    ids = np.asarray(
        Tokenizer.from_file(str(tokenizer_json)).encode(Path(text).read_text(encoding="utf-8")).ids, np.int64
    )
    prompt_end = cfg.greedy_prompt_offset + cfg.greedy_prompt_tokens
    needed = max(cfg.max_tokens + 1, cfg.kv_prefill + cfg.kv_steps, prompt_end)
    if len(ids) < needed:
        raise StageError(
            f"evaluation text {text} has {len(ids)} tokens, the settings need {needed}; "
            f"lower validate.eval.max_tokens or use a longer text"
        )
    return ids[: cfg.max_tokens + 1], ids[cfg.greedy_prompt_offset : prompt_end]


def check_fits_context(cfg: EvalConfig, context: int) -> None:
    """The greedy and cached-decode checks run as one sequence each: they must fit the context."""
    for what, positions in (
        ("greedy_prompt_tokens + greedy_steps", cfg.greedy_prompt_tokens + cfg.greedy_steps),
        ("kv_prefill + kv_steps", cfg.kv_prefill + cfg.kv_steps),
    ):
        if positions > context:
            raise StageError(
                f"validate.eval {what} = {positions} tokens exceed the model's context of {context} positions; "
                f"lower them to fit"
            )


def sequence_length(cfg: EvalConfig, context: int) -> int:
    return min(cfg.max_tokens, context)


def windows(decoder, inputs: np.ndarray, window: int, sequence: int) -> Iterator[tuple[int, np.ndarray]]:
    """(start, logits) for every window of inputs; a new sequence (empty cache) every `sequence` tokens."""
    for first in range(0, len(inputs), sequence):
        cache, last = decoder.empty_cache(), min(first + sequence, len(inputs))
        for start in range(first, last, window):
            logits, cache = decoder.forward(inputs[start : min(start + window, last)], cache)
            yield start, logits


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """Per row, in float64 (the rows themselves stay float32: a vocabulary-wide window is large)."""
    peak = logits.max(axis=-1)
    return peak.astype(np.float64) + np.log(np.exp(logits - peak[:, None]).sum(axis=-1, dtype=np.float64))


def score_reference(decoder, ids: np.ndarray, cfg: EvalConfig, sequence: int) -> tuple[dict, float]:
    """The top_k logits and log-sum-exp of every scored position, and the text's perplexity."""
    parts: dict[str, list] = {"top_ids": [], "top_logits": [], "logsumexp": []}
    nll = 0.0
    for start, logits in windows(decoder, ids[:-1], cfg.window, sequence):
        logits = np.asarray(logits, dtype=np.float32)
        rows = np.arange(len(logits))
        lse = logsumexp(logits)
        nll -= float((logits[rows, ids[start + 1 : start + 1 + len(logits)]] - lse).sum())
        top = np.argpartition(-logits, cfg.top_k - 1, axis=-1)[:, : cfg.top_k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(logits, top, -1), axis=-1), -1)
        parts["top_ids"].append(top.astype(np.int32))
        parts["top_logits"].append(np.take_along_axis(logits, top, -1).astype(np.float32))
        parts["logsumexp"].append(lse)
    return {name: np.concatenate(values) for name, values in parts.items()}, float(np.exp(nll / (len(ids) - 1)))


def bucketed_kl(reference_lp: np.ndarray, variant_lp: np.ndarray) -> np.ndarray:
    """Per position, KL(P || Q) over the given tokens plus one bucket for the rest of each distribution."""
    p, q = np.exp(reference_lp), np.exp(variant_lp)
    p_rest = np.clip(1.0 - p.sum(-1), 1e-12, 1.0)
    q_rest = np.clip(1.0 - q.sum(-1), 1e-12, 1.0)
    return (p * (reference_lp - variant_lp)).sum(-1) + p_rest * (np.log(p_rest) - np.log(q_rest))


def compare(decoder, reference: TextReference, cfg: EvalConfig, sequence: int) -> dict:
    """A variant's perplexity, KL divergence, top-1 agreement and logit gap against one text's reference."""
    ids = reference.ids
    nll = kl = agree = 0.0
    worst_logit = 0.0
    for start, logits in windows(decoder, ids[:-1], cfg.window, sequence):
        logits = np.asarray(logits, dtype=np.float32)
        rows, span = np.arange(len(logits)), slice(start, start + len(logits))
        lse = logsumexp(logits)
        nll -= float((logits[rows, ids[start + 1 : start + 1 + len(logits)]] - lse).sum())
        top_ids = reference.top_ids[span]
        variant_top = np.take_along_axis(logits, top_ids.astype(np.int64), -1).astype(np.float64)
        reference_lp = reference.top_logits[span].astype(np.float64) - reference.logsumexp[span, None]
        kl += float(bucketed_kl(reference_lp, variant_top - lse[:, None]).sum())
        agree += float((logits.argmax(-1) == top_ids[:, 0]).sum())
        worst_logit = max(worst_logit, float(np.abs(variant_top - reference.top_logits[span]).max()))
    scored = len(ids) - 1
    return {
        "perplexity": float(np.exp(nll / scored)),
        "kl_divergence": kl / scored,
        "top1_agreement": agree / scored,
        "max_logit_diff": worst_logit,
        "tokens_scored": scored,
    }


def full_pass_logits(decoder, ids: np.ndarray) -> np.ndarray:
    logits, _ = decoder.forward(ids, decoder.empty_cache())
    return logits


def greedy(decoder, prompt: np.ndarray, steps: int) -> np.ndarray:
    """steps argmax tokens, never stopping at end-of-sequence, so runs are comparable token by token."""
    return np.asarray(list(greedy_tokens(decoder, prompt.tolist(), steps)), dtype=np.int64)


def softmax(logits: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(logits.astype(np.float64)))


def stepped_logits(decoder, ids: np.ndarray, prefill: int, steps: int) -> np.ndarray:
    """The logits of a prefill of ids[:prefill], then of one-token steps through the cache."""
    logits, cache = decoder.forward(ids[:prefill], decoder.empty_cache())
    stepped = [logits]
    for token in ids[prefill : prefill + steps]:
        logits, cache = decoder.forward([int(token)], cache)
        stepped.append(logits)
    return np.concatenate(stepped)


def largest_probability_change(logits: np.ndarray, other: np.ndarray) -> float:
    return float(np.abs(softmax(logits) - softmax(other)).max())


def mean_kl(reference_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(reference) || softmax(logits)), nats per token."""
    reference_lp, lp = log_softmax(reference_logits.astype(np.float64)), log_softmax(logits.astype(np.float64))
    return float((np.exp(reference_lp) * (reference_lp - lp)).sum(-1).mean())


def windowed_kl(reference_decoder, decoder, ids: np.ndarray, window: int, sequence: int) -> float:
    """Mean KL(reference_decoder || decoder) per token over ids, both run as compare() runs a
    variant: windows, the cache carrying the context."""
    total = 0.0
    reference_windows = windows(reference_decoder, ids[:-1], window, sequence)
    pairs = zip(reference_windows, windows(decoder, ids[:-1], window, sequence), strict=True)
    for (_, reference_logits), (_, logits) in pairs:
        total += mean_kl(np.asarray(reference_logits), np.asarray(logits)) * len(logits)
    return total / (len(ids) - 1)


def cached_decode_gap(decoder, ids: np.ndarray, prefill: int, steps: int) -> float:
    """Largest change of any token's probability between prefill + one-token steps through the cache
    and one full pass over the same tokens."""
    tokens = ids[: prefill + steps]
    return largest_probability_change(
        stepped_logits(decoder, tokens, prefill, steps), full_pass_logits(decoder, tokens)
    )


def matching_prefix(tokens: np.ndarray, reference: np.ndarray) -> int:
    mismatch = np.flatnonzero(tokens[: len(reference)] != reference[: len(tokens)])
    return int(mismatch[0]) if mismatch.size else int(min(len(tokens), len(reference)))

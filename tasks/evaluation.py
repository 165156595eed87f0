"""Engine-agnostic measurements of a decoder: anything with `empty_cache()` and
`forward(token_ids, cache) -> (logits, cache)` (ortforge.Decoder, tasks.torch_decoder.TorchDecoder).
The reference and validate stages run the very same code on PyTorch and on ONNX Runtime."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortforge.generate import greedy_tokens
from tasks.errors import StageError
from tasks.files import atomic_write_json, read_json
from tasks.params import EvalConfig

ARRAYS_FILE = "reference.npz"
FIGURES_FILE = "reference.json"


@dataclass(frozen=True)
class EvalInputs:
    text_ids: np.ndarray  # the fixed text, max_tokens + 1 tokens (the last is only a target)
    random_ids: np.ndarray  # seeded random tokens for the logit comparison
    greedy_prompt: np.ndarray


@dataclass(frozen=True)
class Reference:
    """The original model's outputs on the evaluation inputs, plus those exact inputs."""

    text_ids: np.ndarray
    random_ids: np.ndarray
    random_logits: np.ndarray
    greedy_prompt: np.ndarray
    greedy_tokens: np.ndarray
    perplexity: float

    def save(self, folder: Path, extra: dict) -> None:
        arrays = {k: v for k, v in self.__dict__.items() if isinstance(v, np.ndarray)}
        np.savez(folder / ARRAYS_FILE, **arrays)
        figures = {"perplexity": self.perplexity, "tokens_scored": len(self.text_ids) - 1, **extra}
        atomic_write_json(folder / FIGURES_FILE, figures)

    @classmethod
    def load(cls, folder: Path) -> Reference:
        if not (folder / ARRAYS_FILE).is_file():
            raise StageError(
                f"{folder} has no {ARRAYS_FILE}; run the reference stage first (dvc repro reference@<model>)"
            )
        with np.load(folder / ARRAYS_FILE) as arrays:
            fields = {name: arrays[name] for name in arrays.files}
        return cls(**fields, perplexity=read_json(folder / FIGURES_FILE)["perplexity"])


def eval_inputs(cfg: EvalConfig, tokenizer_json: Path, vocab_size: int) -> EvalInputs:
    from tokenizers import Tokenizer

    if not cfg.text.is_file():
        raise StageError(f"evaluation text {cfg.text} does not exist; fix validate.eval.text")
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    ids = np.asarray(tokenizer.encode(cfg.text.read_text(encoding="utf-8")).ids, dtype=np.int64)
    prompt_end = cfg.greedy_prompt_offset + cfg.greedy_prompt_tokens
    needed = max(cfg.max_tokens + 1, cfg.kv_prefill + cfg.kv_steps, prompt_end)
    if len(ids) < needed:
        raise StageError(
            f"evaluation text {cfg.text} has {len(ids)} tokens, the settings need {needed}; "
            f"lower validate.eval.max_tokens or use a longer text"
        )
    rng = np.random.default_rng(cfg.seed)
    return EvalInputs(
        text_ids=ids[: cfg.max_tokens + 1],
        random_ids=rng.integers(0, vocab_size, cfg.logits_tokens, dtype=np.int64),
        greedy_prompt=ids[cfg.greedy_prompt_offset : prompt_end],
    )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(decoder, ids: np.ndarray, window: int) -> float:
    """exp(mean NLL) of ids[1:] given their prefixes, window tokens per pass with the KV cache."""
    cache = decoder.empty_cache()
    total, count = 0.0, 0
    inputs = ids[:-1]
    for start in range(0, len(inputs), window):
        chunk = inputs[start : start + window]
        logits, cache = decoder.forward(chunk, cache)
        targets = ids[start + 1 : start + 1 + len(chunk)]
        total -= float(log_softmax(logits)[np.arange(len(chunk)), targets].sum())
        count += len(chunk)
    return float(np.exp(total / count))


def full_pass_logits(decoder, ids: np.ndarray) -> np.ndarray:
    logits, _ = decoder.forward(ids, decoder.empty_cache())
    return logits


def greedy(decoder, prompt: np.ndarray, steps: int) -> np.ndarray:
    """steps argmax tokens, never stopping at end-of-sequence, so runs are comparable token by token."""
    return np.asarray(list(greedy_tokens(decoder, prompt.tolist(), steps)), dtype=np.int64)


def cached_decode_gap(decoder, ids: np.ndarray, prefill: int, steps: int) -> float:
    """Largest |logit| gap between prefill + one-token steps through the cache and one full pass."""
    tokens = ids[: prefill + steps]
    full = full_pass_logits(decoder, tokens)
    logits, cache = decoder.forward(tokens[:prefill], decoder.empty_cache())
    stepped = [logits]
    for token in tokens[prefill:]:
        logits, cache = decoder.forward([int(token)], cache)
        stepped.append(logits)
    return float(np.abs(np.concatenate(stepped) - full).max())


def matching_prefix(tokens: np.ndarray, reference: np.ndarray) -> int:
    mismatch = np.flatnonzero(tokens[: len(reference)] != reference[: len(tokens)])
    return int(mismatch[0]) if mismatch.size else int(min(len(tokens), len(reference)))

"""lm-eval's model interface over an ortforge artifact: any lm-eval task runs on a built variant.

    lm_eval.simple_evaluate(model=ArtifactLM("artifacts/<model>/variants/<variant>"), tasks=[...])

(importing this module also registers it with lm-eval as "ortforge": model="ortforge",
model_args="artifact=<folder>"). The artifact runs through the runtime
(ortforge.generate.TextGenerator, with the settings bench measured for it), so a task scores what
`ortforge generate` and `ortforge serve` deploy. Log-likelihoods prefill the context once (its last
position's logits only) and score each continuation from that cache, so the logits held are one
continuation's, never the whole context's (a 262k vocabulary times a long context would not fit).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ortforge import chat
from ortforge.generate import GREEDY
from ortforge.sampling import Sampling
from tasks.evaluation.metrics import log_softmax

DEFAULT_MAX_GEN_TOKS = 256


def continuation_score(logits: np.ndarray, tokens: list[int]) -> tuple[float, bool]:
    """(sum of the tokens' log-probabilities, whether each was the most likely) given logits whose
    row i predicts tokens[i]: lm-eval's loglikelihood answer. In float64, so a long continuation's
    sum keeps its precision."""
    rows = log_softmax(logits.astype(np.float64))
    picked = rows[np.arange(len(tokens)), tokens]
    return float(picked.sum()), bool(np.all(rows.argmax(axis=-1) == np.asarray(tokens)))


def sampling_for(gen_kwargs: dict) -> Sampling:
    """lm-eval's generation options as the runtime's; greedy unless a task asks to sample."""
    if not gen_kwargs.get("do_sample") or not gen_kwargs.get("temperature", 1.0):
        return GREEDY
    return Sampling(temperature=float(gen_kwargs.get("temperature", 1.0)), top_p=float(gen_kwargs.get("top_p", 1.0)))


@register_model("ortforge")
class ArtifactLM(LM):
    def __init__(self, artifact: str | Path, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, **_ignored_lm_eval_options):
        # lm-eval passes batch_size and device to every model; the runtime sizes its own work.
        from ortforge.generate import TextGenerator

        super().__init__()
        self.folder = Path(artifact)
        self.generator = TextGenerator(self.folder)
        self.max_gen_toks = int(max_gen_toks)
        self.eos_id = self.generator.stop_ids[0] if self.generator.stop_ids else None

    # Tokens: the tokenizer's own special tokens (a BOS where the model wants one), never two BOS
    # when a chat template already wrote it as text.
    def encode(self, text: str) -> list[int]:
        ids = self.generator.encode(text)
        if len(ids) >= 2 and ids[0] == ids[1] and self.generator.tokenizer.id_to_token(ids[0]) in text[:32]:
            ids = ids[1:]
        return ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split: the context's trailing spaces go with the continuation, and the pair is
        tokenized whole, so the continuation's tokens are the ones the model would read."""
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = self.encode(context) if context else self.prefix_ids()
        whole = self.encode(context + continuation) if context else context_ids + self.encode_plain(continuation)
        if whole[: len(context_ids)] != context_ids:  # the boundary merged into one token: keep the context's
            return context_ids, self.encode_plain(continuation)
        return context_ids, whole[len(context_ids) :]

    def encode_plain(self, text: str) -> list[int]:
        return self.generator.encode(text, add_special_tokens=False)

    def prefix_ids(self) -> list[int]:
        """What an empty context reads: the BOS the tokenizer adds, else end-of-text (lm-eval's rule)."""
        ids = self.generator.encode("")
        return ids or [self.eos_id]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*request.args) for request in requests]
        return list(self.score_pairs(pairs))

    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> Iterable[tuple[float, bool]]:
        """Each (context, continuation) pair's score; a context shared by consecutive pairs (a
        multiple-choice question's choices) is prefilled once."""
        decoder = self.generator.decoder
        held: tuple[tuple[int, ...], np.ndarray, object] | None = None
        for context, continuation in pairs:
            if not continuation:
                yield 0.0, True
                continue
            if held is None or held[0] != tuple(context):
                decoder.check_fits(len(context) + len(continuation))
                last, cache = decoder.forward(context, decoder.empty_cache(), last_only=True)
                held = (tuple(context), np.array(last[-1:]), cache)
            _, last, cache = held
            rows = [last]
            if len(continuation) > 1:
                rest, _ = decoder.forward(continuation[:-1], cache)
                rows.append(rest)
            yield continuation_score(np.concatenate(rows), continuation)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood in disjoint windows of the model's context (lm-eval's rule)."""
        length = self.generator.decoder.context_length or 2048
        scores = []
        for request in requests:
            windows = get_rolling_token_windows(
                self.encode_plain(request.args[0]), self.prefix_ids()[0], max_seq_len=length, context_len=1
            )
            pairs = [make_disjoint_window(window) for window in windows]
            scores.append(sum(score for score, _ in self.score_pairs(pairs)))
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for request in requests:
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.fitted(self.encode(context), max_new)
            pieces = self.generator.stream_ids(ids, max_new, sampling_for(gen_kwargs), stop=until)
            answers.append("".join(pieces))
        return answers

    def fitted(self, ids: list[int], max_new: int) -> list[int]:
        """The prompt's last tokens that leave room for max_new in the context (lm-eval's left cut)."""
        length = self.generator.decoder.context_length
        if length is None or len(ids) + max_new <= length:
            return ids
        return ids[-(length - max_new) :]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return chat.render_chat(self.folder, chat_history)

    @property
    def tokenizer_name(self) -> str:
        return str(self.folder)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return chat.chat_template(self.folder) if chat_template else None

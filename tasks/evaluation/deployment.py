"""What the runtime may do with a variant's runs, proven by validate: each way the runtime (and
bench's tuning) may run a sequence's tokens, against the plain way on the same graph.

- pieces: a prompt prefilled in pieces (each prefill chunk tuning tries, and uneven pieces such as
  the scheduler cuts) against the whole prompt, then decode steps after it;
- batched rows: two sequences of different lengths in rows 0 and 2 of a three-row batch (row 1
  free, so the dummy-token path runs), stepping together, against each alone at batch 1;
- session settings: each intra-op thread count and graph optimization level tuning tries,
  against onnxruntime's defaults (the other settings tuning tries, memory pattern, arena and
  inter-op parallelism, change no operator's arithmetic).

The runtime classes run these with their own rules (a length-dependent rope's limit), so what is
proven is what they do. The prompt reaches past every boundary the config declares (a sliding
window, a scaled rope's original context, an attention chunk) as far as the evaluation text
allows. The graph computes in float (validate's cache check graph): int8-activation kernels round
a value differently when a run is cut otherwise, which says nothing of the mechanism. What is left
must be float rounding: the largest change of any token's probability at most SAME_PROBABILITY.
A graph that quantizes activations with one scale per run fails pieces and rows by design (each
run's scale depends on what else is in it), and the runtime then runs it only the reference's
way (ortforge.decoder.Proven).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

# Float rounding moved a probability by at most 8e-6 (SmolLM2, Gemma 3); one scale per run moved
# one by 7e-4 on a tiny random model and by 0.5 on SmolLM2.
SAME_PROBABILITY = 1e-4
PAST_BOUNDARY = 48  # tokens the prompt reaches past the furthest boundary
SHORTEST_PROMPT = 160  # several pieces of each tuned chunk
UNEVEN_PIECES = (1, 7, 33)  # then the rest: pieces of any size, as the scheduler cuts them
STEPS = 8  # decode steps compared after each prefill
SETTINGS_PROMPT = 48  # tokens the session settings are compared on
PREFILL_CHUNKS = (64, 32)  # the chunks bench's tuning tries (tasks/measurement/tuning.py), each proven here
GRAPH_LEVELS = ("basic", "extended", "all")
STAMPED = ("prefill_pieces", "batched_rows", "session_settings")  # what the runtime and tuning read


@dataclass
class Proof:
    """The largest probability change of each way, and the verdicts the stamp records."""

    prompt_tokens: int
    boundaries: dict[str, int]
    beyond_text: dict[str, int]  # boundaries the evaluation text is too short to pass
    pieces: dict[str, float] = field(default_factory=dict)
    rows: float = float("nan")
    settings: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict:
        proven = [label for label, gap in self.settings.items() if gap <= SAME_PROBABILITY]
        return {
            "prefill_pieces": all(gap <= SAME_PROBABILITY for gap in self.pieces.values()),
            "batched_rows": bool(self.rows <= SAME_PROBABILITY),
            "session_settings": [dict(_parse(label)) for label in proven],
            "limit": SAME_PROBABILITY,
            "prompt_tokens": self.prompt_tokens,
            "boundaries": self.boundaries,
            "beyond_text": self.beyond_text,
            "largest_change": {"pieces": self.pieces, "batched_rows": self.rows, "session_settings": self.settings},
        }


def setting_label(threads: int, level: str) -> str:
    return f"intra_op_threads={threads},graph_level={level}"


def _parse(label: str):
    for part in label.split(","):
        key, value = part.split("=")
        yield key, int(value) if value.isdigit() else value


def boundaries(config: dict, rope) -> dict[str, int]:
    """The lengths past which attention or positions change: the config's sliding window and
    attention chunk, and the limit of a rope whose frequencies change with the run's length (rope:
    ortforge.decoder.length_dependent_rope, the limit the runtime acts on). llama3, yarn and linear
    scaling give every position the same frequencies at any length (rope is None): counting Llama
    3's original 8,192 made validate prove prompts as long as the evaluation text (2,048 tokens)
    instead of 160."""
    found = {
        "sliding_window": config.get("sliding_window"),
        "attention_chunk_size": config.get("attention_chunk_size"),
        "rope_limit": rope.limit if rope is not None else None,
    }
    return {name: value for name, value in found.items() if isinstance(value, int) and value > 0}


def probability_gap(a: np.ndarray, b: np.ndarray) -> float:
    """The largest change of any token's probability between two logit arrays [..., vocab]."""

    def softmax(x):
        x = np.asarray(x, dtype=np.float64)
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    return float(np.abs(softmax(a) - softmax(b)).max())


def _alone(decoder, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    """Last-position logits after the prompt, then after each of the steps' tokens, at batch 1."""
    logits, cache = decoder.forward(prompt, decoder.empty_cache(), last_only=True)
    found = [logits[-1]]
    for token in steps:
        logits, cache = decoder.forward([token], cache, last_only=True)
        found.append(logits[-1])
    return found


def _in_pieces(batch, prompt: list[int], sizes: list[int], steps: list[int]) -> list[np.ndarray]:
    """The same through a batch row, the prompt cut into pieces of the given sizes (the last
    takes the rest) where the runtime's rule lets the scheduler cut it."""
    if not batch.single.runs_like_any(len(prompt)):
        sizes = []  # the scheduler prefills such a prompt whole (ortforge.scheduler)
    batch.begin(0, prompt)
    start, found = 0, []
    for size in [*sizes, len(prompt)]:
        end = min(len(prompt), start + size)
        if end > start:
            logits = batch.prefill_piece(0, prompt[start:end], last=end == len(prompt))
        start = end
    found.append(logits)
    for token in steps:
        found.append(batch.step({0: token})[0])
    batch.release(0)
    return found


def prove(session_of, rope, ids: np.ndarray, config: dict, chunks: tuple[int, ...]) -> Proof:
    """session_of(threads, level): a session over the float-compute graph; rope: the model's
    length_dependent_rope; ids: the evaluation text's tokens; config: the model's config.json;
    chunks: the prefill chunks tuning may choose. One session is open at a time: at 1B a
    float-compute session of an int8 graph holds a few GB."""
    proof, (short, short_steps), plain = _prove_runs(session_of(0, "all"), rope, ids, config, chunks)
    for threads in range(1, (os.cpu_count() or 1) + 1):
        for level in GRAPH_LEVELS:
            other = _alone(_decoder(session_of(threads, level), 0, rope), short, short_steps)
            proof.settings[setting_label(threads, level)] = max(map(probability_gap, other, plain))
    return proof


def _decoder(session, chunk: int, rope):
    from ortforge.decoder import Decoder

    return Decoder(session, prefill_chunk=chunk, rope=rope)


def _prove_runs(session, rope, ids: np.ndarray, config: dict, chunks: tuple[int, ...]) -> tuple:
    """Pieces and batched rows on the default session; the proof so far, and the short run the
    settings are compared on with the default session's logits of it."""
    from ortforge.batch import BatchDecoder

    context = _decoder(session, 0, rope).context_length or len(ids)
    # Past the context nothing runs, so a boundary there is none.
    found = {name: value for name, value in boundaries(config, rope).items() if value < context}
    furthest = max(found.values(), default=0)
    room = min(len(ids) - 1, context) - STEPS - 1  # the prompt, its steps and one more token
    length = min(room, max(SHORTEST_PROMPT, furthest + PAST_BOUNDARY))
    proof = Proof(length, found, {name: value for name, value in found.items() if value >= length})
    if proof.beyond_text:
        log.warning("the evaluation text (%d tokens) is too short to pass %s", length, proof.beyond_text)
    prompt, steps = ids[:length].tolist(), ids[length : length + STEPS].tolist()

    def decoder_of(chunk: int):
        return _decoder(session, chunk, rope)

    whole = _alone(decoder_of(0), prompt, steps)
    for chunk in chunks:
        cut = _alone(decoder_of(chunk), prompt, steps)
        proof.pieces[f"chunk {chunk}"] = max(map(probability_gap, cut, whole))
    if not BatchDecoder.supports(session):
        proof.rows = float("inf")  # one sequence per run: no batch to prove
    else:
        batch = BatchDecoder(session, 3, rope=rope, row_tokens=length + STEPS + 1)
        uneven = _in_pieces(batch, prompt, list(UNEVEN_PIECES), steps)
        proof.pieces["uneven " + "/".join(map(str, UNEVEN_PIECES))] = max(map(probability_gap, uneven, whole))
        proof.rows = _batched_rows_gap(batch, decoder_of, ids, length, found)
    # A setting's arithmetic does not depend on where the sequence stands: a short one shows it.
    short = (prompt[:SETTINGS_PROMPT], steps[:2])
    return proof, short, _alone(decoder_of(0), *short)


def _batched_rows_gap(batch, decoder_of, ids: np.ndarray, length: int, found: dict[str, int]) -> float:
    """Rows 0 and 2 of the batch step together; the largest gap from each sequence alone. The
    shorter sequence starts elsewhere in the text and, where a boundary allows, stays below the
    nearest one the longer passes."""
    nearest = min(found.values(), default=length)
    short = max(8, min(length // 2, nearest - STEPS - 1))
    sequences = {0: ids[:length].tolist(), 2: ids[length // 3 : length // 3 + short].tolist()}
    nexts = {row: ids[length + 1 : length + 1 + STEPS].tolist() for row in sequences}
    batched = {row: [batch.prefill(row, prompt)] for row, prompt in sequences.items()}
    for step in range(STEPS):
        stepped = batch.step({row: nexts[row][step] for row in sequences})
        for row in sequences:
            batched[row].append(stepped[row])
    gaps = []
    for row, prompt in sequences.items():
        alone = _alone(decoder_of(0), prompt, nexts[row])
        gaps.append(max(map(probability_gap, batched[row], alone)))
        batch.release(row)
    return max(gaps)

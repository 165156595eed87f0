"""One forward step of a KV-cache decoder graph through onnxruntime I/O binding: feed new tokens,
get logits, and the cache grows without passing through Python.

Two cache layouts, recorded in the model's metadata by the quantize stage (names.KV_LAYOUT_KEY):
- shared: GroupQueryAttention graphs (onnxruntime-genai's builder) read and write one buffer per
  layer; past and present are bound to the same memory and new keys and values are written in
  place, so nothing is copied per token. Buffers are allocated once and only grow (doubling) when
  a sequence outgrows them.
- chained: graphs that concatenate past and new (optimum's export) return a grown present; its
  onnxruntime values are bound as the next step's past directly, never converted to numpy.

A shared cache may be stored quantized (int8, or 4-bit packed in uint8; the quantize stage's
kv_cache setting): the graph quantizes what it writes and dequantizes what it reads with scales it
carries, and the buffers here are only smaller (names.KV_CACHE_BITS_KEY says how many bits).

The cache belongs to the decoder: a new empty_cache() starts a new sequence, rewind() cuts it back.
A long prompt may run in chunks (prefill_chunk tokens each): same result, bounded activation memory.

Same result, that is, while the rotary frequencies do not depend on how long a run is. LongRoPE
(Phi-3.5, Phi-4-mini) takes its long factors, dynamic NTK rescales, once a run's total length
passes the original context (length_dependent_rope): a chunk, a draft check, or a batched run
wider than that computes its tokens with other frequencies than the reference's own runs (the
whole prompt, then one token a step). Past the limit, such a model runs only those; and where
transformers' generate recomputes a sequence's whole cache as it first passes the limit (Phi-3's
family), so does the decoder, which keeps such a sequence's tokens until then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ortforge import names
from ortforge.manifest import deployment_record
from ortforge.session import SessionSettings, create_session

# A quantized cache (GroupQueryAttention's k/v_quant_type) holds int8, or uint8 with two 4-bit values.
ORT_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
}
INITIAL_CAPACITY = 256
# rope_scaling types whose frequencies depend on the total length of the run (length_dependent_rope).
LENGTH_DEPENDENT_ROPE = frozenset({"longrope", "su", "dynamic"})
# Model types whose transformers generate drops a sequence's cache the first time it passes the
# original context and recomputes it whole, so every key carries the long factors from then on
# (Phi3ForCausalLM.prepare_inputs_for_generation, copied by PhiMoE and Phi-4-multimodal).
RECOMPUTE_AT_ROPE_LIMIT = frozenset({"phi3", "phimoe", "phi4_multimodal"})
NOT_PICKLABLE = (
    "an onnxruntime session cannot be pickled or sent to another process; create a TextGenerator "
    "(or Decoder) from the artifact folder inside each process instead"
)


@dataclass
class KVCache:
    """How many tokens the current sequence holds, and (chained layout) its present tensors."""

    length: int = 0
    values: list = field(default_factory=list)
    # The sequence's tokens, kept only while a cache recomputed at the rope limit may need them
    # (one list along a sequence; its first `length` entries are this cache's).
    ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Proven:
    """What the validate stage proved of a variant's runs (its stamp's `deployment`): pieces, a
    prompt cut into runs (prefill chunks, a reused prefix, prompt lookup's draft checks) computes
    what the whole prompt does; rows, a sequence batched with others computes what it does alone.
    A graph that quantizes activations with one scale per run proves neither (its rows and pieces
    change each other's codes), and then runs only the reference's own runs: whole prompts, one
    token a step, each sequence alone."""

    pieces: bool = True
    rows: bool = True


@dataclass(frozen=True)
class LengthDependentRope:
    """Rotary frequencies that change with a run's total length: a run up to `limit` tokens uses
    the plain ones, a longer run others. recompute: the model's generate recomputes a sequence's
    cache whole as it first passes the limit."""

    limit: int
    recompute: bool


class Decoder:
    def __init__(
        self,
        session: ort.InferenceSession,
        head_dim: int | None = None,
        layout: str | None = None,
        prefill_chunk: int = 0,
        rope: LengthDependentRope | None = None,
        proven: Proven | None = None,
    ):
        """rope: the model's length_dependent_rope (None: its frequencies never depend on a run);
        proven: what validate proved of its runs (proven_runs; None: a graph used directly, as
        validate itself does, may run every way)."""
        self.session = session
        self.prefill_chunk = prefill_chunk
        self.rope = rope
        self.proven = proven or Proven()
        inputs = {i.name: i for i in session.get_inputs()}
        self.num_layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        if self.num_layers == 0 or names.INPUT_IDS not in inputs:
            raise ValueError(
                f"graph inputs {sorted(inputs)} are not a KV-cache decoder: expected "
                f"{names.INPUT_IDS} and {names.past_key(0)}; export with task text-generation-with-past"
            )
        metadata = session.get_modelmeta().custom_metadata_map
        key = inputs[names.past_key(0)]
        self.kv_heads = int(key.shape[1])
        self.head_dim = _head_dim(key, metadata, head_dim)
        self.kv_dtype = ORT_TO_NUMPY[key.type]
        self.kv_bits = int(metadata.get(names.KV_CACHE_BITS_KEY, 8 * np.dtype(self.kv_dtype).itemsize))
        self.cache_dim = self.head_dim * self.kv_bits // (8 * np.dtype(self.kv_dtype).itemsize)  # stored per head
        self.shared = (layout or metadata.get(names.KV_LAYOUT_KEY)) == names.KV_SHARED
        # None for a graph without the tag (an export not made by the quantize stage): no limit known.
        self.context_length = int(metadata[names.CONTEXT_LENGTH_KEY]) if names.CONTEXT_LENGTH_KEY in metadata else None
        self.uses_position_ids = names.POSITION_IDS in inputs
        self.uses_attention_mask = names.ATTENTION_MASK in inputs
        self.can_keep_last = names.LOGITS_TO_KEEP in inputs
        self._keep = {count: np.array([count], dtype=np.int64) for count in (0, 1)}
        self._past = names.past_names(self.num_layers)
        self._present = names.present_names(self.num_layers)
        # Outputs are bound logits first; get_outputs() keeps that order, and re-binding a name each
        # run (so onnxruntime allocates its new shape) keeps its place. Shared presents are ours.
        self._binding = session.io_binding()
        self._binding.bind_output(names.LOGITS)
        if not self.shared:
            for present in self._present:
                self._binding.bind_output(present)
        self._capacity = 0
        self._ones = np.ones((1, 0), dtype=np.int64)
        self._arrays: list[np.ndarray] = []
        empty = np.zeros((1, self.kv_heads, 0, self.cache_dim), self.kv_dtype)
        self._empty = ort.OrtValue.ortvalue_from_numpy(empty)

    @classmethod
    def for_artifact(cls, model_dir, settings: SessionSettings | None = None) -> Decoder:
        """A decoder over a new session for the artifact, with its measured settings by default."""
        settings = settings or SessionSettings.for_artifact(model_dir)
        session = create_session(model_dir, settings)
        rope, proven = length_dependent_rope(model_dir), proven_runs(model_dir)
        return cls(session, prefill_chunk=settings.prefill_chunk, rope=rope, proven=proven)

    def __reduce__(self):
        raise TypeError(NOT_PICKLABLE)

    @property
    def kv_bytes_per_token(self) -> int:
        """What one more token of context costs in the cache: keys and values of every layer."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.kv_bits // 8

    def empty_cache(self) -> KVCache:
        return KVCache(0, [] if self.shared else [self._empty] * len(self._past))

    def forward(self, token_ids, cache: KVCache, last_only: bool = False) -> tuple[np.ndarray, KVCache]:
        """Logits (sequence, vocab) for the new tokens, and the cache extended by them.

        last_only: the caller needs the last position's logits only (generation); graphs with a
        logits_to_keep input then skip the others, and the result has one row.
        """
        ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64).reshape(1, -1))
        self.check_fits(cache.length + ids.shape[1])
        if self.recomputes(cache.length, ids.shape[1]):
            logits, cache = self.forward([*cache.ids[: cache.length], *ids[0].tolist()], self.empty_cache(), last_only)
            return logits if last_only else logits[-ids.shape[1] :], cache
        chunk = self.prefill_chunk
        if last_only and chunk and ids.shape[1] > chunk and self.runs_like_any(cache.length + ids.shape[1]):
            *leading, ids = [ids[:, start : start + chunk] for start in range(0, ids.shape[1], chunk)]
            for piece in leading:  # their logits are not wanted: they only fill the cache
                _, cache = self._run(np.ascontiguousarray(piece), cache, last_only=True)
        return self._run(np.ascontiguousarray(ids), cache, last_only)

    def runs_like_any(self, total: int) -> bool:
        """Whether a run that ends at `total` tokens computes its tokens as any other run would
        (so prompt pieces and draft checks may end there): where validate proved pieces, but for
        a model whose rotary frequencies change past its rope limit."""
        return self.proven.pieces and self._within_rope(total)

    def batches_like_alone(self, total: int) -> bool:
        """Whether sequences batched into a run that reaches `total` tokens compute what each
        does alone: where validate proved batched rows, within the rope limit."""
        return self.proven.rows and self._within_rope(total)

    def _within_rope(self, total: int) -> bool:
        return self.rope is None or total <= self.rope.limit

    def keeps_tokens(self, total: int) -> bool:
        """Whether a sequence of `total` tokens may yet be recomputed whole at the rope limit, so
        its tokens are kept (for the decoder's cache and BatchDecoder's rows alike)."""
        return bool(self.rope and self.rope.recompute and total <= self.rope.limit)

    def recomputes(self, held: int, new: int) -> bool:
        """Whether a run of `new` tokens after `held` recomputes the sequence whole: it is the first
        to pass the rope limit of a model whose generate does so."""
        return bool(self.rope and self.rope.recompute and 0 < held <= self.rope.limit < held + new)

    def check_fits(self, positions: int) -> None:
        """ValueError when a sequence of this many tokens is longer than the model's context."""
        if self.context_length is not None and positions > self.context_length:
            raise ValueError(
                f"{positions} tokens do not fit the model's context of {self.context_length} positions; "
                f"shorten the prompt or ask for fewer new tokens"
            )

    def rewind(self, cache: KVCache, length: int) -> KVCache:
        """The cache cut back to its first length tokens (speculative decoding drops a rejected draft).

        Shared buffers only move the length: the next run overwrites what lies past it. Chained
        presents are sliced (a copy)."""
        if length >= cache.length:
            return cache
        if self.shared:
            return KVCache(length, ids=cache.ids)
        values = [
            ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :length])) for v in cache.values
        ]
        return KVCache(length, values, cache.ids)

    def _run(self, ids: np.ndarray, cache: KVCache, last_only: bool) -> tuple[np.ndarray, KVCache]:
        start, total = cache.length, cache.length + ids.shape[1]
        self._reserve(total, cache.length)
        binding = self._binding
        binding.bind_cpu_input(names.INPUT_IDS, ids)
        if self.uses_attention_mask:
            binding.bind_cpu_input(names.ATTENTION_MASK, self._ones[:, :total])
        if self.uses_position_ids:
            positions = np.arange(start, total, dtype=np.int64).reshape(1, -1)
            binding.bind_cpu_input(names.POSITION_IDS, positions)
        if self.can_keep_last:
            binding.bind_cpu_input(names.LOGITS_TO_KEEP, self._keep[int(last_only)])
        binding.bind_output(names.LOGITS)
        if not self.shared:
            for past, value, present in zip(self._past, cache.values, self._present, strict=True):
                binding.bind_ortvalue_input(past, value)
                binding.bind_output(present)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy()[0], KVCache(total, [] if self.shared else list(outputs[1:]), self._ids(cache, ids))

    def _ids(self, cache: KVCache, ids: np.ndarray) -> list[int]:
        """The sequence's tokens after this run, while a recompute at the rope limit may need them."""
        if not self.keeps_tokens(cache.length + ids.shape[1]):
            return []
        kept = cache.ids
        del kept[cache.length :]  # a rewound cache's dropped draft
        kept += ids[0].tolist()
        return kept

    def _reserve(self, total: int, keep: int) -> None:
        """Make room for total tokens: the mask always, the shared buffers when they are used."""
        if total <= self._capacity:
            return
        capacity = max(INITIAL_CAPACITY, self._capacity)
        while capacity < total:
            capacity *= 2
        self._ones = np.ones((1, capacity), dtype=np.int64)
        if self.shared:
            shape = (1, self.kv_heads, capacity, self.cache_dim)
            grown = [np.zeros(shape, self.kv_dtype) for _ in self._past]
            for new, old in zip(grown, self._arrays, strict=False):
                new[:, :, :keep] = old[:, :, :keep]
            self._arrays = grown  # the OrtValues below borrow these arrays' memory
            for past, present, array in zip(self._past, self._present, grown, strict=True):
                value = ort.OrtValue.ortvalue_from_numpy(array)
                self._binding.bind_ortvalue_input(past, value)
                self._binding.bind_ortvalue_output(present, value)
        self._capacity = capacity


def proven_runs(model_dir: Path) -> Proven:
    """What validate proved of the artifact's runs, from its validation stamp: every way for a
    folder with no stamp (a graph used directly), none for a stamp that records no proof."""
    record = deployment_record(model_dir)
    if record is None:
        return Proven()
    return Proven(pieces=record.get("prefill_pieces") is True, rows=record.get("batched_rows") is True)


def length_dependent_rope(model_dir: Path) -> LengthDependentRope | None:
    """For a model whose rotary frequencies depend on the run's total length (its config's
    rope_scaling type), the longest run that uses the plain ones: LongRoPE's original context,
    past which it takes the long factors; dynamic NTK's trained context, past which it rescales.
    None for every other model (and when the config cannot be read)."""
    try:
        config = json.loads((Path(model_dir) / names.MODEL_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    scaling = config.get("rope_scaling") if isinstance(config, dict) else None
    if not isinstance(scaling, dict) or (scaling.get("rope_type") or scaling.get("type")) not in LENGTH_DEPENDENT_ROPE:
        return None
    # transformers' dynamic_rope_update: the config's original context, else its trained one.
    limit = config.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    limit = limit if isinstance(limit, int) and limit > 0 else 0  # unknown: every prompt whole
    return LengthDependentRope(limit, config.get("model_type") in RECOMPUTE_AT_ROPE_LIMIT)


def _head_dim(key, metadata: dict, given: int | None) -> int:
    if isinstance(key.shape[3], int):
        return key.shape[3]
    if names.HEAD_DIM_KEY in metadata:
        return int(metadata[names.HEAD_DIM_KEY])
    if given is None:
        raise ValueError(f"{key.name} has a symbolic head size {key.shape[3]!r} and the model no {names.HEAD_DIM_KEY}")
    return given

"""Several sequences in one model run, over GroupQueryAttention's shared in-place KV buffers with a
batch dimension: row r of every layer's buffer holds the sequence in slot r.

A sequence joins by prefilling its prompt into a free row: a batch-1 run bound to that row's
memory (rows are contiguous, so no copy). Each step then runs one token of every occupied row
together; GroupQueryAttention takes each row's own length from its attention-mask row (seqlens_k),
so rows of different lengths attend and write at their own positions. A free row below the
highest occupied one runs a dummy token at position 0 (cheaper than moving a row's cache); its
next sequence's prefill overwrites it. Buffers grow (doubling, one copy) when a row outgrows them.

With a prefix cache, a prompt that shares its start with a recent one (a system prompt, a few-shot
block) copies that start's keys and values into its row instead of computing them again, and
prefills only the rest; entries are kept within a byte budget, least recently used evicted.

Only graphs with shared buffers batch; `BatchDecoder.supports(session)` says so, and callers fall
back to one sequence per run otherwise.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnxruntime as ort

from ortforge import names
from ortforge.decoder import INITIAL_CAPACITY, Decoder


class PrefixCache:
    """Keys and values of recent prompts, per layer [kv_heads, tokens, cache_dim], within max_bytes;
    the least recently used entry goes first. A prompt reuses the longest start it shares with an
    entry, when that start is at least min_tokens long."""

    def __init__(self, max_bytes: int, min_tokens: int = 16):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict[tuple[int, ...], list[np.ndarray]] = OrderedDict()
        self.reused_tokens = 0

    def longest(self, prompt: list[int]) -> tuple[int, list[np.ndarray]]:
        """How many leading tokens of prompt a cached entry holds (0 if fewer than min_tokens), and its arrays."""
        best, arrays, found = 0, [], None
        ids = np.asarray(prompt)
        for key, values in self.entries.items():
            n = min(len(key), len(ids))
            differs = np.flatnonzero(np.asarray(key[:n]) != ids[:n])
            shared = int(differs[0]) if differs.size else n
            if shared > best:
                best, arrays, found = shared, values, key
        if best < self.min_tokens:
            return 0, []
        self.entries.move_to_end(found)
        self.reused_tokens += best
        return best, arrays

    def add(self, prompt: list[int], arrays: list[np.ndarray]) -> None:
        size = sum(a.nbytes for a in arrays)
        if len(prompt) < self.min_tokens or size > self.max_bytes:
            return
        self.entries[tuple(prompt)] = arrays
        self.entries.move_to_end(tuple(prompt))
        while sum(a.nbytes for values in self.entries.values() for a in values) > self.max_bytes:
            self.entries.popitem(last=False)


class BatchDecoder:
    def __init__(
        self, session: ort.InferenceSession, slots: int, prefill_chunk: int = 0, prefixes: PrefixCache | None = None
    ):
        if slots < 1:
            raise ValueError(f"slots {slots} must be at least 1")
        self.single = Decoder(session, prefill_chunk=prefill_chunk)  # the graph's facts, check_fits
        if not self.single.shared:
            raise ValueError("this graph concatenates its KV cache (no shared buffers); it runs one sequence at a time")
        self.session, self.slots, self.prefill_chunk, self.prefixes = session, slots, prefill_chunk, prefixes
        self.lengths = [0] * slots  # tokens each row holds; 0: free
        self._past = names.past_names(self.single.num_layers)
        self._present = names.present_names(self.single.num_layers)
        self._capacity = 0
        self._arrays: list[np.ndarray] = []
        self._reserve(INITIAL_CAPACITY)

    @staticmethod
    def supports(session: ort.InferenceSession) -> bool:
        return session.get_modelmeta().custom_metadata_map.get(names.KV_LAYOUT_KEY) == names.KV_SHARED

    def free_rows(self) -> list[int]:
        return [row for row, length in enumerate(self.lengths) if length == 0]

    def prefill(self, row: int, token_ids: list[int]) -> np.ndarray:
        """Fill a free row with a prompt; the last position's logits (vocab,)."""
        if self.lengths[row]:
            raise ValueError(f"row {row} holds a sequence; release it first")
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens); give some text to continue")
        self.single.check_fits(len(token_ids))
        self._reserve(len(token_ids))
        reused = self._reuse_prefix(row, token_ids)
        rest = token_ids[reused:]
        chunk = self.prefill_chunk or len(rest)
        for start in range(0, len(rest), chunk):
            logits = self._run_row(row, rest[start : start + chunk])
        if self.prefixes is not None:
            self.prefixes.add(token_ids, [array[row, :, : len(token_ids)].copy() for array in self._arrays])
        return logits

    def _reuse_prefix(self, row: int, token_ids: list[int]) -> int:
        """Copy the longest cached start of the prompt into the row; how many tokens that was. The
        last token always runs: its logits are the prefill's answer."""
        if self.prefixes is None:
            return 0
        reused, arrays = self.prefixes.longest(token_ids[:-1])
        for array, cached in zip(self._arrays, arrays, strict=False):
            array[row, :, :reused] = cached[:, :reused]
        self.lengths[row] = reused
        return reused

    def step(self, tokens: dict[int, int]) -> dict[int, np.ndarray]:
        """One token for every occupied row, in one run; each row's next logits (vocab,)."""
        occupied = {row for row, length in enumerate(self.lengths) if length}
        if set(tokens) != occupied:
            raise ValueError(f"a step takes one token for each occupied row {sorted(occupied)}, not {sorted(tokens)}")
        for row in tokens:
            self.single.check_fits(self.lengths[row] + 1)
        rows = max(tokens) + 1
        totals = np.array([self.lengths[r] + 1 if r in tokens else 1 for r in range(rows)], dtype=np.int64)
        self._reserve(int(totals.max()))
        ids = np.array([[tokens.get(r, 0)] for r in range(rows)], dtype=np.int64)
        mask = (np.arange(int(totals.max()))[None, :] < totals[:, None]).astype(np.int64)
        logits = self._run(ids, mask, totals[:, None] - 1, rows)
        for row in tokens:
            self.lengths[row] += 1
        return {row: logits[row, -1] for row in tokens}

    def release(self, row: int) -> None:
        self.lengths[row] = 0

    def _run_row(self, row: int, token_ids: list[int]) -> np.ndarray:
        start, total = self.lengths[row], self.lengths[row] + len(token_ids)
        ids = np.array([token_ids], dtype=np.int64)
        mask = np.ones((1, total), dtype=np.int64)
        positions = np.arange(start, total, dtype=np.int64)[None, :]
        logits = self._run(ids, mask, positions, rows=slice(row, row + 1))
        self.lengths[row] = total
        return logits[0, -1]

    def _run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, rows) -> np.ndarray:
        """One run over buffer rows `rows` (a count from row 0, or a slice)."""
        rows = rows if isinstance(rows, slice) else slice(0, rows)
        binding = self.session.io_binding()
        binding.bind_cpu_input(names.INPUT_IDS, ids)
        if self.single.uses_attention_mask:
            binding.bind_cpu_input(names.ATTENTION_MASK, mask)
        if self.single.uses_position_ids:
            binding.bind_cpu_input(names.POSITION_IDS, np.ascontiguousarray(positions))
        if self.single.can_keep_last:
            binding.bind_cpu_input(names.LOGITS_TO_KEEP, np.array([1], dtype=np.int64))
        binding.bind_output(names.LOGITS)
        for past, present, array in zip(self._past, self._present, self._arrays, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(array[rows])  # a view: rows are contiguous
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    def _reserve(self, total: int) -> None:
        if total <= self._capacity:
            return
        capacity = max(INITIAL_CAPACITY, self._capacity)
        while capacity < total:
            capacity *= 2
        shape = (self.slots, self.single.kv_heads, capacity, self.single.cache_dim)
        grown = [np.zeros(shape, self.single.kv_dtype) for _ in self._past]
        for new, old in zip(grown, self._arrays, strict=False):
            new[:, :, : self._capacity] = old
        self._arrays, self._capacity = grown, capacity

"""Several sequences in one model run, over GroupQueryAttention's shared in-place KV buffers with a
batch dimension: row r of every layer's buffer holds the sequence in slot r.

A sequence joins by prefilling its prompt into a free row: a batch-1 run bound to that row's
memory (rows are contiguous, so no copy). Each step then runs one token of every occupied row
together; GroupQueryAttention takes each row's own length from its attention-mask row (seqlens_k),
so rows of different lengths attend and write at their own positions. A free row below the
highest occupied one runs a dummy token at position 0 (cheaper than moving a row's cache); its
next sequence's prefill overwrites it.

Memory: every row has room for `row_tokens` tokens from the start, in anonymous memory maps (4 KB
pages, no transparent huge pages), so a page costs RAM only once a token is written to it, nothing
is ever copied to grow, and release() hands a finished row's pages back to the system
(MADV_DONTNEED): the cache's resident size follows the tokens held, not the longest prompt seen.

A prompt may also be prefilled a piece at a time (begin, prefill_piece, finish), so a scheduler can
run other rows' steps between its pieces; a row in the middle of its prompt sits out those steps
(it runs a throwaway token at its next position, which its next piece overwrites).

With a prefix cache, a prompt that shares its start with a recent one (a system prompt, a few-shot
block) copies that start's keys and values into its row instead of computing them again, and
prefills only the rest; entries are kept within a byte budget, least recently used evicted.

Only graphs with shared buffers batch; `BatchDecoder.supports(session)` says so, and callers fall
back to one sequence per run otherwise.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict

import numpy as np
import onnxruntime as ort

from ortforge import names
from ortforge.decoder import Decoder, LengthDependentRope, Proven

DEFAULT_ROW_TOKENS = 4096  # a graph that records no context length
SHRINK_ARENA = "memory.enable_memory_arena_shrinkage"  # onnxruntime's run option


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
        self,
        session: ort.InferenceSession,
        slots: int,
        prefill_chunk: int = 0,
        prefixes: PrefixCache | None = None,
        row_tokens: int | None = None,
        rope: LengthDependentRope | None = None,
        proven: Proven | None = None,
    ):
        """row_tokens: the most tokens one row holds (prompt and reply); the model's context by
        default. rope: the model's length_dependent_rope (ortforge.decoder): a prompt that ends
        past its limit runs whole, without a reused start, a run past it advances one row, and a
        row first passing it is recomputed whole where the model's generate does so. proven:
        what validate proved of the variant's runs (ortforge.decoder.proven_runs): without
        pieces, prompts run whole; without batched rows, each row steps alone."""
        if slots < 1:
            raise ValueError(f"slots {slots} must be at least 1")
        # The graph's facts, check_fits and runs_like_any.
        self.single = Decoder(session, prefill_chunk=prefill_chunk, rope=rope, proven=proven)
        if not self.single.shared:
            raise ValueError("this graph concatenates its KV cache (no shared buffers); it runs one sequence at a time")
        self.session, self.slots, self.prefill_chunk, self.prefixes = session, slots, prefill_chunk, prefixes
        self.row_tokens = row_tokens or self.single.context_length or DEFAULT_ROW_TOKENS
        if self.row_tokens < 1:
            raise ValueError(f"row_tokens {self.row_tokens} must be at least 1")
        self.lengths = [0] * slots  # tokens each row holds
        self.taken = [False] * slots  # a sequence holds the row (from begin to release)
        self.row_ids: list[list[int]] = [[] for _ in range(slots)]  # until a recompute is past (rope)
        self._past = names.past_names(self.single.num_layers)
        self._present = names.present_names(self.single.num_layers)
        shape = (slots, self.single.kv_heads, self.row_tokens, self.single.cache_dim)
        self._maps = [_anonymous_map(shape, self.single.kv_dtype) for _ in self._past]
        self._arrays = [array for array, _ in self._maps]
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}  # by rows (start, stop)
        self._shrink = None  # a session without onnxruntime's CPU arena has nothing to give back
        if session.get_session_options().enable_cpu_mem_arena:
            self._shrink = ort.RunOptions()
            self._shrink.add_run_config_entry(SHRINK_ARENA, "cpu:0")

    @staticmethod
    def supports(session: ort.InferenceSession) -> bool:
        return session.get_modelmeta().custom_metadata_map.get(names.KV_LAYOUT_KEY) == names.KV_SHARED

    def free_rows(self) -> list[int]:
        return [row for row, taken in enumerate(self.taken) if not taken]

    def prefill(self, row: int, token_ids: list[int]) -> np.ndarray:
        """Fill a free row with a whole prompt; the last position's logits (vocab,)."""
        self.begin(row, token_ids)
        start = self.reuse_prefix(row, token_ids)
        chunk = self.prefill_chunk if self.single.runs_like_any(len(token_ids)) else 0
        chunk = chunk or len(token_ids)
        for piece in range(start, len(token_ids), chunk):
            logits = self.prefill_piece(row, token_ids[piece : piece + chunk], last=piece + chunk >= len(token_ids))
        self.finish(row, token_ids)
        return logits

    def begin(self, row: int, token_ids: list[int]) -> None:
        """Take a free row for a prompt. The caller then calls reuse_prefix (when the prompt's turn
        comes: an earlier prompt may have just computed its start), prefill_piece for the rest,
        and finish."""
        if self.taken[row]:
            raise ValueError(f"row {row} holds a sequence; release it first")
        if not token_ids:
            raise ValueError("the prompt is empty (no tokens); give some text to continue")
        self.single.check_fits(len(token_ids))
        self._check_room(len(token_ids))
        self.taken[row] = True
        self.row_ids[row] = list(token_ids) if self.single.keeps_tokens(len(token_ids)) else []

    def prefill_piece(self, row: int, token_ids: list[int], last: bool = False) -> np.ndarray:
        """The next piece of the row's prompt; its last position's logits. last: the prompt's final
        piece, after which onnxruntime's arena gives back what this prompt's activations took."""
        if not self.taken[row]:
            raise ValueError(f"row {row} is free; begin a prompt in it first")
        self._check_room(self.lengths[row] + len(token_ids))
        start, total = self.lengths[row], self.lengths[row] + len(token_ids)
        ids = np.array([token_ids], dtype=np.int64)
        mask = np.ones((1, total), dtype=np.int64)
        positions = np.arange(start, total, dtype=np.int64)[None, :]
        logits = self._run(ids, mask, positions, slice(row, row + 1), self._shrink if last else None)
        self.lengths[row] = total
        return logits[0, -1]

    def finish(self, row: int, token_ids: list[int]) -> None:
        """The row's prompt is in: remember its keys and values for later prompts that share its start."""
        if self.prefixes is not None:
            self.prefixes.add(token_ids, [array[row, :, : len(token_ids)].copy() for array in self._arrays])

    def reuse_prefix(self, row: int, token_ids: list[int]) -> int:
        """Copy the longest cached start of the prompt into the row; how many tokens that was. The
        last token always runs: its logits are the prefill's answer. Nothing for a prompt that must
        run whole (past the model's rope limit)."""
        if self.prefixes is None or not self.single.runs_like_any(len(token_ids)):
            return 0
        reused, arrays = self.prefixes.longest(token_ids[:-1])
        for array, cached in zip(self._arrays, arrays, strict=False):
            array[row, :, :reused] = cached[:, :reused]
        self.lengths[row] = reused
        return reused

    def step(self, tokens: dict[int, int]) -> dict[int, np.ndarray]:
        """One token for each row in `tokens`, in one run; each row's next logits (vocab,). Other
        occupied rows (prompts in the middle of their prefill) sit the step out."""
        occupied = {row for row, length in enumerate(self.lengths) if length and self.taken[row]}
        if not tokens or not set(tokens) <= occupied:
            raise ValueError(f"a step takes tokens for occupied rows {sorted(occupied)}, not {sorted(tokens)}")
        for row in tokens:
            self.single.check_fits(self.lengths[row] + 1)
            self._check_room(self.lengths[row] + 1)
        rows = max(tokens) + 1
        # A free row runs a dummy at position 0; a row sitting out runs one at its next position
        # (both are overwritten before they are read); either way its length stays.
        totals = np.array([self.lengths[r] + 1 for r in range(rows)], dtype=np.int64)
        ids = np.array([[tokens.get(r, 0)] for r in range(rows)], dtype=np.int64)
        if not self.single.batches_like_alone(int(totals.max())):
            return {row: self._step_alone(row, token) for row, token in tokens.items()}
        mask = (np.arange(int(totals.max()))[None, :] < totals[:, None]).astype(np.int64)
        logits = self._run(ids, mask, totals[:, None] - 1, slice(0, rows))
        for row, token in tokens.items():
            self.lengths[row] += 1
            self._keep(row, token)
        return {row: logits[row, -1] for row in tokens}

    def _keep(self, row: int, token: int) -> None:
        if self.single.keeps_tokens(self.lengths[row]):
            self.row_ids[row].append(token)
        else:
            self.row_ids[row] = []

    def _step_alone(self, row: int, token: int) -> np.ndarray:
        """One token for one row in a run of that row only: the run is as long as the row, as the
        reference's own step (a wider one would change a length-dependent rope's frequencies, and
        other rows would change one-scale-per-run activation codes)."""
        held, total = self.lengths[row], self.lengths[row] + 1
        recompute = self.single.recomputes(held, 1)  # the whole row again, as its generate does
        ids = np.array([[*self.row_ids[row], token] if recompute else [token]], dtype=np.int64)
        positions = np.arange(total - ids.shape[1], total, dtype=np.int64)[None, :]
        logits = self._run(ids, np.ones((1, total), dtype=np.int64), positions, slice(row, row + 1))
        self.lengths[row] = total
        self._keep(row, token)
        return logits[0, -1]

    def release(self, row: int) -> None:
        """Free the row and hand its memory back: the pages it wrote leave the process's RSS."""
        self.lengths[row], self.taken[row], self.row_ids[row] = 0, False, []
        for array, region in self._maps:
            row_bytes = array.nbytes // self.slots
            start = -(-row * row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the row
            end = (row + 1) * row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                region.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _check_room(self, total: int) -> None:
        if total > self.row_tokens:
            raise ValueError(f"{total} tokens do not fit a row of {self.row_tokens}; the scheduler admits what fits")

    def _binding(self, rows: slice):
        """The I/O binding of runs over buffer rows `rows`, its KV buffers bound once: the maps
        never move, so a view of the rows stays valid (a step binds the same 2 x layers buffers
        every time; binding them anew cost a tenth of a small model's step)."""
        key = (rows.start, rows.stop)
        if key not in self._bindings:
            binding = self._bindings[key] = self.session.io_binding()
            binding.bind_output(names.LOGITS)  # first: get_outputs()[0], however often it is bound again
            for past, present, array in zip(self._past, self._present, self._arrays, strict=True):
                value = ort.OrtValue.ortvalue_from_numpy(array[rows])  # a view: rows are contiguous
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
            if self.single.can_keep_last:
                binding.bind_cpu_input(names.LOGITS_TO_KEEP, np.array([1], dtype=np.int64))
        return self._bindings[key]

    def _run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, rows: slice, options=None) -> np.ndarray:
        """One run over buffer rows `rows`."""
        binding = self._binding(rows)
        binding.bind_cpu_input(names.INPUT_IDS, ids)
        if self.single.uses_attention_mask:
            binding.bind_cpu_input(names.ATTENTION_MASK, mask)
        if self.single.uses_position_ids:
            binding.bind_cpu_input(names.POSITION_IDS, np.ascontiguousarray(positions))
        binding.bind_output(names.LOGITS)  # bound again each run: onnxruntime allocates its new shape
        self.session.run_with_iobinding(binding, options)
        return binding.get_outputs()[0].numpy()


def _anonymous_map(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, mmap.mmap]:
    """A zeroed array in its own anonymous memory map, and the map (to hand pages back). Pages
    are 4 KB (numpy's own allocator asks for 2 MB huge pages, which a short row would fill)."""
    count = int(np.prod(shape))
    size = max(count * np.dtype(dtype).itemsize, 1)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype, count=count).reshape(shape), region

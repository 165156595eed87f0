"""Continuous batching: requests wait in a bounded queue, take a free row when the KV budget has
room for them, have their prompt prefilled a piece at a time between the running rows' steps, then
advance together one token per step, and leave when they end, are cancelled (a client that went
away) or hit their limit; their row and its memory are free at once.

One thread owns the model (a `Scheduler`); callers submit a `Job` from any thread and get tokens
through its callbacks, called on that thread. Each job samples with its own seeded generator, so
its tokens are those of a batch-1 run of it.

Memory is a budget (`KVBudget`): a job reserves room for its prompt and its max_new_tokens when it
joins, and a job that could never fit is refused at submit (TooLarge). A job waits in the queue
while the running ones hold the room it needs (first come, first served: nothing overtakes it).

No head-of-line blocking: while rows are decoding, the prompts being prefilled get time between
two steps. Waiting prompts whose rest fits in `finish_share` steps' time go whole, fewest tokens
left first: one longer gap instead of several short ones, so the batch fills sooner and fewer of
the running streams' gaps hold a piece. A longer prompt gets pieces whose measured time is at most
`prefill_share` times a step's, so a running stream waits at most 1 + prefill_share steps for a
token while it is prefilled. Both are times the number of prompts waiting per decoding row where
more wait than decode, and a short request arriving behind a long prompt
starts within a piece's time. Pieces change where a prompt is cut, not what is computed; a variant
validate did not prove pieces for (one activation scale per run), and a model whose rotary
frequencies depend on a run's length past its limit (LongRoPE), prefill whole prompts instead.

Nothing a job does can stop the loop: an exception while picking its token or calling its
callbacks ends that job alone (its on_end gets "error: ..."), one from a batched run ends the jobs
in it, and anything else ends every running job while the loop goes on. `last_progress` is when
the loop last made progress (a token, a prefilled piece, or work arriving at an idle loop), for a
liveness probe.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ortforge.batch import DEFAULT_ROW_TOKENS, BatchDecoder, PrefixCache
from ortforge.sampling import Sampler, Sampling

STOPPED, LENGTH, CANCELLED = "stop", "length", "cancelled"
# Prefill time between two decode steps, in decode steps, for a prompt too long to finish in one
# gap: a running stream waits at most 1 + PREFILL_SHARE steps per token while it is prefilled
# (benchmarks/server_soak.py: a stream beside a 4,000-token prompt; 8 here put its inter-token p95
# at x7.0 its alone).
PREFILL_SHARE = 1.5
# A waiting prompt whose rest takes at most this many steps' time goes whole into one gap: one long
# gap instead of several short ones, so the batch fills sooner and fewer of the running streams'
# gaps hold a piece (benchmarks/scheduler_replay.py, 8 streams of SmolLM2 w8a8: pieces of 1.5
# steps alone gave 223 tokens/s and first tokens at p95 949 ms; finishing within 8 steps, 296
# and 557 ms).
FINISH_SHARE = 8.0
MIN_SLOT_TOKENS = 256  # the budget must give every slot at least this much room
DEFAULT_MEMORY_SHARE = 0.25  # of the machine's memory, the most the default budget takes
log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and the queue is full: the caller should retry later."""


class TooLarge(ValueError):
    """A request's prompt and max_new_tokens need more KV cache than one request may hold."""


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    on_token: Callable[[int], None]
    on_end: Callable[[str], None]  # STOPPED (an end-of-sequence token), LENGTH, CANCELLED, or an error
    sampling: Sampling = field(default_factory=Sampling)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.sampler = Sampler(self.sampling)
        self.seen = list(self.prompt_ids)
        self.produced = 0
        self.last = -1
        self.row: int | None = None  # its row in the batch, once it has one
        self.filled = 0  # prompt tokens in its row so far
        self.decoding = False  # its prompt is in and its first token picked
        self.closed = False  # it has ended and given its room back

    @property
    def tokens_needed(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass
class KVBudget:
    """The KV cache's memory, in tokens of this model's cache: what every running job reserves
    (prompt + max_new_tokens) together stays within `tokens`; one job holds at most `row_tokens`."""

    bytes_per_token: int
    tokens: int
    row_tokens: int
    reserved: int = 0

    @classmethod
    def sized(cls, bytes_per_token: int, context: int | None, slots: int, megabytes: float | None = None) -> KVBudget:
        """megabytes None: room for every slot's whole context, within a quarter of the machine's
        memory. ValueError in one line when the budget is no use or the machine cannot hold it."""
        context = context or DEFAULT_ROW_TOKENS
        if megabytes is None:
            tokens = min(slots * context, int(DEFAULT_MEMORY_SHARE * _memory_bytes()) // bytes_per_token)
        elif megabytes <= 0:
            raise ValueError(f"--kv-cache-mb {megabytes:g} must be above 0")
        else:
            tokens = int(megabytes * 1e6) // bytes_per_token
            available = _available_bytes()
            if available and megabytes * 1e6 > available:
                raise ValueError(
                    f"--kv-cache-mb {megabytes:g} is more than this machine's available memory "
                    f"({available / 1e6:,.0f} MB); lower it"
                )
        floor = slots * min(MIN_SLOT_TOKENS, context)
        if tokens < floor:
            raise ValueError(
                f"a KV budget of {tokens * bytes_per_token / 1e6:,.1f} MB holds {tokens} tokens of this model's cache "
                f"({bytes_per_token / 1e3:,.1f} KB each); {slots} slots need at least {floor} "
                f"({floor * bytes_per_token / 1e6:,.1f} MB): raise --kv-cache-mb or lower --slots"
            )
        return cls(bytes_per_token, tokens, min(context, tokens))

    @property
    def megabytes(self) -> float:
        return self.tokens * self.bytes_per_token / 1e6

    def check(self, job: Job) -> None:
        if job.tokens_needed > self.row_tokens:
            raise TooLarge(
                f"a {len(job.prompt_ids)}-token prompt plus {job.max_new_tokens} new tokens needs "
                f"{job.tokens_needed} tokens of KV cache; this server gives one request at most {self.row_tokens} "
                f"(--kv-cache-mb {self.megabytes:,.1f}): shorten the prompt, ask for fewer tokens, or raise the budget"
            )

    def fits(self, job: Job) -> bool:
        return self.reserved + job.tokens_needed <= self.tokens


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _available_bytes() -> int | None:
    """MemAvailable (what can be taken without swapping), None where /proc does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Scheduler:
    def __init__(
        self,
        generator,
        slots: int = 4,
        queue_size: int = 16,
        prefix_cache_mb: float = 0,
        kv_cache_mb: float | None = None,
        prefill_share: float = PREFILL_SHARE,
        finish_share: float = FINISH_SHARE,
    ):
        """generator: a TextGenerator (its session, stop ids and prompt checks); prefix_cache_mb: the
        memory shared prompt starts may keep (0: no prefix reuse); kv_cache_mb: the KV budget (None:
        KVBudget.sized's default); prefill_share: prefill time allowed between two decode steps for
        a prompt too long to finish in one gap; finish_share: the prefill time in which waiting
        prompts' rests go whole into one gap (0: always in paced pieces)."""
        if queue_size < 0 or prefix_cache_mb < 0 or prefill_share <= 0 or finish_share < 0:
            raise ValueError(
                f"queue_size {queue_size}, prefix_cache_mb {prefix_cache_mb} and finish_share {finish_share} "
                f"must be >= 0, prefill_share {prefill_share} above 0"
            )
        if generator.prefill_chunk < 1:  # a piece of no tokens would never finish a prompt
            raise ValueError(f"the generator's prefill_chunk {generator.prefill_chunk} must be at least 1 token")
        self.generator, self.queue_size, self.prefill_share = generator, queue_size, prefill_share
        self.finish_share = finish_share
        decoder = generator.decoder
        prefixes = PrefixCache(int(prefix_cache_mb * 1e6)) if prefix_cache_mb else None
        self.kv = KVBudget.sized(decoder.kv_bytes_per_token, decoder.context_length, slots, kv_cache_mb)
        if BatchDecoder.supports(generator.session):
            self.batch = BatchDecoder(
                generator.session,
                slots,
                generator.prefill_chunk,
                prefixes,
                self.kv.row_tokens,
                generator.rope,
                generator.proven,
            )
            self.note = f"continuous batching over {slots} slots, KV budget {self.kv.megabytes:,.0f} MB" + (
                f", prefix cache {prefix_cache_mb:g} MB" if prefixes else ""
            )
            if not generator.proven.rows:
                self.note += "; each row steps alone (validate did not prove batched rows equal to rows alone)"
            elif generator.rope is not None:
                self.note += f"; rows past {generator.rope.limit} tokens run alone (length-dependent rope)"
        else:
            self.batch = None
            self.note = "this graph has no shared KV buffers: one sequence per run, requests take turns"
        self.slots = slots if self.batch else 1
        self.piece = generator.prefill_chunk  # the most tokens of a prompt one run takes
        self.active: dict[int, Job] = {}  # row -> job, prefilling or decoding
        self.widest_step = 0  # the most rows one run has advanced together (for tests and stats)
        self.joined_running = 0  # jobs that joined while others were decoding
        self.step_seconds: float | None = None  # the last decode step's time
        self.prefill_token_seconds: float | None = None  # a prefill token's time, smoothed
        self._pending: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ortforge-scheduler", daemon=True)
        self.last_progress = time.monotonic()

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def busy(self) -> bool:
        return bool(self.active or self._pending)

    @property
    def kv_used_bytes(self) -> int:
        """KV cache bytes that hold tokens now (the pages a finished row used are handed back)."""
        return sum(self.batch.lengths) * self.kv.bytes_per_token if self.batch else 0

    def submit(self, job: Job) -> None:
        """Queue a job (its prompt already checked against the context); TooLarge when it could
        never fit the KV budget, QueueFull when the queue is full."""
        self.kv.check(job)
        with self._wake:
            if len(self.active) + len(self._pending) >= self.slots + self.queue_size:
                raise QueueFull(f"all {self.slots} slots are busy and {self.queue_size} requests wait already")
            if not self.busy:  # the stall clock starts when work arrives, not at the last reply
                self.last_progress = time.monotonic()
            self._pending.append(job)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._pending or self.active or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    return
                joining = self._admit()
            try:
                self._work(joining)
            except Exception as error:  # noqa: BLE001 - a fault of ours: every running job ends, the loop goes on
                log.exception("the scheduler's step failed; ending the running jobs")
                for row, job in list(self.active.items()):
                    self._end(row, job, f"error: {error}")
                for job in joining:
                    self._close(job, f"error: {error}")  # those that had not ended

    def _admit(self) -> list[Job]:
        """The queue's first jobs, while a slot is free and the budget has room for the next one."""
        joining = []
        while self._pending and len(self.active) + len(joining) < self.slots and self.kv.fits(self._pending[0]):
            job = self._pending.popleft()
            self.kv.reserved += job.tokens_needed
            joining.append(job)
        return joining

    def _work(self, joining: list[Job]) -> None:
        if self.batch is None:
            for job in joining:
                self._run_alone(job)
            return
        self.joined_running += len(joining) if self.active else max(0, len(joining) - 1)
        for job in joining:
            self._join(job)
        self._decode()
        self._prefill()

    def _join(self, job: Job) -> None:
        if job.cancelled.is_set():
            return self._close(job, CANCELLED)
        row = self.batch.free_rows()[0]
        try:
            self.batch.begin(row, job.prompt_ids)
        except Exception as error:  # noqa: BLE001 - the job ends with the reason; the server goes on
            self.batch.release(row)
            return self._close(job, f"error: {error}")
        job.row = row
        self.active[row] = job

    def _decode(self) -> None:
        """One step for every row past its prompt."""
        tokens = {row: job.last for row, job in self.active.items() if job.decoding}
        if not tokens:
            return
        self.widest_step = max(self.widest_step, len(tokens))
        started = time.perf_counter()
        try:
            stepped = self.batch.step(tokens)
        except Exception as error:  # noqa: BLE001 - the step's jobs end with the reason; the loop goes on
            for row in tokens:
                self._end(row, self.active[row], f"error: {error}")
            return
        self.step_seconds = time.perf_counter() - started
        for row, logits in stepped.items():
            self._advance(row, self.active[row], logits)

    def _prefill(self) -> None:
        """Pieces of the waiting prompts, fewest tokens left first, within this turn's allowance."""
        waiting = sorted((job for job in self.active.values() if not job.decoding), key=_tokens_left)
        allowance = self._prefill_allowance(waiting)
        for job in waiting:
            if allowance <= 0:
                return
            if job.cancelled.is_set():
                self._end(job.row, job, CANCELLED)
                continue
            allowance -= self._prefill_piece(job, allowance)

    def _prefill_allowance(self, waiting: list[Job]) -> int:
        """Prompt tokens to prefill before the next decode step: one piece while no row decodes,
        else the rests of the waiting prompts (sorted fewest tokens left first) that fit in finish_share steps'
        time at the measured prefill speed, or, when none does, what fits in prefill_share steps'
        time. Both are times the prompts waiting per decoding row where more wait than decode:
        filling the batch is worth more than a few rows' next tokens (8 streams of SmolLM2 w8a8
        here, with pieces of 1.5 steps alone: x1.10 tokens/s and first tokens' p95 x0.7, the
        inter-token p95 unchanged), and the rows already decoding pay, together, the same share
        for each prompt that joins them."""
        decoding = len(self.active) - len(waiting)
        if not decoding:
            return self.piece
        if self.step_seconds is None or self.prefill_token_seconds is None:
            return 1  # measure first
        waiting_per_row = max(1.0, len(waiting) / decoding)
        tokens_per_step = self.step_seconds * waiting_per_row / self.prefill_token_seconds
        paced = max(1, int(self.prefill_share * tokens_per_step))  # at least a token: a prompt always progresses
        finishing = 0  # the waiting prompts, fewest tokens left first, that finish within finish_share steps
        for left in map(_tokens_left, waiting):
            if finishing + left > self.finish_share * tokens_per_step:
                break
            finishing += left
        return max(paced, finishing)

    def _prefill_piece(self, job: Job, allowance: int) -> int:
        """Prefill the job's next piece (at most allowance tokens); how many tokens ran."""
        prompt, row = job.prompt_ids, job.row
        if not job.filled:  # its first piece: a prompt prefilled meanwhile may share its start
            job.filled = self.batch.reuse_prefix(row, prompt)
        size = min(_tokens_left(job), allowance, self.piece)
        if not self.batch.single.runs_like_any(len(prompt)):  # unproven pieces, or past the rope limit: whole
            size = _tokens_left(job)
        last = job.filled + size == len(prompt)
        started = time.perf_counter()
        try:
            logits = self.batch.prefill_piece(row, prompt[job.filled : job.filled + size], last=last)
        except Exception as error:  # noqa: BLE001 - the job ends with the reason; the server goes on
            self._end(row, job, f"error: {error}")
            return size
        spent = (time.perf_counter() - started) / size
        smoothed = self.prefill_token_seconds
        self.prefill_token_seconds = spent if smoothed is None else 0.5 * (smoothed + spent)
        self.last_progress = time.monotonic()
        job.filled += size
        if last:
            self.batch.finish(row, prompt)
            job.decoding = True
            self._advance(row, job, logits)
        return size

    def _advance(self, row: int, job: Job, logits) -> None:
        """Pick the job's next token, hand it over, and free the row when the job has ended. Its
        sampling or its callback failing ends this job alone."""
        try:
            end = self._next(job, logits)
        except Exception as error:  # noqa: BLE001 - this job's fault: it ends, the others go on
            end = f"error: {error}"
        if end:
            self._end(row, job, end)

    def _end(self, row: int, job: Job, reason: str) -> None:
        del self.active[row]
        self.batch.release(row)
        self._close(job, reason)

    def _close(self, job: Job, reason: str) -> None:
        """The job is over: its room goes back to the budget and its client hears why (once)."""
        if job.closed:
            return
        job.closed = True
        self.kv.reserved -= job.tokens_needed
        _ended(job, reason)

    def _next(self, job: Job, logits) -> str | None:
        self.last_progress = time.monotonic()
        if job.cancelled.is_set():
            return CANCELLED
        token = job.sampler.pick(logits, job.seen)
        job.seen.append(token)
        job.produced += 1
        job.last = token
        job.on_token(token)
        if token in self.generator.stop_ids:
            return STOPPED
        return LENGTH if job.produced == job.max_new_tokens else None

    def _run_alone(self, job: Job) -> None:
        """A graph without shared buffers: the job's whole generation, one token at a time."""
        decoder = self.generator.decoder
        try:
            logits, cache = decoder.forward(job.prompt_ids, decoder.empty_cache(), last_only=True)
            while not (end := self._next(job, logits[-1])):
                logits, cache = decoder.forward([job.last], cache, last_only=True)
        except Exception as error:  # noqa: BLE001 - the job ends with the reason; the server goes on
            end = f"error: {error}"
        self._close(job, end)


def _tokens_left(job: Job) -> int:
    return len(job.prompt_ids) - job.filled


def _ended(job: Job, reason: str) -> None:
    """Tell the job it ended; a callback that fails cannot take the loop down with it."""
    try:
        job.on_end(reason)
    except Exception:  # noqa: BLE001 - nothing left to tell this job
        log.exception("a job's on_end callback failed")

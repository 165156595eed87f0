"""Continuous batching: requests wait in a bounded queue, join the running batch at the next step
(their prompt prefilled into a free row), advance together one token per step, and leave when they
end, are cancelled (a client that went away) or hit their limit; their row is free at once.

One thread owns the model (a `Scheduler`); callers submit a `Job` from any thread and get tokens
through its callbacks, called on that thread. Each job samples with its own seeded generator, so
its tokens are those of a batch-1 run of it.

Nothing a job does can stop the loop: an exception while picking its token or calling its
callbacks ends that job alone (its on_end gets "error: ..."), one from a batched run ends the jobs
in it, and anything else ends every running job while the loop goes on. `last_progress` is when
the loop last produced a token (or work arrived at an idle loop), for a liveness probe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ortforge.batch import BatchDecoder, PrefixCache
from ortforge.sampling import Sampler, Sampling

STOPPED, LENGTH, CANCELLED = "stop", "length", "cancelled"
log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is busy and the queue is full: the caller should retry later."""


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


class Scheduler:
    def __init__(self, generator, slots: int = 4, queue_size: int = 16, prefix_cache_mb: float = 0):
        """generator: a TextGenerator (its session, stop ids and prompt checks); prefix_cache_mb: the
        memory shared prompt starts may keep (0: no prefix reuse)."""
        if queue_size < 0 or prefix_cache_mb < 0:
            raise ValueError(f"queue_size {queue_size} and prefix_cache_mb {prefix_cache_mb} must be >= 0")
        self.generator, self.queue_size = generator, queue_size
        prefixes = PrefixCache(int(prefix_cache_mb * 1e6)) if prefix_cache_mb else None
        if BatchDecoder.supports(generator.session):
            self.batch = BatchDecoder(generator.session, slots, generator.settings.prefill_chunk, prefixes)
            self.note = f"continuous batching over {slots} slots" + (
                f", prefix cache {prefix_cache_mb:g} MB" if prefixes else ""
            )
        else:
            self.batch = None
            self.note = "this graph has no shared KV buffers: one sequence per run, requests take turns"
        self.slots = slots if self.batch else 1
        self.active: dict[int, Job] = {}
        self.widest_step = 0  # the most rows one run has advanced together (for tests and stats)
        self.joined_running = 0  # jobs that joined while others were decoding
        self._pending: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ortforge-scheduler", daemon=True)
        self.last_progress = time.monotonic()  # a token was produced (or work arrived at an idle loop)

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

    def submit(self, job: Job) -> None:
        """Queue a job (its prompt already checked against the context); QueueFull when the queue is."""
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
                joining = []
                while self._pending and len(self.active) + len(joining) < self.slots:
                    joining.append(self._pending.popleft())
            try:
                self._work(joining)
            except Exception as error:  # noqa: BLE001 - a fault of ours: every running job ends, the loop goes on
                log.exception("the scheduler's step failed; ending the running jobs")
                for row, job in list(self.active.items()):
                    self._end(row, job, f"error: {error}")
                for job in joining:
                    if job not in self.active.values():
                        _ended(job, f"error: {error}")

    def _work(self, joining: list[Job]) -> None:
        if self.batch is None:
            for job in joining:
                self._run_alone(job)
            return
        self.joined_running += len(joining) if self.active else max(0, len(joining) - 1)
        for job in joining:
            self._join(job)
        if self.active:
            self._step()

    def _join(self, job: Job) -> None:
        if job.cancelled.is_set():
            return _ended(job, CANCELLED)
        row = self.batch.free_rows()[0]
        try:
            logits = self.batch.prefill(row, job.prompt_ids)
        except Exception as error:  # noqa: BLE001 - the job ends with the reason; the server goes on
            self.batch.release(row)
            return _ended(job, f"error: {error}")
        self.active[row] = job
        self._advance(row, job, logits)

    def _step(self) -> None:
        tokens = {row: job.last for row, job in self.active.items()}
        self.widest_step = max(self.widest_step, len(tokens))
        try:
            stepped = self.batch.step(tokens)
        except Exception as error:  # noqa: BLE001 - every running job ends with the reason; the loop goes on
            for row, job in list(self.active.items()):
                self._end(row, job, f"error: {error}")
            return
        for row, logits in stepped.items():
            self._advance(row, self.active[row], logits)

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
        _ended(job, end)


def _ended(job: Job, reason: str) -> None:
    """Tell the job it ended; a callback that fails cannot take the loop down with it."""
    try:
        job.on_end(reason)
    except Exception:  # noqa: BLE001 - nothing left to tell this job
        log.exception("a job's on_end callback failed")

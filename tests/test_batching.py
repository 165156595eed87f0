"""Batched decode and continuous batching: sequences of different lengths that join and leave a
running batch get exactly the tokens of a batch-1 run of each (greedy and seeded sampling)."""

from __future__ import annotations

import mmap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ortforge.batch import BatchDecoder, PrefixCache
from ortforge.generate import TextGenerator
from ortforge.sampling import Sampling
from ortforge.scheduler import CANCELLED, LENGTH, Job, QueueFull, Scheduler, TooLarge

PROMPTS = [
    "The GNU General Public License is",
    "Free software",
    "the freedom to share and change all versions of a program, to make sure it remains free software",
    "You",
    "Developers that use the GNU GPL protect your rights with two steps:",
]


@pytest.fixture(scope="module", params=["fp32", "int4", "int8"])
def generator(request, built):
    """Float and MatMulNBits graphs: a many-row matmul must give each row what one row gets."""
    return TextGenerator(built[request.param])


def run_jobs(scheduler: Scheduler, jobs: list[tuple[list[int], int, Sampling]], start: bool = True):
    """Queue every job, then start the scheduler (so the first ones share the first runs and the
    rest join as rows free up), and wait for all; each job's tokens and end."""
    results = [{"tokens": [], "end": None, "done": threading.Event()} for _ in jobs]
    for (ids, count, sampling), result in zip(jobs, results, strict=True):

        def on_end(end, result=result):
            result["end"] = end
            result["done"].set()

        scheduler.submit(Job(ids, count, result["tokens"].append, on_end, sampling))
    if start:  # (False: it is running already)
        scheduler.start()
    for result in results:
        assert result["done"].wait(120)
    return results


def test_a_batched_step_equals_each_sequence_alone(generator):
    batch = BatchDecoder(generator.session, slots=3)
    ids = [generator.encode(p) for p in PROMPTS[:3]]
    first = {row: batch.prefill(row, prompt) for row, prompt in enumerate(ids)}
    tokens = {row: int(np.argmax(logits)) for row, logits in first.items()}
    stepped = batch.step(tokens)
    for row, prompt in enumerate(ids):
        alone = generator.decoder
        logits, cache = alone.forward(prompt, alone.empty_cache(), last_only=True)
        np.testing.assert_allclose(first[row], logits[-1], rtol=1e-5, atol=1e-5)
        logits, _ = alone.forward([tokens[row]], cache, last_only=True)
        np.testing.assert_allclose(stepped[row], logits[-1], rtol=1e-5, atol=1e-5)


def test_sequences_joining_and_leaving_get_their_batch_1_tokens(generator):
    scheduler = Scheduler(generator, slots=3, queue_size=8)
    try:
        jobs = [(generator.encode(p), n, Sampling()) for p, n in zip(PROMPTS, (12, 3, 9, 16, 5), strict=True)]
        jobs += [(generator.encode(PROMPTS[0]), 10, Sampling(temperature=1.3, top_p=0.9, seed=s)) for s in (1, 2)]
        results = run_jobs(scheduler, jobs)
    finally:
        scheduler.stop()
    for (ids, count, sampling), result in zip(jobs, results, strict=True):
        assert result["tokens"] == generator.generate_ids(ids, count, sampling)
        assert result["end"] in (LENGTH, "stop")
    assert scheduler.widest_step >= 2 and scheduler.joined_running >= 1  # they really shared runs
    assert scheduler.active == {} and scheduler.batch.free_rows() == [0, 1, 2]


def test_a_cancelled_job_frees_its_row_at_the_next_step(generator):
    scheduler = Scheduler(generator, slots=1, queue_size=1).start()
    try:
        started, ended = threading.Event(), []
        prompt = generator.encode(PROMPTS[0])
        room = generator.decoder.context_length - len(prompt)  # long enough to cancel mid-way
        job = Job(prompt, room, lambda _: started.set(), ended.append)
        scheduler.submit(job)
        assert started.wait(30)
        with pytest.raises(QueueFull):  # the slot is busy and one more may wait: a third is refused
            scheduler.submit(Job([1], 1, print, print))
            scheduler.submit(Job([1], 1, print, print))
        job.cancelled.set()
        deadline = time.time() + 10
        while ended[:1] != [CANCELLED] and time.time() < deadline:
            time.sleep(0.01)
        assert ended[0] == CANCELLED
    finally:
        scheduler.stop()


def test_a_graph_without_shared_buffers_takes_turns_and_says_so(built_optimum):
    generator = TextGenerator(built_optimum["fp32"])
    scheduler = Scheduler(generator, slots=4)
    try:
        assert scheduler.slots == 1 and "one sequence per run" in scheduler.note
        jobs = [(generator.encode(p), 6, Sampling()) for p in PROMPTS[:3]]
        results = run_jobs(scheduler, jobs)
    finally:
        scheduler.stop()
    assert [r["tokens"] for r in results] == [generator.generate_ids(ids, n, s) for ids, n, s in jobs]


def test_a_shared_prompt_start_is_reused_and_gives_the_same_tokens(generator):
    scheduler = Scheduler(generator, slots=2, queue_size=8, prefix_cache_mb=64)
    system = PROMPTS[2] + " " + PROMPTS[4]  # a system prompt both requests start with
    asks = [generator.encode(system + " Question one:"), generator.encode(system + " And another one")]
    shared = next(i for i, (a, b) in enumerate(zip(*asks, strict=False)) if a != b)
    assert shared >= 16
    try:
        results = run_jobs(scheduler, [(ids, 8, Sampling()) for ids in asks])
    finally:
        scheduler.stop()
    assert [r["tokens"] for r in results] == [generator.generate_ids(ids, 8) for ids in asks]
    assert scheduler.batch.prefixes.reused_tokens == shared  # the second computed only its own end


def test_the_prefix_cache_keeps_its_budget_and_evicts_the_least_recently_used():
    entry = [np.zeros((2, 20, 4), np.float32)]  # 640 bytes
    cache = PrefixCache(max_bytes=1500, min_tokens=4)
    cache.add(list(range(20)), entry)
    cache.add(list(range(100, 120)), entry)
    assert cache.longest([*range(10), 7])[0] == 10  # the first entry, now the most recently used
    cache.add(list(range(200, 220)), entry)  # over the budget: the least recently used goes
    assert cache.longest(list(range(100, 110)))[0] == 0
    assert cache.longest(list(range(200, 206)))[0] == 6
    assert cache.longest([0, 1, 2])[0] == 0  # fewer than min_tokens shared: computed as usual


def test_a_failing_step_ends_the_running_jobs_with_the_reason_and_the_loop_goes_on(generator, monkeypatch):
    scheduler = Scheduler(generator, slots=2)

    def broken(self, tokens):
        raise RuntimeError("kernel failed")

    with monkeypatch.context() as patched:
        patched.setattr(BatchDecoder, "step", broken)
        try:
            results = run_jobs(scheduler, [(generator.encode(p), 5, Sampling()) for p in PROMPTS[:2]])
        except BaseException:
            scheduler.stop()
            raise
    assert [r["end"] for r in results] == ["error: kernel failed"] * 2
    assert scheduler.batch.free_rows() == [0, 1]
    try:  # the same scheduler serves the next request once the model runs again
        (after,) = run_jobs(scheduler, [(generator.encode(PROMPTS[0]), 4, Sampling())], start=False)
    finally:
        scheduler.stop()
    assert after["tokens"] == generator.generate_ids(generator.encode(PROMPTS[0]), 4)


def test_a_job_whose_own_sampling_or_callback_fails_ends_alone(generator):
    """One job's fault (its sampler, its on_token) ends that job with the reason; the job beside it
    in the same steps gets its batch-1 tokens, and the loop stays alive."""
    scheduler = Scheduler(generator, slots=2)
    prompts = [generator.encode(p) for p in PROMPTS[:2]]
    failing = {"tokens": [], "end": None, "done": threading.Event()}

    def on_token(token):
        if len(failing["tokens"]) == 2:
            raise RuntimeError("the client's callback failed")
        failing["tokens"].append(token)

    def on_end(end):
        failing["end"] = end
        failing["done"].set()

    scheduler.submit(Job(prompts[0], 8, on_token, on_end, Sampling()))
    try:
        (healthy,) = run_jobs(scheduler, [(prompts[1], 8, Sampling())])
        assert failing["done"].wait(60) and scheduler.alive
    finally:
        scheduler.stop()
    assert failing["end"] == "error: the client's callback failed" and len(failing["tokens"]) == 2
    assert healthy["tokens"] == generator.generate_ids(prompts[1], 8)
    assert scheduler.batch.free_rows() == [0, 1]


@pytest.fixture(scope="module")
def fp32_generator(built):
    return TextGenerator(built["fp32"])


def long_prompt(generator: TextGenerator, tokens: int) -> list[int]:
    ids = generator.encode(" ".join(PROMPTS * 60))[:tokens]
    assert len(ids) == tokens
    return ids


def test_a_long_prompt_is_prefilled_between_the_running_streams_steps_and_a_short_one_overtakes_it(
    fp32_generator,
):
    """While a long prompt is prefilled a piece at a time, the running stream keeps getting tokens,
    a short request sent after the long one gets its first token first, and every job's tokens are
    its batch-1 tokens."""
    generator = fp32_generator
    scheduler = Scheduler(generator, slots=3, queue_size=4, prefill_share=0.5).start()
    events: list[tuple[str, str]] = []  # (job, "token" or its end), in the order the loop made them
    done = {name: threading.Event() for name in ("stream", "long", "short")}
    asks = {
        "stream": (generator.encode(PROMPTS[2]), 200),
        "long": (long_prompt(generator, 700), 4),
        "short": (generator.encode(PROMPTS[3]), 4),
    }
    tokens = {name: [] for name in asks}

    def submit(name):
        def on_token(token):
            tokens[name].append(token)
            events.append((name, "token"))

        def on_end(end):
            events.append((name, end))
            done[name].set()

        scheduler.submit(Job(asks[name][0], asks[name][1], on_token, on_end))

    try:
        submit("stream")
        deadline = time.time() + 30
        while not tokens["stream"] and time.time() < deadline:
            time.sleep(0.001)
        with scheduler._wake:  # noqa: SLF001 - both arrive before the loop's next turn
            submit("long")
            submit("short")
        assert all(event.wait(120) for event in done.values())
    finally:
        scheduler.stop()
    order = [name for name, kind in events if kind == "token"]
    long_first, short_first = order.index("long"), order.index("short")
    assert short_first < long_first  # the short prompt did not wait for the long one's prefill
    assert order[short_first:long_first].count("stream") >= 3  # the stream kept decoding meanwhile
    for name, (ids, count) in asks.items():
        assert tokens[name] == generator.generate_ids(ids, count)[: len(tokens[name])]
    assert scheduler.kv.reserved == 0 and scheduler.batch.free_rows() == [0, 1, 2]


def test_the_kv_budget_admits_what_fits_and_refuses_what_never_can(fp32_generator):
    generator = fp32_generator
    per_token = generator.decoder.kv_bytes_per_token
    budget_mb = 600 * per_token / 1e6
    scheduler = Scheduler(generator, slots=2, queue_size=4, kv_cache_mb=budget_mb)
    assert (scheduler.kv.tokens, scheduler.kv.row_tokens) == (600, 600)
    with pytest.raises(TooLarge, match="needs 610 tokens of KV cache; this server gives one request at most 600"):
        scheduler.submit(Job(long_prompt(generator, 600), 10, print, print))
    prompts = [long_prompt(generator, 300), generator.encode(PROMPTS[0])]
    try:  # 300 + 20 and 16 + 290 tokens: together past the budget, so the second waits for the first
        results = run_jobs(scheduler, [(prompts[0], 20, Sampling()), (prompts[1], 290, Sampling())])
    finally:
        scheduler.stop()
    assert scheduler.widest_step == 1 and scheduler.kv.reserved == 0
    assert results[0]["tokens"] == generator.generate_ids(prompts[0], 20)
    with pytest.raises(ValueError, match="3 slots need at least 768"):
        Scheduler(generator, slots=3, kv_cache_mb=budget_mb)


def resident_bytes(array: np.ndarray) -> int:
    """The bytes of `array`'s own pages that are in RAM now, from /proc/self/pagemap (bit 63:
    present). Not the Rss of its mapping in /proc/self/smaps: the kernel merges neighbouring
    anonymous maps with equal flags into one, so that Rss also counts other buffers' pages."""
    page = mmap.PAGESIZE
    first, last = array.ctypes.data // page, (array.ctypes.data + array.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype="<u8")
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads Linux's /proc/self/pagemap")
def test_a_released_row_gives_its_memory_back(fp32_generator):
    batch = BatchDecoder(fp32_generator.session, slots=2, row_tokens=1024)
    keys = batch._arrays[0]  # noqa: SLF001 - the first layer's key buffer
    assert resident_bytes(keys) == 0  # nothing written, nothing held
    batch.prefill(0, long_prompt(fp32_generator, 1000))
    row_bytes = keys.nbytes // 2
    assert resident_bytes(keys) >= 0.9 * row_bytes
    batch.release(0)
    assert resident_bytes(keys) == 0


def test_a_waiting_prompt_that_finishes_within_the_finish_share_goes_whole_and_a_long_one_is_paced(fp32_generator):
    """With one row decoding (a step of 10 ms) and prefill at 1 ms a token: a 50-token prompt
    (50 ms, within 8 steps) goes whole into the next gap; a 4,000-token one gets 1.5 steps' time,
    so the running stream waits at most 2.5 steps per token while it is prefilled."""
    scheduler = Scheduler(fp32_generator, slots=3, queue_size=2, prefill_share=1.5, finish_share=8)
    scheduler.step_seconds, scheduler.prefill_token_seconds = 0.010, 0.001
    running = Job([1, 2, 3], 10, print, print)
    running.decoding = True
    long, short = Job([5] * 4000, 4, print, print), Job([7] * 50, 4, print, print)
    scheduler.active = {0: running, 1: long}
    assert scheduler._prefill_allowance([long]) == 15  # noqa: SLF001 - paced: 1.5 steps of 10 ms at 1 ms a token
    scheduler.active[2] = short
    assert scheduler._prefill_allowance([short, long]) == 50  # noqa: SLF001 - the short one finishes within 8 steps


@pytest.mark.parametrize("shares", [{"prefill_share": 0}, {"finish_share": -1}])
def test_a_share_that_would_stall_or_mean_nothing_is_refused_in_one_line(fp32_generator, shares):
    with pytest.raises(ValueError, match="prefill_share .* above 0"):
        Scheduler(fp32_generator, slots=1, **shares)


def test_a_generator_whose_prompt_pieces_hold_no_tokens_is_refused(fp32_generator, monkeypatch):
    """A piece of 0 tokens would leave a prompt unfinished forever: the scheduler refuses it at once."""
    assert fp32_generator.prefill_chunk >= 1  # TextGenerator's own: the tuned chunk, else LONG_PROMPT_PIECE
    monkeypatch.setattr(fp32_generator, "prefill_chunk", 0)
    with pytest.raises(ValueError, match="prefill_chunk 0 must be at least 1 token"):
        Scheduler(fp32_generator, slots=1)

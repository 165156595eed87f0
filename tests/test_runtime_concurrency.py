"""The runtime under processes and threads: spawned workers each create their own session, threads
share one generator, and every answer equals a single-threaded run. Sessions never cross a process
boundary: pickling one fails with the fix in the message."""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest

from ortforge.generate import TextGenerator

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23], [8, 8, 8, 8, 8, 8, 8, 8, 8], [30, 2]]
NEW_TOKENS = 12


def generate_in_worker(folder: str, prompt: list[int]) -> list[int]:
    # Runs in a spawned process: it loads the artifact itself, nothing is inherited.
    return TextGenerator(folder).generate_ids(prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def expected(built) -> list[list[int]]:
    generator = TextGenerator(built["int4"])
    return [generator.generate_ids(prompt, NEW_TOKENS) for prompt in PROMPTS]


def test_spawned_workers_match_a_single_process_run(built, expected):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(generate_in_worker, [(str(built["int4"]), prompt) for prompt in PROMPTS])
    assert results == expected


def test_threads_sharing_one_generator_match_a_single_thread_run(built, expected):
    generator = TextGenerator(built["int4"])
    jobs = PROMPTS * 4  # more requests than threads, so each thread's decoder serves several
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda prompt: generator.generate_ids(prompt, NEW_TOKENS), jobs))
    assert results == expected * 4


def test_sessions_refuse_to_be_pickled_with_the_fix(built):
    generator = TextGenerator(built["int4"])
    for thing in (generator, generator.decoder):
        with pytest.raises(TypeError, match="create a TextGenerator .* inside each process"):
            pickle.dumps(thing)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        with pytest.raises(TypeError, match="cannot be pickled"):
            pool.apply(len, (generator,))

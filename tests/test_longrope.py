"""A LongRoPE model (Phi-3.5-mini's and Phi-4-mini's rope) served with the settings bench may pick:
its graph takes the long factors once a run's total length passes the original context, so a
prompt cut in pieces, a batched run wider than a row, or a draft check would compute tokens with
other frequencies than PyTorch does. Past the limit the runtime runs only what PyTorch runs (the
whole prompt, one token a step, the whole sequence again as it first passes the limit); below it
the measured chunk still applies. Every check here is against transformers' forward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortforge import cli, machine
from ortforge.generate import TextGenerator
from ortforge.manifest import runtime_config
from ortforge.sampling import Sampling
from ortforge.scheduler import Scheduler
from ortforge.session import SessionSettings
from tests import families
from tests.conftest import EVAL_TEXT
from tests.test_batching import run_jobs

LIMIT, LONGROPE = families.LONGROPE_LIMIT, families.LONGROPE
CHUNK = 8  # a prefill chunk such as bench's tuning writes into runtime.json
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """The tiny Phi-3 LongRoPE model through every stage to a validated fp32, with bench-style
    tuned settings beside it that cut prompts in chunks of CHUNK tokens."""
    built = families.through_every_stage("phi3", tmp_path_factory.mktemp("longrope"), ("fp32",), **LONGROPE)
    folders = built["folders"]
    settings = SessionSettings(prefill_chunk=CHUNK).to_dict()
    record = {"session": settings, "measured_by": "this test, as bench writes it", "machine": machine.describe()}
    runtime_config(folders["fp32"]).write_text(json.dumps(record))
    assert SessionSettings.for_artifact(folders["fp32"]).prefill_chunk == CHUNK
    return folders


def pytorch_tokens(hf_dir, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' forward over the whole sequence at every step: the short
    factors while it fits the original context, the long ones for every position after. That is
    what Phi-3's generate means by recomputing the cache as a sequence first passes the limit
    (transformers PR 33129); transformers 4.57.6's generate runs that recompute with a one-position
    cache_position, so its causal mask is wrong for that one step, and is not the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            if tokens[-1] == model.config.eos_token_id:
                break
    return tokens[len(prompt) :]


def prompts(generator: TextGenerator) -> dict[str, list[int]]:
    """A prompt past the limit, and one below it whose reply crosses it."""
    ids = generator.encode(EVAL_TEXT.read_text(encoding="utf-8")[:2000])
    return {"past the limit": ids[: LIMIT + 17], "crossing it while decoding": ids[: LIMIT - 12]}


def test_the_tuned_chunk_gives_pytorch_tokens_on_both_sides_of_the_limit(longrope):
    generator = TextGenerator(longrope["fp32"])  # the tuned settings, as generate and serve load them
    assert generator.prefill_chunk == CHUNK and generator.rope.limit == LIMIT
    for case, prompt in prompts(generator).items():
        assert generator.generate_ids(prompt, NEW_TOKENS) == pytorch_tokens(longrope["hf"], prompt, NEW_TOKENS), case
    decoder = generator.decoder
    assert decoder.runs_like_any(LIMIT) and not decoder.runs_like_any(LIMIT + 1)  # chunks below, whole past


def test_a_chunked_prompt_past_the_limit_would_differ_from_pytorch(longrope):
    """The case the rule exists for: forcing the chunk past the limit (as the runtime did) changes
    the first token's logits, so the test above is not passing by luck."""
    generator = TextGenerator(longrope["fp32"])
    prompt = prompts(generator)["past the limit"]
    decoder = generator.decoder
    whole, _ = decoder.forward(prompt, decoder.empty_cache(), last_only=True)
    decoder.rope = None  # no rule: chunks of CHUNK tokens whatever the length
    chunked, _ = decoder.forward(prompt, decoder.empty_cache(), last_only=True)
    assert np.abs(chunked[-1] - whole[-1]).max() > 1e-2 * np.abs(whole[-1]).max()


def test_ortforge_generate_prints_pytorch_text(longrope, capsys):
    generator = TextGenerator(longrope["fp32"])
    prompt = prompts(generator)["past the limit"]
    text = generator.tokenizer.decode(prompt)
    expected = generator.tokenizer.decode(pytorch_tokens(longrope["hf"], generator.encode(text), NEW_TOKENS))
    args = ["generate", str(longrope["fp32"]), text, "--raw", "--max-new-tokens", str(NEW_TOKENS)]
    assert cli.main(args) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert cli.main([*args, "--prompt-lookup", "3"]) == 0  # draft checks past the limit: one token a run
    assert capsys.readouterr().out == expected + "\n"


def test_batched_rows_either_side_of_the_limit_give_pytorch_tokens(longrope):
    """The server's continuous batching: one row past the limit and one below it share the
    scheduler; a run as wide as the long row would give the short one the long factors."""
    generator = TextGenerator(longrope["fp32"])
    scheduler = Scheduler(generator, slots=2)
    assert scheduler.batch is not None and "run alone" in scheduler.note
    cases = prompts(generator)
    try:
        results = run_jobs(scheduler, [(prompt, NEW_TOKENS, Sampling()) for prompt in cases.values()])
    finally:
        scheduler.stop()
    for (case, prompt), result in zip(cases.items(), results, strict=True):
        assert result["tokens"] == pytorch_tokens(longrope["hf"], prompt, NEW_TOKENS), case
    assert scheduler.widest_step == 2  # the rows did share runs while both were below the limit

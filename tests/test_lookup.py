"""Prompt lookup decoding (ortforge.lookup): drafts come from the text's own earlier occurrences,
and generating with them gives greedy decoding's tokens in fewer model runs, on both cache layouts."""

from __future__ import annotations

import numpy as np
import pytest

from ortforge import Decoder, TextGenerator, create_session, greedy_tokens
from ortforge.lookup import PromptLookup, accepted_prefix

PROMPT = "the GNU General Public License is a free license; the GNU General Public License is"


def test_draft_continues_the_latest_earlier_occurrence_longest_match_first():
    lookup = PromptLookup([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert lookup.draft(2) == [4, 9]  # the 3-gram (1, 2, 3), though (2, 3) occurred later
    lookup = PromptLookup([7, 2, 3, 5, 6, 8, 2, 3])
    assert lookup.draft(3) == [5, 6, 8]  # only the 2-gram (2, 3) occurred before
    assert lookup.draft(0) == []


def test_draft_never_proposes_the_texts_own_end():
    lookup = PromptLookup([4, 5, 6])
    assert lookup.draft(3) == []
    lookup.extend([7, 4, 5, 6])
    assert lookup.draft(3) == [7, 4, 5]


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix(np.array([3, 4, 9, 1]), [3, 4, 5]) == 2
    assert accepted_prefix(np.array([0, 4]), [3]) == 0
    assert accepted_prefix(np.array([3, 4, 5, 6]), [3, 4, 5]) == 3


class CountingDecoder:
    """A decoder that counts its model runs."""

    def __init__(self, inner: Decoder):
        self.inner, self.runs = inner, 0

    def empty_cache(self):
        return self.inner.empty_cache()

    def forward(self, token_ids, cache, last_only=False):
        self.runs += 1
        return self.inner.forward(token_ids, cache, last_only)

    def rewind(self, cache, length):
        return self.inner.rewind(cache, length)

    def runs_like_any(self, total: int) -> bool:
        return self.inner.runs_like_any(total)


@pytest.fixture(scope="module", params=["genai", "optimum"])
def fp32_dir(request, built, built_optimum):
    """Shared (in-place) and chained KV caches."""
    return (built if request.param == "genai" else built_optimum)["fp32"]


@pytest.mark.parametrize("draft_tokens", [1, 3, 5])
def test_lookup_gives_greedy_tokens_in_fewer_runs(fp32_dir, draft_tokens):
    generator = TextGenerator(fp32_dir)
    prompt = generator.encode(PROMPT)
    session = create_session(fp32_dir)
    expected = list(greedy_tokens(Decoder(session), prompt, 40))
    counting = CountingDecoder(Decoder(session))
    got = list(greedy_tokens(counting, prompt, 40, prompt_lookup=draft_tokens))
    assert got == expected
    assert counting.runs < len(expected)  # some drafts were accepted


def test_lookup_stops_at_stop_tokens_and_the_token_budget(fp32_dir):
    session = create_session(fp32_dir)
    prompt = TextGenerator(fp32_dir).encode(PROMPT)
    expected = list(greedy_tokens(Decoder(session), prompt, 30))
    for budget in (1, 2, 7, 30):
        assert list(greedy_tokens(Decoder(session), prompt, budget, prompt_lookup=4)) == expected[:budget]
    stop = expected[12]
    until_stop = expected[: expected.index(stop) + 1]
    assert list(greedy_tokens(Decoder(session), prompt, 30, [stop], prompt_lookup=4)) == until_stop


def test_text_generator_streams_the_same_text_with_lookup(fp32_dir):
    plain, lookup = TextGenerator(fp32_dir), TextGenerator(fp32_dir, prompt_lookup=3)
    assert "".join(lookup.stream(PROMPT, 24)) == "".join(plain.stream(PROMPT, 24)) == plain.generate(PROMPT, 24)
    with pytest.raises(ValueError, match="prompt_lookup -1"):
        TextGenerator(fp32_dir, prompt_lookup=-1)

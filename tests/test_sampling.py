"""Sampling (temperature, top-k, top-p, repetition penalty, seed), stop strings and the chat
template: exact on synthetic distributions, reproducible on a tiny model, refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ortforge import cli
from ortforge.chat import render_chat, until_stop
from ortforge.generate import TextGenerator
from ortforge.greedy import greedy_tokens
from ortforge.sampling import Sampler, Sampling, finite, penalized, truncated

PROMPT = "The GNU General Public License is"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def generator(built):
    return TextGenerator(built["fp32"])


def test_truncation_keeps_the_top_k_then_the_top_p_mass():
    p = np.array([0.1, 0.4, 0.2, 0.3])
    assert truncated(p, top_k=2, top_p=1.0) == pytest.approx([0, 4 / 7, 0, 3 / 7])
    assert truncated(p, top_k=0, top_p=0.7) == pytest.approx([0, 4 / 7, 0, 3 / 7])  # 0.4 + 0.3 reach 0.7
    assert truncated(p, top_k=0, top_p=0.71) == pytest.approx([0, 4 / 9, 2 / 9, 3 / 9])
    assert truncated(p, top_k=0, top_p=0.01) == pytest.approx([0, 1, 0, 0])  # the most likely always stays


def test_repetition_penalty_makes_seen_tokens_less_likely_whatever_their_sign():
    logits = np.array([2.0, -2.0, 1.0])
    assert penalized(logits, [0, 1, 1], 2.0) == pytest.approx([1.0, -4.0, 1.0])
    assert penalized(logits, [0], 1.0) is logits


def test_samples_follow_the_distribution_and_a_seed_repeats_them():
    logits = np.log(np.array([0.5, 0.3, 0.2]))

    def draws(seed: int) -> np.ndarray:
        sampler = Sampler(Sampling(temperature=1.0, seed=seed))
        return np.array([sampler.pick(logits, []) for _ in range(20000)])

    many = draws(7)
    assert np.bincount(many, minlength=3) / many.size == pytest.approx([0.5, 0.3, 0.2], abs=0.015)
    assert (draws(7) == many).all() and (draws(8) != many).any()
    cold = Sampler(Sampling(temperature=0.05, seed=1))
    assert {cold.pick(logits, []) for _ in range(200)} == {0}  # a low temperature concentrates on the top


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": -1}, "temperature -1 must be >= 0"),
        ({"temperature": float("nan")}, "temperature nan must be >= 0"),
        ({"temperature": 1, "top_p": 0}, "top_p 0 must be in (0, 1]"),
        ({"temperature": 1, "top_k": -3}, "top_k -3 must be >= 0"),
        ({"repetition_penalty": 0}, "repetition_penalty 0 must be > 0"),
        ({"top_p": 0.9}, "top_k and top_p apply when sampling; give a temperature above 0"),
    ],
)
def test_bad_sampling_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Sampling(**settings)


def test_greedy_is_the_default_and_top_k_1_is_greedy(generator):
    ids = generator.encode_prompt(PROMPT)
    greedy = list(greedy_tokens(generator.decoder, ids, 12, generator.stop_ids))
    assert generator.generate_ids(ids, 12) == greedy
    assert generator.generate_ids(ids, 12, Sampling(temperature=1.0, top_k=1, seed=3)) == greedy


def test_a_seed_gives_the_same_tokens_and_seeds_differ(generator):
    ids = generator.encode_prompt(PROMPT)
    runs = {seed: generator.generate_ids(ids, 16, Sampling(temperature=1.5, seed=seed)) for seed in (1, 2, 3)}
    assert generator.generate_ids(ids, 16, Sampling(temperature=1.5, seed=1)) == runs[1]
    assert len({tuple(tokens) for tokens in runs.values()}) > 1


def test_repetition_penalty_changes_greedy_text_away_from_repeats(generator):
    ids = generator.encode_prompt(PROMPT)
    penalized_ids = generator.generate_ids(ids, 24, Sampling(repetition_penalty=5.0))
    plain = generator.generate_ids(ids, 24)
    assert penalized_ids != plain
    repeats = lambda tokens: len(tokens) - len(set(tokens))  # noqa: E731
    assert repeats(penalized_ids) <= repeats(plain)


def test_prompt_lookup_refuses_to_draft_sampled_tokens(built):
    with pytest.raises(ValueError, match="prompt lookup drafts greedy tokens"):
        TextGenerator(built["fp32"], prompt_lookup=3).generate(PROMPT, 4, Sampling(temperature=0.8))


@pytest.mark.parametrize(
    "pieces, stops, shown",
    [
        (["Hello wor", "ld. Bye"], ("world",), "Hello "),
        (["ab", "c<", "|e", "nd|>", "more"], ("<|end|>",), "abc"),
        (["ab<", "x"], ("<|end|>",), "ab<x"),  # a held-back start that turns out not to be a stop
        (["no stop here"], ("zz",), "no stop here"),
        (["stop first"], ("stop",), ""),
    ],
)
def test_stop_strings_end_the_text_before_them_and_are_never_shown(pieces, stops, shown):
    assert "".join(until_stop(iter(pieces), stops)) == shown


def test_text_that_may_start_a_stop_is_held_back_only_until_the_next_piece_decides():
    assert list(until_stop(iter(["ab", "c<", "|e", "nd|>"]), ("<|end|>",))) == ["ab", "c"]
    assert list(until_stop(iter(["ab<", "x", "y"]), ("<|end|>",))) == ["ab", "<x", "y"]


def test_generation_stops_at_a_stop_string(generator):
    text = generator.generate(PROMPT, 24)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = generator.generate(PROMPT, 24, stop=[stop])
    assert cut == text[: text.index(stop)]
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        generator.generate(PROMPT, 4, stop=[""])


def test_chat_renders_the_models_template_and_encodes_without_extra_special_tokens(built, tmp_path):
    folder = tmp_path / "chat"
    shutil.copytree(built["fp32"], folder)
    (folder / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = render_chat(folder, messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chat = TextGenerator(folder)
    assert chat.encode_chat(messages) == chat.encode(text, add_special_tokens=False)
    reply = "".join(chat.chat(messages, 8))
    assert reply == chat.tokenizer.decode(chat.generate_ids(chat.encode_chat(messages), 8), skip_special_tokens=True)


def test_generate_goes_through_the_chat_template_when_the_model_has_one(built, params, tmp_path, capsys):
    """An instruct model answers a bare question with end-of-text at once: generate applies the
    template by default and says so; --raw continues the text; a model without one continues it."""
    from ortforge.manifest import read_manifest, write_manifest
    from tests.test_text_encoding import validated_project

    def generate(root: Path, *options: str) -> list[str]:
        args = ["--root", str(root), "generate", "tiny", PROMPT, "--variant", "int4", "--max-new-tokens", "10"]
        return [*args, *options]

    (tmp_path / "base").mkdir()
    (tmp_path / "instruct").mkdir()
    root = validated_project(built, params, tmp_path / "base")
    assert cli.main(generate(root)) == 0  # no template: plain continuation, nothing said about chat
    plain, err = capsys.readouterr()
    folder = root / "artifacts" / "tiny" / "variants" / "int4"
    assert plain == "".join(TextGenerator(folder).stream(PROMPT, 10)) + "\n" and "chat" not in err

    instruct = tmp_path / "instruct-int4"  # the same weights, with a template quantize would have copied
    shutil.copytree(built["int4"], instruct)
    (instruct / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    write_manifest(instruct, {k: v for k, v in read_manifest(instruct).items() if k != "files"})
    root = validated_project({**built, "int4": instruct}, params, tmp_path / "instruct")
    args = generate(root)
    generator = TextGenerator(root / "artifacts" / "tiny" / "variants" / "int4")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    assert cli.main([*args, "--system", "Be brief."]) == 0
    out, err = capsys.readouterr()
    assert out == "".join(generator.chat(messages, 10)) + "\n"
    assert "chat template (--raw: plain text)" in err and err.count("\n") == 1
    assert cli.main([*args, "--raw"]) == 0 and capsys.readouterr().out == plain
    for bad, message in [
        (["--raw", "--chat"], "--chat and --raw contradict each other; drop one"),
        (["--raw", "--system", "Be brief."], "--system applies to chat; drop --raw"),
    ]:
        assert cli.main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_chat_refuses_a_folder_without_template_and_bad_messages(built, tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(built["fp32"], folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no chat template"):
        render_chat(folder, [{"role": "user", "content": "Hi"}])
    (folder / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    with pytest.raises(ValueError, match="message 0 must be"):
        render_chat(folder, [{"role": "wizard", "content": "Hi"}])
    with pytest.raises(ValueError, match="no messages"):
        render_chat(folder, [])


def test_generate_command_samples_reproducibly_and_refuses_bad_options(built, params, tmp_path, capsys):
    from tests.test_text_encoding import validated_project

    root = validated_project(built, params, tmp_path)
    args = ["--root", str(root), "generate", "tiny", PROMPT, "--variant", "int4", "--max-new-tokens", "12"]
    sampled = [*args, "--temperature", "1.2", "--top-p", "0.9", "--seed", "5"]
    assert cli.main(sampled) == 0
    first = capsys.readouterr().out
    assert cli.main(sampled) == 0 and capsys.readouterr().out == first
    folder = root / "artifacts" / "tiny" / "variants" / "int4"
    assert first == "".join(TextGenerator(folder).stream(PROMPT, 12, Sampling(1.2, 0, 0.9, 1.0, 5))) + "\n"
    for bad, message in [
        (["--top-p", "0.5"], "top_k and top_p apply when sampling"),
        (["--system", "Be brief."], "--system applies to chat; this model has no chat template"),
        (["--chat"], "has no chat template; drop --chat to continue the text"),
    ]:
        assert cli.main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("temperature", [1e-308, 1e-5, 0.7, 2.0])
@pytest.mark.parametrize("penalty", [1e-320, 1e-3, 1.0, 100.0])
def test_no_temperature_or_penalty_makes_sampling_fail(temperature, penalty):
    """Values OpenAI accepts (and extreme penalties) never overflow into NaN probabilities; at a
    vanishing temperature sampling is the argmax."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 30, 1000).astype(np.float32)
    logits[[3, 7]] = [np.nan, -np.inf]
    sampler = Sampler(Sampling(temperature=temperature, repetition_penalty=penalty, seed=1))
    seen = [10, 11, 12]
    for _ in range(5):
        token = sampler.pick(logits, seen)
        assert 0 <= token < 1000 and token not in (3, 7)
    if temperature == 1e-308:
        expected = int(np.argmax(np.nan_to_num(penalized(logits.astype(np.float64), seen, penalty), nan=-np.inf)))
        assert sampler.pick(logits, seen) == expected


def test_logits_with_nothing_finite_are_a_clear_error():
    with pytest.raises(ValueError, match="no finite logit"):
        Sampler(Sampling(temperature=1.0)).pick(np.full(10, np.nan, np.float32), [])


@pytest.mark.parametrize(
    "special",
    [{}, {5: np.nan}, {0: np.nan, 9: np.inf}, {4: np.inf, 6: np.inf}, {2: -np.inf}, dict.fromkeys(range(10), -np.inf)],
)
def test_greedy_picks_as_the_float64_path_does_whatever_the_logits_hold(special):
    """Plain greedy takes argmax on the logits as they come and falls back to the float64 path
    only for what it must settle (a NaN, nothing above -inf): the same token either way."""
    logits = np.random.default_rng(len(special)).normal(0, 5, 10).astype(np.float32)
    for index, value in special.items():
        logits[index] = value
    greedy = Sampler(Sampling())
    if not np.isfinite(logits).any() and not np.isposinf(logits).any():
        with pytest.raises(ValueError, match="no finite logit"):
            greedy.pick(logits, [])
        return
    assert greedy.pick(logits, [1, 2]) == int(np.argmax(finite(logits)))

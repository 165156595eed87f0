"""What a request to the server may hold (ortforge.api): OpenAI's fields honoured or refused by name,
its ranges, `null` as the default, text parts and the developer role, and the limits on size,
nesting and Unicode, each refusal quoting little of what the client sent."""

from __future__ import annotations

import json

import pytest

from ortforge.api import MAX_DEPTH, QUOTED, ChatRequest, CompletionRequest, RequestError, parse_body, quoted

BASE = {"model": "m", "prompt": "hi"}


def completion(**fields) -> CompletionRequest:
    return parse_body(json.dumps(BASE | fields).encode(), CompletionRequest)


def refusal(body: dict | bytes, model=CompletionRequest) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as caught:
        parse_body(raw, model).sampling_values()
    return caught.value


def test_null_is_the_default_for_every_optional_field():
    body = completion(temperature=None, top_p=None, max_tokens=None, seed=None, stop=None, n=None, stream=None)
    assert (body.temperature, body.top_p, body.n, body.stream) == (1.0, 1.0, 1, False)


def test_any_temperature_openai_accepts_passes():
    assert completion(temperature=1e-308).sampling_values()[0] == 1e-308  # sampling.py stays finite


def test_greedy_with_top_p_is_accepted_and_top_p_zero_keeps_the_most_likely_token():
    assert completion(temperature=0, top_p=0.5, top_k=3).sampling_values()[:3] == (0.0, 0, 1.0)
    temperature, _, top_p, _, _ = completion(temperature=0.7, top_p=0).sampling_values()
    assert temperature == 0.7 and 0 < top_p < 1e-9


@pytest.mark.parametrize(
    "fields, names",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"repetition_penalty": 1e-320}, "repetition_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 2}, "n"),
        ({"max_tokens": "5"}, "max_tokens"),  # strict: OpenAI refuses a string for a number
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"model": None}, "model"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(fields, names):
    assert names in str(refusal(BASE | fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": True},  # completions take a count
        {"top_logprobs": 2},  # a chat field
        {"echo": True},
        {"frequency_penalty": 0.5},
        {"presence_penalty": -1},
        {"logit_bias": {"50256": -100}},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"tool_choice": "required"},
        {"best_of": 2},
        {"suffix": "end"},
        {"reasoning_effort": "high"},
        {"made_up": 1},
    ],
)
def test_a_field_the_server_would_ignore_is_a_400_naming_it(fields):
    error = refusal(BASE | fields)
    (name,) = fields
    assert error.param == name and str(error).startswith(name) and error.status == 400


def test_fields_whose_value_asks_nothing_pass():
    inert = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "echo": False}
    inert |= {"tools": [], "response_format": {"type": "text"}, "user": "u-1", "metadata": {"k": "v"}, "best_of": 1}
    assert completion(**inert).model == "m"


def test_chat_content_parts_and_the_developer_role():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]
    body = parse_body(json.dumps({"model": "m", "messages": messages}).encode(), ChatRequest)
    assert body.plain_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, there"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "message, says",
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "only text parts"),
        ({"role": "user", "content": 5}, "a string or a list of text parts"),
        ({"role": "user", "content": "x", "name": "bob"}, "messages[0].name"),
        ({"role": 7, "content": "x"}, "messages[0].role"),
    ],
)
def test_chat_messages_the_server_cannot_honour_are_refused(message, says):
    body = parse_body(json.dumps({"model": "m", "messages": [message]}).encode(), ChatRequest)
    with pytest.raises(RequestError, match=r".*") as caught:
        body.plain_messages()
    assert says in str(caught.value)


def test_no_messages_is_refused():
    assert "messages" in str(refusal({"model": "m", "messages": []}, ChatRequest))


def test_deep_nesting_and_lone_surrogates_are_refused_before_validation():
    assert "deeper than" in str(refusal(b"[" * 100_000 + b"]" * 100_000))  # Python's parser recursion
    nested = BASE | {"metadata": json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)}
    assert "deeper than" in str(refusal(nested))
    for body in (b'{"model": "m", "prompt": "\\ud800"}', b'{"model": "\\udfff", "prompt": "x"}'):
        assert "unpaired surrogate" in str(refusal(body))
    assert "valid JSON" in str(refusal(b"{not json"))
    assert "JSON object" in str(refusal(b"[1, 2]"))


def test_errors_quote_little_of_what_was_sent():
    huge = "x" * 5_000_000
    assert len(quoted(huge)) < QUOTED + 40
    assert len(str(refusal(BASE | {"logit_bias": {"1": huge}}))) < 300

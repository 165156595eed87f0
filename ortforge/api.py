"""What a request to `ortforge serve` may say, checked before any work: OpenAI's request bodies,
every field honoured or refused with a 400 that names it, never silently ignored.

- Limits: the body's size, its JSON nesting, the number of messages and stop strings. Every
  error quotes at most QUOTED characters of what the client sent.
- OpenAI's ranges: temperature in [0, 2], top_p in [0, 1], seed >= 0. `null` means "the default"
  for every optional field, as OpenAI reads it.
- Chat content may be a string or a list of text parts; the `developer` role is the system role
  (OpenAI's newer name for it).
- A field this server does not implement passes only with the value that asks nothing of it
  (`frequency_penalty: 0`, `tools: []`...); any other value is a 400 naming it. Implemented:
  `logprobs` (ortforge.logprobs) and chat's `response_format` (ortforge.structured).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ortforge.logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETIONS

QUOTED = 100  # characters of client input an error message may repeat
MAX_DEPTH = 32  # JSON nesting: OpenAI's bodies need 5 (a tool schema more; we take none)
MAX_MESSAGES = 1024
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_REPETITION_PENALTY = 100.0  # and at least 1 / MAX_REPETITION_PENALTY: an extension, not OpenAI's

# Fields that change nothing in the reply: accepted as they are.
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
# OpenAI fields this server does not implement, with the values that ask nothing of them.
INERT_VALUES: dict[str, tuple] = {
    "echo": (False,),
    "best_of": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "suffix": ("",),
    "modalities": (["text"],),
}


class RequestError(ValueError):
    """A request this server refuses: status, message, and the field it is about."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def quoted(value: Any) -> str:
    """A client value as an error message may show it: at most QUOTED characters."""
    # Strings in repr's quotes and escapes (a lone surrogate stays printable); other values as JSON.
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    show = repr if isinstance(value, str) else str
    return show(text) if len(text) <= QUOTED else f"{show(text[:QUOTED])}... ({len(text)} characters)"


Temperature = Annotated[float, Field(ge=0, le=2)]
Probability = Annotated[float, Field(ge=0, le=1)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
Penalty = Annotated[float, Field(ge=1 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]


class Settings(BaseModel):
    """The fields both endpoints take: OpenAI's, and top_k and repetition_penalty as extensions."""

    model_config = ConfigDict(extra="allow", strict=True)  # extras are checked one by one below
    model: str
    max_tokens: int | None = None
    temperature: Temperature = 1.0
    top_p: Probability = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Penalty = 1.0
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data: Any) -> Any:
        """OpenAI reads `null` in an optional field as the field left out."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def refuse_unimplemented(self) -> Settings:
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT:
                continue
            if name not in INERT_VALUES:
                raise RequestError(f"{name}: not a field this endpoint takes; remove it", param=name)
            if not any(same_value(value, inert) for inert in INERT_VALUES[name]):
                raise RequestError(
                    f"{name}={quoted(value)}: not supported by this server (it would be ignored); remove it",
                    param=name,
                    code="unsupported_parameter",
                )
        return self

    def logprob_count(self) -> int | None:
        """None: no logprobs in the reply; n: each token's log-probability and the n most likely."""
        return None

    def sampling_values(self) -> tuple[float, int, float, float, int | None]:
        """(temperature, top_k, top_p, repetition_penalty, seed) for ortforge.sampling.Sampling.
        At temperature 0 the most likely token is picked, and it lies inside every top-k and top-p
        set, so those two change nothing there and are dropped (OpenAI accepts the pair)."""
        if self.temperature == 0:
            return 0.0, 0, 1.0, self.repetition_penalty, self.seed
        top_p = self.top_p or 1e-12  # 0 keeps only the most likely token, as any tiny mass does
        return self.temperature, self.top_k, top_p, self.repetition_penalty, self.seed


def same_value(value: Any, inert: Any) -> bool:
    """Equal and of the same JSON kind: 0 and 0.0 are one number, but false is not 0."""
    numbers = (int, float)
    if isinstance(value, bool) or isinstance(inert, bool):
        return type(value) is type(inert) and value == inert
    if isinstance(value, numbers) and isinstance(inert, numbers):
        return value == inert
    return type(value) is type(inert) and value == inert


class CompletionRequest(Settings):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_COMPLETIONS)] | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatRequest(Settings):
    messages: Annotated[list[dict], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None
    response_format: dict | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_CHAT)] | None = None

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def json_schema(self) -> dict | None:
        """The JSON schema replies must meet (ortforge.structured), None for plain text: OpenAI's
        `json_object` is any JSON object, `json_schema` its `json_schema.schema`."""
        found = self.response_format or {"type": "text"}
        kind = found.get("type")
        if kind == "text" and set(found) == {"type"}:
            return None
        if kind == "json_object" and set(found) == {"type"}:
            return {"type": "object"}
        if kind == "json_schema" and set(found) == {"type", "json_schema"}:
            spec = found["json_schema"]
            if isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
                if isinstance(spec.get("name"), str) and set(spec) <= {"name", "schema", "strict", "description"}:
                    return spec.get("schema") or {}
        raise RequestError(
            f"response_format={quoted(found)}: give {{'type': 'text'}}, {{'type': 'json_object'}} or "
            "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
            param="response_format",
        )

    def plain_messages(self) -> list[dict]:
        """[{role, content}] with content as one string and `developer` as `system`."""
        return [plain_message(index, message) for index, message in enumerate(self.messages)]


def plain_message(index: int, message: dict) -> dict:
    where = f"messages[{index}]"
    unknown = set(message) - {"role", "content"}
    if unknown:
        name = sorted(unknown)[0]
        raise RequestError(f"{where}.{name}: not supported by this server; remove it", param=f"{where}.{name}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise RequestError(f"{where}.role: give one of system, developer, user, assistant", param=f"{where}.role")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(text_part(f"{where}.content[{i}]", part) for i, part in enumerate(content))
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content: give a string or a list of text parts", param=f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def text_part(where: str, part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        if set(part) <= {"type", "text"}:
            return part["text"]
    raise RequestError(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported", param=where)


def parse_body(raw: bytes, model: type[Settings]) -> Settings:
    """The request body as model, or a RequestError naming what is wrong with it."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise RequestError(f"the body nests JSON deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON ({quoted(str(error))}); send a JSON object") from None
    check_plain_json(data)
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, RequestError):  # raised by a validator above: its own words
            raise cause from None
        raise RequestError(f"{where}: {first['msg']}", param=where) from None


def check_plain_json(data: Any) -> None:
    """Nesting within MAX_DEPTH, and text that is valid Unicode: JSON's \\ud800 escapes decode to
    lone surrogates, which no tokenizer can encode."""
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"the body nests JSON deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                pending.append((item, depth + 1))
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"a string holds an unpaired surrogate at character {error.start} ({quoted(text)}); send valid Unicode"
        ) from None

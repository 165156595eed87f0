"""The model's own chat template, applied as transformers applies it (a sandboxed Jinja
environment with trim_blocks and lstrip_blocks), and stop strings cut out of a text stream."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from ortforge.names import TOKENIZER_FILES

_, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE, CHAT_TEMPLATE_FILE = TOKENIZER_FILES
ROLES = ("system", "user", "assistant")


def chat_template(folder: Path) -> str:
    """The template an artifact carries: chat_template.jinja, else tokenizer_config.json's."""
    folder = Path(folder)
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = _json(folder / TOKENIZER_CONFIG_FILE).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        raise ValueError(
            f"{folder} has no chat template ({CHAT_TEMPLATE_FILE} or {TOKENIZER_CONFIG_FILE}'s chat_template); "
            "give a plain prompt instead of chat messages"
        )
    return template


def render_chat(folder: Path, messages: list[dict]) -> str:
    """The prompt text for messages [{role, content}], ending where the assistant's reply starts."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _check_messages(messages)
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise
    try:
        template = environment.from_string(chat_template(folder))
        return template.render(messages=messages, add_generation_prompt=True, **special_tokens(folder))
    except TemplateError as error:
        raise ValueError(f"{folder}'s chat template failed on these messages: {error}") from None


def chat_pieces(folder: Path, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_user_content) pieces, in order: the template's own text
    (its control tokens) apart from what the messages said, so a tokenizer can read the messages'
    text as text. ValueError when the template changes the content it inserts (trims it, say): the
    pieces could then not be told apart."""
    import re
    import uuid

    mark = f"\ue000{uuid.uuid4().hex}"  # a private-use character and a nonce: in no message
    marked = [{**message, "content": f"{mark}{index}{mark}"} for index, message in enumerate(messages)]
    pieces: list[tuple[str, bool]] = []
    for index, text in enumerate(re.split(f"{mark}(\\d+){mark}", render_chat(folder, marked))):
        if index % 2 == 0:
            pieces.append((text, False))
        else:
            pieces.append((messages[int(text)]["content"], True))
    if "".join(text for text, _ in pieces) != render_chat(folder, messages):
        raise ValueError("this model's chat template changes the message text it inserts; send plain text")
    return pieces


def special_tokens(folder: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them (text, not ids)."""
    found = {**_json(Path(folder) / TOKENIZER_CONFIG_FILE), **_json(Path(folder) / SPECIAL_TOKENS_FILE)}
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = found.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def stop_strings(stop: Sequence[str] | str) -> tuple[str, ...]:
    """Stop strings as given by a caller: one string or several, each non-empty."""
    if isinstance(stop, str):  # one string, not its characters
        stop = (stop,)
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop strings must be non-empty text, not {list(stop)!r}")
    return tuple(stop)


class StopStrings:
    """Cuts a stream of text pieces at the first stop string. Text that may be the start of a stop
    string is held back until a later piece decides, so nothing of a stop is ever shown."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.pending = stops, ""

    def push(self, piece: str) -> tuple[str, bool]:
        """The text that can be shown now, and whether a stop string has been reached."""
        self.pending += piece
        found = [i for i in (self.pending.find(stop) for stop in self.stops) if i >= 0]
        if found:
            shown, self.pending = self.pending[: min(found)], ""
            return shown, True
        held = max((_overlap(self.pending, stop) for stop in self.stops), default=0)
        shown = self.pending[: len(self.pending) - held]
        self.pending = self.pending[len(shown) :]
        return shown, False

    def flush(self) -> str:
        """What was held back, once the stream has ended without a stop."""
        shown, self.pending = self.pending, ""
        return shown


def until_stop(pieces: Iterable[str], stops: tuple[str, ...]) -> Iterator[str]:
    """The pieces up to (not including) the first stop string."""
    cut = StopStrings(stops)
    for piece in pieces:
        shown, stopped = cut.push(piece)
        if shown:
            yield shown
        if stopped:
            return
    if rest := cut.flush():
        yield rest


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of text that begins stop."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0


def _check_messages(messages: list[dict]) -> None:
    if not messages:
        raise ValueError("no messages; give at least one {role, content}")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(f"message {i} must be {{role: one of {', '.join(ROLES)}, content: text}}, not {message!r}")


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

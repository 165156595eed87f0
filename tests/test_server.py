"""`ortforge serve` on loopback, driven by the official openai client and by concurrent raw HTTP
clients: OpenAI's shapes (whole and streamed), batch-1 tokens under concurrency, OpenAI-style 4xx
errors, a full queue answering 429, and a client that disconnects freeing its slot."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ortforge import cli
from ortforge.batch import BatchDecoder
from ortforge.generate import TextGenerator
from ortforge.manifest import read_manifest, write_manifest
from ortforge.sampling import Sampling
from tests.test_sampling import CHATML, PROMPT

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

MODEL = "tiny/fp32"


@pytest.fixture(scope="module")
def chat_folder(built, tmp_path_factory):
    """The tiny fp32 variant with a ChatML template, its manifest rewritten to include it."""
    folder = tmp_path_factory.mktemp("served") / "fp32"
    shutil.copytree(built["fp32"], folder)
    (folder / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    record = {k: v for k, v in read_manifest(folder).items() if k != "files"}
    write_manifest(folder, record)
    return folder


@contextlib.contextmanager
def serving(folder, slots=2, queue_size=8):
    import uvicorn

    from ortforge.server import Service, create_app

    service = Service(TextGenerator(folder), MODEL, slots, queue_size).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", service
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        service.scheduler.stop()


@pytest.fixture(scope="module")
def server(chat_folder):
    with serving(chat_folder, slots=2, queue_size=16) as served:
        yield served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def slow_steps(monkeypatch):
    """A model that takes 20 ms a step, so a request is still running when the test acts."""
    step = BatchDecoder.step

    def slow(self, tokens):
        time.sleep(0.02)
        return step(self, tokens)

    monkeypatch.setattr(BatchDecoder, "step", slow)


def test_health_and_models(server):
    url, _ = server
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["slots"] == 2
    assert "continuous batching" in health["batching"]
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL]


def test_completion_equals_the_runtime_and_counts_usage(client, chat_folder):
    generator = TextGenerator(chat_folder)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == generator.generate(PROMPT, 12)
    assert reply.choices[0].finish_reason in ("length", "stop")
    prompt_tokens = len(generator.encode(PROMPT))
    assert reply.usage.prompt_tokens == prompt_tokens and 1 <= reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == prompt_tokens + reply.usage.completion_tokens
    seeded = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.2, seed=4)
    assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text
    expected = "".join(generator.stream(PROMPT, 12, Sampling(temperature=1.2, seed=4)))
    assert client.completions.create(**seeded).choices[0].text == expected


def test_chat_whole_and_streamed_through_the_template(client, chat_folder):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is free software?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    expected = "".join(TextGenerator(chat_folder).chat(messages, 10))
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streamed_completion_stops_before_a_stop_string(client, chat_folder):
    text = TextGenerator(chat_folder).generate(PROMPT, 16)
    stop = text[6:9]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True, stop=stop)
    pieces = list(stream)
    assert "".join(p.choices[0].text for p in pieces) == text[: text.index(stop)]
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_get_their_batch_1_text(server, chat_folder):
    url, service = server
    generator = TextGenerator(chat_folder)
    asks = [(f"{PROMPT} number {i}", 4 + 3 * i) for i in range(6)]

    def ask(prompt_and_tokens):
        prompt, tokens = prompt_and_tokens
        body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(ask, asks))
    assert texts == [generator.generate(prompt, tokens) for prompt, tokens in asks]
    assert service.scheduler.widest_step == 2  # requests shared runs, never more than the slots


@pytest.mark.parametrize(
    "body, status, says",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "other", "prompt": "x"}, 404, "model 'other' is not served here"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens 0 must be at least 1"),
        ({"model": MODEL, "prompt": "x " * 5000, "max_tokens": 8}, 400, "does not fit the model's context"),
        ({"model": MODEL, "prompt": ""}, 400, "the prompt is empty"),
        ({"model": MODEL}, 400, "prompt: Field required"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature -1.0 must be >= 0"),
    ],
)
def test_bad_requests_get_openai_style_errors(server, body, status, says):
    url, _ = server
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    answer = httpx.post(f"{url}/v1/completions", **sent, timeout=30)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_chat_refuses_max_completion_tokens_0(server):
    url, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400 and "max_tokens 0 must be at least 1" in answer.json()["error"]["message"]


def test_the_openai_client_sees_the_errors_it_knows(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="x " * 5000, max_tokens=8)
    assert httpx.get(f"{client.base_url}nowhere").json()["error"]["message"] == "Not Found"


def test_a_full_queue_answers_429_and_a_gone_client_frees_its_slot(chat_folder, slow_steps):
    generator = TextGenerator(chat_folder)
    candidates = [f"{PROMPT} {word}" for word in ("free", "software", "rights", "copies", "source", "terms")]
    # a prompt the tiny model continues for all 100 tokens (no end-of-sequence token on the way)
    prompt = next(p for p in candidates if len(generator.generate_ids(generator.encode(p), 100)) == 100)
    with serving(chat_folder, slots=1, queue_size=0) as (url, service):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as held:
            events = held.iter_lines()  # kept: a dropped iterator closes the response
            next(events)  # the request holds the only slot
            busy = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=30)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full"
            assert httpx.get(f"{url}/health").json()["active"] == 1
        # The client went away after its first event: its slot frees long before 100 slow steps.
        deadline = time.time() + 1.5
        while httpx.get(f"{url}/health").json()["active"] and time.time() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json()["active"] == 0
        again = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert again.status_code == 200, again.text


def test_serve_refuses_an_unvalidated_artifact_and_binds_loopback(chat_folder, capsys):
    assert cli.main(["serve", str(chat_folder)]) == 2
    assert "has no validation stamp" in capsys.readouterr().err
    args = cli.parser().parse_args(["serve", str(chat_folder)])
    assert args.host == "127.0.0.1"


def test_streamed_events_are_server_sent_events(server):
    url, _ = server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"

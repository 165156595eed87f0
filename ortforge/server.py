"""`ortforge serve`: an OpenAI-compatible HTTP API over continuous batching (ortforge.scheduler).

GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed as
server-sent events with `"stream": true`. Only a validated artifact is served (the CLI checks its
stamp). Errors have OpenAI's JSON shape and a 4xx status: a malformed body or a field this server
does not implement 400 (ortforge.api says what a request may hold), a wrong or missing API key
401, an unknown model 404, a body over the limit 413, a body that is not JSON 415, a prompt past
the context 400, a full queue 429 with Retry-After. A client that disconnects cancels its request,
which frees its slot at the next step.

The door: with an API key (`--api-key` or ORTFORGE_API_KEY) every route but /health needs
`Authorization: Bearer <key>`; bound to loopback, the Host header must name loopback too (a web
page cannot reach the server through DNS rebinding), and a POST must say `application/json` (a
page's cross-site "simple" request cannot). /health answers 503 when the scheduler has stopped
or has made no progress for `stall_seconds` while work waits. On SIGTERM the server stops
admitting requests, gives running ones `shutdown_timeout` seconds, then ends them with an error;
a second signal exits at once.

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client); the rest of the runtime does not import
this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from tokenizers import Tokenizer

from ortforge.api import ChatRequest, CompletionRequest, RequestError, Settings, parse_body, quoted
from ortforge.chat import StopStrings, stop_strings
from ortforge.generate import IncrementalDetokenizer, TextGenerator
from ortforge.logprobs import LogprobSampler, chat_logprobs, completion_logprobs
from ortforge.metrics import Observed, ServerMetrics
from ortforge.sampling import Sampling
from ortforge.scheduler import LENGTH, Job, QueueFull, Scheduler, TooLarge
from ortforge.structured import ConstrainedSampler, Grammars

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions
MESSAGE_CHARACTERS = 400  # an error message longer than this quoted client input: cut it
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
POLL_SECONDS = 0.25  # how often a waiting request checks the shutdown deadline
ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    @classmethod
    def refused(cls, error: RequestError) -> ApiError:
        return cls(error.status, str(error), code=error.code, param=error.param)

    def response(self) -> JSONResponse:
        message = str(self)
        if len(message) > MESSAGE_CHARACTERS:  # never echo a client's megabytes back
            message = message[:MESSAGE_CHARACTERS] + f"... ({len(message)} characters)"
        body = {"error": {"message": message, "type": self.kind, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass
class Reply:
    """One request's tokens, handed from the scheduler's thread to the event loop."""

    prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted: float = field(default_factory=time.perf_counter)
    completion_tokens: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True)
class Limits:
    """What one request may take, and when the server counts itself stuck."""

    max_body_bytes: int | None = None  # None: room for the model's whole context (body_limit)
    stall_seconds: float = 120.0  # no token for this long while work waits: /health says 503
    shutdown_timeout: float = 30.0


def body_limit(context_tokens: int | None) -> int:
    """A body that can hold the model's whole context: a token is a few characters, a character
    at most 6 bytes of JSON (\\uXXXX), so 24 bytes a token, and never under 1 MB."""
    return max(1_000_000, 24 * (context_tokens or 0))


class Service:
    def __init__(
        self,
        generator: TextGenerator,
        model_id: str,
        slots: int,
        queue_size: int,
        prefix_mb: float = 0,
        limits: Limits | None = None,
        kv_cache_mb: float | None = None,
    ):
        """kv_cache_mb: the KV cache's budget (None: the scheduler's default for this model)."""
        self.generator, self.model_id = generator, model_id
        self.grammars = Grammars(generator.model_dir / "tokenizer.json", generator.stop_ids)
        self.scheduler = Scheduler(generator, slots, queue_size, prefix_mb, kv_cache_mb)
        limits = limits or Limits()
        if limits.max_body_bytes is None:
            limits = dataclasses.replace(limits, max_body_bytes=body_limit(generator.decoder.context_length))
        self.limits = limits
        self.deadline: float | None = None  # set at shutdown: running requests end by then
        self.metrics = ServerMetrics(self.scheduler)

    def start(self) -> Service:
        self.scheduler.start()
        return self

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(
                404,
                f"model {quoted(model)} is not served here; this server serves '{self.model_id}'",
                code="model_not_found",
                param="model",
            )

    def liveness(self) -> tuple[bool, dict]:
        """Whether the scheduler is making progress: alive, and with a token or an end within
        stall_seconds whenever work waits."""
        scheduler = self.scheduler
        age = time.monotonic() - scheduler.last_progress if scheduler.busy else 0.0
        if not scheduler.alive:
            return False, {"problem": "the scheduler thread has stopped; restart the server"}
        if age > self.limits.stall_seconds:
            return False, {"problem": f"no progress for {age:.0f} s while requests wait", "stalled_seconds": age}
        return True, {"seconds_since_progress": round(age, 3)}

    def begin_shutdown(self) -> None:
        self.deadline = time.monotonic() + self.limits.shutdown_timeout

    def submit(self, prompt_ids: list[int], body: Settings, default_tokens: int, grammar=None) -> tuple[Reply, Job]:
        """Queue the request (its replies kept to `grammar`, an llguidance matcher, when given);
        ApiError for a bad setting, a prompt past the context or a full queue."""
        if self.deadline is not None:
            raise ApiError(503, "the server is shutting down; retry on another instance", kind="server_unavailable")
        if not self.scheduler.alive:
            raise ApiError(503, "the scheduler has stopped; restart the server", kind="server_error")
        asked = [getattr(body, "max_completion_tokens", None), body.max_tokens]  # chat's newer name first
        max_tokens = next((n for n in asked if n is not None), default_tokens)
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens {max_tokens} must be at least 1", param="max_tokens")
        try:
            sampling = Sampling(*body.sampling_values())
            top_logprobs = body.logprob_count()
            self.generator.checked_prompt(prompt_ids, max_tokens)
        except RequestError as error:
            raise ApiError.refused(error) from None
        except ValueError as error:
            code = "context_length_exceeded" if "context" in str(error) else None
            raise ApiError(400, str(error), code=code) from None
        reply, loop = Reply(len(prompt_ids)), asyncio.get_running_loop()

        def on_token(token: int) -> None:  # (on the scheduler's thread, right after the pick)
            noted = job.sampler.taken() if top_logprobs is not None else None
            loop.call_soon_threadsafe(reply.queue.put_nowait, (token, noted))

        def on_end(reason: str) -> None:
            loop.call_soon_threadsafe(reply.queue.put_nowait, reason)

        job = Job(prompt_ids, max_tokens, on_token, on_end, sampling)
        if grammar is not None:
            job.sampler = ConstrainedSampler(job.sampler, grammar)
        if top_logprobs is not None:
            job.sampler = LogprobSampler(job.sampler, top_logprobs)
        try:
            self.scheduler.submit(job)
        except TooLarge as error:
            raise ApiError(400, str(error), code="context_length_exceeded", param="max_tokens") from None
        except QueueFull as error:
            raise ApiError(429, f"{error}; retry shortly", kind="server_busy", code="queue_full") from None
        return reply, job

    async def next_item(self, reply: Reply):
        """The job's next token or end; past the shutdown deadline, or with the scheduler gone,
        an ApiError instead (checked between tokens and every POLL_SECONDS while none comes)."""
        while True:
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise ApiError(
                    503, "the server shut down before this reply was finished; retry", kind="server_unavailable"
                )
            try:
                return await asyncio.wait_for(reply.queue.get(), timeout=POLL_SECONDS)
            except TimeoutError:
                if not self.scheduler.alive:
                    raise ApiError(503, "the scheduler stopped; restart the server", kind="server_error") from None

    async def pieces(self, reply: Reply, job: Job, stops: tuple[str, ...]):
        """The reply's text pieces as they come, up to a stop string, each with the logprobs of the
        tokens it completes (empty unless asked); sets its finish reason. The job is cancelled (its
        slot freed) however this ends early: a stop string or a client gone."""
        detokenizer, cut = IncrementalDetokenizer(self.generator.tokenizer), StopStrings(stops)
        last, noted = reply.admitted, []
        try:
            while True:
                item = await self.next_item(reply)
                if isinstance(item, str):  # the end: a reason, or an error
                    if item.startswith("error: "):
                        raise ApiError(500, item.removeprefix("error: "), kind="server_error")
                    reply.finish_reason = "length" if item == LENGTH else "stop"
                    shown, stopped = cut.push(detokenizer.flush())
                    if (rest := shown if stopped else shown + cut.flush()) or noted:
                        yield rest, noted
                    return
                now = time.perf_counter()
                timing = self.metrics.inter_token if reply.completion_tokens else self.metrics.first_token
                timing.observe(now - last)
                self.metrics.tokens.inc()
                last = now
                token, logprob = item
                reply.completion_tokens += 1
                noted += [logprob] if logprob is not None else []
                shown, stopped = cut.push(detokenizer.push(token))
                if shown:
                    yield shown, noted
                    noted = []
                if stopped:
                    reply.finish_reason = "stop"
                    return
        finally:
            job.cancelled.set()  # a no-op once the scheduler has ended the job


def usage(reply: Reply) -> dict:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


async def parsed(request: Request, model: type[Settings], limit: int) -> Settings:
    """The body as model: JSON by its Content-Type, within the size limit, read no further."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"Content-Type {quoted(media_type or 'none')}: send the body as application/json")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {int(declared)} bytes; this server takes at most {limit} (--max-body-mb)")
    body, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over {limit} bytes, the most this server takes (--max-body-mb)")
        body.append(chunk)
    try:
        return parse_body(b"".join(body), model)
    except RequestError as error:
        raise ApiError.refused(error) from None


async def collect(service: Service, request: Request, reply: Reply, job: Job, stops) -> tuple[str, list]:
    """The whole text and its tokens' logprobs, cancelling the job if the client goes away while it waits."""
    pieces, text, noted = service.pieces(reply, job, stops), [], []
    task = asyncio.ensure_future(_gather(pieces, text, noted))
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            job.cancelled.set()
            raise ApiError(499, "the client closed the request")
    task.result()
    return "".join(text), noted


async def _gather(pieces, text: list[str], noted: list) -> None:
    async for piece, logprobs in pieces:
        text.append(piece)
        noted += logprobs


def sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


class Door:
    """ASGI middleware in front of every route: the API key and, on loopback, the Host header.
    (Pure ASGI, not Starlette's BaseHTTPMiddleware, which would buffer streamed replies.)"""

    def __init__(self, app, api_key: str | None, loopback: bool):
        self.app, self.api_key, self.loopback = app, api_key, loopback

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (refusal := self.refusal(scope["path"], Headers(scope=scope))):
            return await refusal.response()(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, path: str, headers: Headers) -> ApiError | None:
        if self.loopback and (host := headers.get("host")) is not None and host_name(host) not in LOOPBACK_NAMES:
            return ApiError(400, f"Host {quoted(host)} is not this machine; the server listens on loopback only")
        if self.api_key is None or path == "/health":
            return None
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            message = "a valid API key is required: send Authorization: Bearer <key>"
            return ApiError(401, message, code="invalid_api_key")
        return None


def host_name(host: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1"."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(service: Service, api_key: str | None = None, loopback: bool = True) -> FastAPI:
    app = FastAPI(title="ortforge", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Door, api_key=api_key, loopback=loopback)
    app.add_middleware(Observed, metrics=service.metrics, routes=ROUTES)  # outermost: sees the door's answers too

    @app.exception_handler(ApiError)
    async def api_error(_, error: ApiError):
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(_, error: Exception):  # a bug of ours: still OpenAI's shape, never a traceback
        message = f"internal error ({type(error).__name__}); please report it"
        return ApiError(500, message, kind="server_error").response()

    @app.get("/health")
    async def health():
        scheduler = service.scheduler
        alive, figures = service.liveness()
        body = {
            "status": "ok" if alive else "stuck",
            "model": service.model_id,
            "slots": scheduler.slots,
            "active": len(scheduler.active),
            "queued": scheduler.queued,
            "kv_cache_mb": {
                "budget": round(scheduler.kv.megabytes, 1),
                "reserved": round(scheduler.kv.reserved * scheduler.kv.bytes_per_token / 1e6, 1),
                "used": round(scheduler.kv_used_bytes / 1e6, 1),
            },
            "batching": scheduler.note,
            **figures,
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "owned_by": "ortforge"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parsed(request, CompletionRequest, service.limits.max_body_bytes)
        service.check_model(body.model)
        try:  # off the event loop: a long prompt must not stall every other stream
            prompt_ids = await run_in_threadpool(service.generator.encode_prompt, body.text())
        except ValueError as error:
            raise ApiError(400, f"prompt: {error}", param="prompt") from None
        return await respond(request, body, prompt_ids, COMPLETION_DEFAULT_TOKENS, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parsed(request, ChatRequest, service.limits.max_body_bytes)
        service.check_model(body.model)
        try:
            prompt_ids = await run_in_threadpool(service.generator.encode_chat, body.plain_messages())
        except RequestError as error:
            raise ApiError.refused(error) from None
        except ValueError as error:
            raise ApiError(400, f"messages: {error}", param="messages") from None
        room = service.scheduler.kv.row_tokens  # the context, within the KV budget
        try:
            schema = body.json_schema()
            grammar = None if schema is None else await run_in_threadpool(service.grammars.matcher, schema)
        except RequestError as error:
            raise ApiError.refused(error) from None
        return await respond(request, body, prompt_ids, max(1, room - len(prompt_ids)), chat=True, grammar=grammar)

    async def respond(
        request: Request, body: Settings, prompt_ids: list[int], default_tokens: int, chat: bool, grammar=None
    ):
        try:
            stops = stop_strings(body.stop or ())
        except ValueError as error:
            raise ApiError(400, f"stop: {error}", param="stop") from None
        reply, job = service.submit(prompt_ids, body, default_tokens, grammar)
        shape = Shape(service.model_id, chat, service.generator.tokenizer if body.logprob_count() is not None else None)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = stream_events(service, reply, job, stops, shape, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        text, noted = await collect(service, request, reply, job, stops)
        return shape.whole(text, reply, noted)

    return app


async def stream_events(service: Service, reply: Reply, job: Job, stops, shape: Shape, include_usage: bool):
    """The reply as server-sent events; a client that goes away cancels the job (its slot frees)."""
    try:
        if shape.chat:
            yield sse(shape.chunk({"role": "assistant", "content": ""}))
        async for piece, noted in service.pieces(reply, job, stops):
            yield sse(shape.chunk({"content": piece} if shape.chat else piece, logprobs=noted))
        yield sse(shape.chunk({} if shape.chat else "", reply.finish_reason))
        if include_usage:
            yield sse({**shape.chunk(None), "choices": [], "usage": usage(reply)})
        yield "data: [DONE]\n\n"
    except ApiError as error:
        yield sse({"error": {"message": str(error), "type": error.kind}})
    finally:
        job.cancelled.set()


@dataclass
class Shape:
    """OpenAI's response objects for one request: chat or text completion, whole or in chunks."""

    model: str
    chat: bool
    tokenizer: Tokenizer | None = None  # the model's, when the request asked for logprobs
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    sent: int = 0  # characters of the reply sent in chunks so far (completions' text_offset)

    def _logprobs(self, noted: list, offset: int) -> dict | None:
        if self.tokenizer is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, noted)
        return completion_logprobs(self.tokenizer, noted, offset)

    def _head(self, kind: str) -> dict:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, reply: Reply, noted: list = ()) -> dict:
        logprobs = self._logprobs(list(noted), 0)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs}
        kind = "chat.completion" if self.chat else "text_completion"
        choices = [{**choice, "finish_reason": reply.finish_reason}]
        return {**self._head(kind), "choices": choices, "usage": usage(reply)}

    def chunk(self, content, finish_reason: str | None = None, logprobs: list | None = None) -> dict:
        """One streamed chunk; logprobs: those of the tokens whose text it carries (None: none)."""
        found = None if logprobs is None else self._logprobs(logprobs, self.sent)
        if self.chat:
            choice = {"index": 0, "delta": content or {}, "logprobs": found}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": found}
            self.sent += len(content or "")
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [{**choice, "finish_reason": finish_reason}]}


def model_id(folder: Path) -> str:
    """artifacts/<model>/variants/<variant> is served as '<model>/<variant>'; another folder by its name."""
    folder = Path(folder).resolve()
    return f"{folder.parents[1].name}/{folder.name}" if folder.parent.name == "variants" else folder.name


def listening_socket(host: str, port: int):
    """The socket the server will listen on, bound now: a taken port or a bad address is one
    line before the model loads, and the URL printed is the one bound (port 0: any free port)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        reason = error.strerror or error
        raise ValueError(f"cannot listen on {host}:{port} ({reason}); pick another --port or --host") from None
    return sock


def serve(
    folder: Path,
    host: str,
    port: int,
    slots: int,
    queue_size: int,
    prefix_mb: float,
    api_key: str | None = None,
    insecure: bool = False,
    limits: Limits | None = None,
    kv_cache_mb: float | None = None,
) -> None:
    loopback = is_loopback(host)
    if not loopback and api_key is None and not insecure:
        raise ValueError(
            f"--host {host} is reachable from other machines and no API key is set; give --api-key (or "
            "ORTFORGE_API_KEY), or --insecure to serve without one"
        )
    sock = listening_socket(host, port)
    generator = TextGenerator(folder)
    service = Service(generator, model_id(folder), slots, queue_size, prefix_mb, limits, kv_cache_mb).start()
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {service.model_id} on http://{shown}:{bound}/v1 ({service.scheduler.note})", flush=True)
    if not loopback and api_key is None:
        print(f"warning: no API key: anyone who can reach {host}:{bound} can use this server", flush=True)
    access = logging.getLogger("ortforge.access")
    access.addHandler(logging.StreamHandler())
    access.setLevel(logging.INFO)
    app = create_app(service, api_key, loopback)
    server = GracefulServer(service, uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        if not server.force_exit:
            service.scheduler.stop()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a bounded shutdown: the first signal stops admission and gives the
    running requests the service's shutdown_timeout (they then end with an error); a second
    signal of any kind exits at once (uvicorn alone forces only on a second Ctrl-C)."""

    def __init__(self, service: Service, config):
        config.timeout_graceful_shutdown = service.limits.shutdown_timeout + 5  # a backstop past our own
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        else:
            self.service.begin_shutdown()
        super().handle_exit(sig, frame)

"""`ortforge serve`: an OpenAI-compatible HTTP API over continuous batching (ortforge.scheduler).

GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed as
server-sent events with `"stream": true`. Only a validated artifact is served (the CLI checks its
stamp). Errors have OpenAI's JSON shape and a 4xx status: a malformed body 400, an unknown model
404, `max_tokens` <= 0 or a prompt past the context 400, a full queue 429 with Retry-After. A
client that disconnects cancels its request, which frees its slot at the next step.

Needs the `serve` extra (FastAPI, uvicorn); the rest of the runtime does not import this module.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException

from ortforge.chat import StopStrings, stop_strings
from ortforge.generate import IncrementalDetokenizer, TextGenerator
from ortforge.sampling import Sampling
from ortforge.scheduler import LENGTH, Job, QueueFull, Scheduler

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


class Settings(BaseModel):
    """The fields both endpoints take (OpenAI's, and top_k and repetition_penalty as extensions)."""

    model_config = ConfigDict(extra="ignore")  # clients send fields that do not change the output (user, ...)
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1


class CompletionRequest(Settings):
    prompt: str | list[str]


class ChatRequest(Settings):
    messages: list[dict]
    max_completion_tokens: int | None = None


@dataclass
class Reply:
    """One request's tokens, handed from the scheduler's thread to the event loop."""

    prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    completion_tokens: int = 0
    finish_reason: str | None = None


class Service:
    def __init__(self, generator: TextGenerator, model_id: str, slots: int, queue_size: int, prefix_mb: float = 0):
        self.generator, self.model_id = generator, model_id
        self.scheduler = Scheduler(generator, slots, queue_size, prefix_mb)

    def start(self) -> Service:
        self.scheduler.start()
        return self

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(
                404, f"model '{model}' is not served here; this server serves '{self.model_id}'", code="model_not_found"
            )

    def submit(self, prompt_ids: list[int], body: Settings, default_tokens: int) -> tuple[Reply, Job]:
        """Queue the request; ApiError for a bad setting, a prompt past the context or a full queue."""
        asked = [getattr(body, "max_completion_tokens", None), body.max_tokens]  # chat's newer name first
        max_tokens = next((n for n in asked if n is not None), default_tokens)
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens {max_tokens} must be at least 1")
        if body.n != 1:
            raise ApiError(400, f"n={body.n}: this server returns one choice per request; send n=1")
        try:
            sampling = Sampling(body.temperature, body.top_k, body.top_p, body.repetition_penalty, body.seed)
            self.generator.checked_prompt(prompt_ids, max_tokens)
        except ValueError as error:
            code = "context_length_exceeded" if "context" in str(error) else None
            raise ApiError(400, str(error), code=code) from None
        reply, loop = Reply(len(prompt_ids)), asyncio.get_running_loop()

        def on_token(token: int) -> None:
            loop.call_soon_threadsafe(reply.queue.put_nowait, token)

        def on_end(reason: str) -> None:
            loop.call_soon_threadsafe(reply.queue.put_nowait, reason)

        job = Job(prompt_ids, max_tokens, on_token, on_end, sampling)
        try:
            self.scheduler.submit(job)
        except QueueFull as error:
            raise ApiError(429, f"{error}; retry shortly", kind="server_busy", code="queue_full") from None
        return reply, job

    async def pieces(self, reply: Reply, job: Job, stops: tuple[str, ...]):
        """The reply's text pieces as they come, up to a stop string; sets its finish reason. The
        job is cancelled (its slot freed) however this ends early: a stop string or a client gone."""
        detokenizer, cut = IncrementalDetokenizer(self.generator.tokenizer), StopStrings(stops)
        try:
            while True:
                item = await reply.queue.get()
                if isinstance(item, str):  # the end: a reason, or an error
                    if item.startswith("error: "):
                        raise ApiError(500, item.removeprefix("error: "), kind="server_error")
                    reply.finish_reason = "length" if item == LENGTH else "stop"
                    shown, stopped = cut.push(detokenizer.flush())
                    if rest := shown if stopped else shown + cut.flush():
                        yield rest
                    return
                reply.completion_tokens += 1
                shown, stopped = cut.push(detokenizer.push(item))
                if shown:
                    yield shown
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


async def parsed(request: Request, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON ({error}); send a JSON object") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}") from None


async def collect(service: Service, request: Request, reply: Reply, job: Job, stops) -> str:
    """The whole text, cancelling the job if the client goes away while it waits."""
    pieces, text = service.pieces(reply, job, stops), []
    task = asyncio.ensure_future(_gather(pieces, text))
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            job.cancelled.set()
            raise ApiError(499, "the client closed the request")
    task.result()
    return "".join(text)


async def _gather(pieces, into: list[str]) -> None:
    async for piece in pieces:
        into.append(piece)


def sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="ortforge", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, error: ApiError):
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        return ApiError(error.status_code, str(error.detail)).response()

    @app.get("/health")
    async def health():
        scheduler = service.scheduler
        return {
            "status": "ok",
            "model": service.model_id,
            "slots": scheduler.slots,
            "active": len(scheduler.active),
            "queued": scheduler.queued,
            "batching": scheduler.note,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "owned_by": "ortforge"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parsed(request, CompletionRequest)
        service.check_model(body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, f"prompt: {len(prompts)} prompts; send one per request")
        try:
            prompt_ids = service.generator.encode_prompt(prompts[0])
        except ValueError as error:
            raise ApiError(400, f"prompt: {error}") from None
        return await respond(request, body, prompt_ids, COMPLETION_DEFAULT_TOKENS, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parsed(request, ChatRequest)
        service.check_model(body.model)
        try:
            prompt_ids = service.generator.encode_chat(body.messages)
        except ValueError as error:
            raise ApiError(400, f"messages: {error}") from None
        context = service.generator.decoder.context_length or len(prompt_ids) + 1024
        return await respond(request, body, prompt_ids, max(1, context - len(prompt_ids)), chat=True)

    async def respond(request: Request, body: Settings, prompt_ids: list[int], default_tokens: int, chat: bool):
        try:
            stops = stop_strings(body.stop or ())
        except ValueError as error:
            raise ApiError(400, f"stop: {error}") from None
        reply, job = service.submit(prompt_ids, body, default_tokens)
        shape = Shape(service.model_id, chat)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = stream_events(service, reply, job, stops, shape, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        text = await collect(service, request, reply, job, stops)
        return shape.whole(text, reply)

    return app


async def stream_events(service: Service, reply: Reply, job: Job, stops, shape: Shape, include_usage: bool):
    """The reply as server-sent events; a client that goes away cancels the job (its slot frees)."""
    try:
        if shape.chat:
            yield sse(shape.chunk({"role": "assistant", "content": ""}))
        async for piece in service.pieces(reply, job, stops):
            yield sse(shape.chunk({"content": piece} if shape.chat else piece))
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
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, kind: str) -> dict:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, reply: Reply) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        kind = "chat.completion" if self.chat else "text_completion"
        choices = [{**choice, "finish_reason": reply.finish_reason}]
        return {**self._head(kind), "choices": choices, "usage": usage(reply)}

    def chunk(self, content, finish_reason: str | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": content or {}}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [{**choice, "finish_reason": finish_reason}]}


def model_id(folder: Path) -> str:
    """artifacts/<model>/variants/<variant> is served as '<model>/<variant>'; another folder by its name."""
    folder = Path(folder).resolve()
    return f"{folder.parents[1].name}/{folder.name}" if folder.parent.name == "variants" else folder.name


def serve(folder: Path, host: str, port: int, slots: int, queue_size: int, prefix_mb: float) -> None:
    import uvicorn

    service = Service(TextGenerator(folder), model_id(folder), slots, queue_size, prefix_mb).start()
    print(f"serving {service.model_id} on http://{host}:{port}/v1 ({service.scheduler.note})", flush=True)
    uvicorn.run(create_app(service), host=host, port=port, log_level="warning")

"""The HTTP side: a Starlette (ASGI) app serving the OpenAI API over a `Scheduler`.

POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with
"stream": true), GET /v1/models, GET /health, GET /metrics (Prometheus). The scheduler runs in
its own thread; its token events come back to the event loop once per iteration, and each
request's tokens are detokenized here, off the scheduler's thread. A client that disconnects
cancels its request, which frees its cache row in the scheduler's next iteration.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import traceback

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..tokenizer import TokenizerError
from .metrics import Metrics
from .protocol import (ApiError, GenerationRequest, check_context, chunk_object, completion_object, error_body,
                       parse_json, parse_request, response_id, usage)
from .scheduler import CANCELLED, ERROR, QueueFull, Request, Scheduler


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1  # the hint sent with a 429


class TextStream:
    """A completion's text as its tokens arrive: new text only, a trailing incomplete UTF-8
    character held back, and the text cut before the first stop string (which ends it)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be forming
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens)
        for stop in self.stops:
            index = text.find(stop, max(0, len(self.sent) - len(stop)))
            if index >= 0:
                text, self.stopped = text[:index], True
        end = len(text) if self.stopped else len(text) - self.hold
        if not self.stopped and text.endswith("\ufffd"):
            end = min(end, len(text) - 1)
        return self._emit(text[:max(end, 0)])

    def finish(self) -> str:
        return "" if self.stopped else self._emit(self.tokenizer.decode(self.tokens))

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


class Service:
    """The model, tokenizer and scheduler behind the app, and the bridge from the scheduler's thread."""

    def __init__(self, model, tokenizer, engine, *, model_name: str, max_queue: int = 256,
                 limits: Limits = Limits(), channel=None):
        self.model, self.tokenizer, self.model_name, self.limits = model, tokenizer, model_name, limits
        self.scheduler = Scheduler(engine, tokenizer.eos_id, self._on_events, max_queue=max_queue, channel=channel)
        self.metrics = Metrics(self.scheduler)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def _on_events(self, events) -> None:  # the scheduler's thread
        self.loop.call_soon_threadsafe(self._deliver, events)

    @staticmethod
    def _deliver(events) -> None:
        for request, tokens, reason in events:
            request.tag.put_nowait((tokens, reason))

    def prompt_ids(self, parsed: GenerationRequest) -> list[int]:
        if not parsed.chat:
            return parsed.prompt if parsed.prompt is not None else self.tokenizer.encode(parsed.text)
        if self.tokenizer.chat_template is None:
            raise ApiError(400, f"the model {self.model_name!r} has no chat template (its tokenizer_config.json "
                           "names none): use /v1/completions with raw text", param="messages")
        try:
            return self.tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True)
        except TokenizerError as err:
            raise ApiError(400, f"the chat template rejected the messages: {err}", param="messages") from None
        except Exception as err:  # noqa: BLE001 -- a template's raise_exception or a Jinja error
            raise ApiError(400, f"the chat template rejected the messages: {err}", param="messages") from None


class Generation:
    """One request from submission to its last token, on the event loop."""

    def __init__(self, service: Service, parsed: GenerationRequest, ids: list[int], budget: int, arrived: float):
        self.service, self.parsed, self.arrived = service, parsed, arrived
        self.request = Request(ids, budget, parsed.params, tag=asyncio.Queue(), ignore_eos=parsed.ignore_eos)
        self.text = TextStream(service.tokenizer, parsed.stop)
        self.completion_tokens = 0
        self.last_token_at: float | None = None

    def submit(self) -> None:
        try:
            self.service.scheduler.submit(self.request)
        except QueueFull as err:
            raise ApiError(429, f"the server is busy ({err}); retry after {self.service.limits.retry_after_s} s",
                           kind="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.service.limits.retry_after_s)}) from None
        except RuntimeError as err:
            raise ApiError(503, str(err), kind="server_error") from None
        self.service.metrics.prompt_tokens.inc(len(self.request.prompt))

    def cancel(self) -> None:
        if self.request.finish_reason is None:
            self.service.scheduler.cancel(self.request)

    async def pieces(self):
        """(new text, finish reason or None) until the finish; raises ApiError if the step failed."""
        metrics = self.service.metrics
        while True:
            tokens, reason = await self.request.tag.get()
            if tokens:
                now = time.perf_counter()
                if self.last_token_at is None:
                    metrics.time_to_first_token.observe(now - self.arrived)
                else:
                    metrics.inter_token_latency.observe(now - self.last_token_at)
                self.last_token_at = now
                self.completion_tokens += len(tokens)
                metrics.generated_tokens.inc(len(tokens))
            if reason == ERROR:
                raise ApiError(500, self.service.scheduler.error or "the model step failed", kind="server_error")
            text = self.text.add(tokens) if tokens else ""
            if self.text.stopped:
                self.cancel()  # stops the row's decoding; the finish is ours to report
                yield text, "stop"
                return
            if reason is not None:
                yield text + self.text.finish(), "stop" if reason == CANCELLED else reason
                return
            if text:
                yield text, None

    def usage(self) -> dict:
        return usage(len(self.request.prompt), self.completion_tokens)


async def read_body(request: HttpRequest, limit: int) -> bytes:
    length = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body exceeds the server's limit of {limit} bytes", code="body_too_large")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


async def watch_disconnect(receive, on_disconnect) -> None:
    """Wait for the client to go away (the body already read), then call on_disconnect."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class EventStream:
    """A server-sent-events response whose client's disconnection cancels the generation at once."""

    def __init__(self, events, on_disconnect):
        self.events, self.on_disconnect = events, on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        watcher = asyncio.create_task(watch_disconnect(receive, self.on_disconnect))
        try:
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client is gone
            self.on_disconnect()
        finally:
            watcher.cancel()
            self.on_disconnect()


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def stream_events(generation: Generation, rid: str, model: str, created: int):
    chat = generation.parsed.chat
    first = True
    try:
        async for text, reason in generation.pieces():
            if text or (chat and first):
                yield sse(chunk_object(rid, model, chat, created, text, None, first=first))
                first = False
            if reason is not None:
                yield sse(chunk_object(rid, model, chat, created, None, reason))
        if generation.parsed.include_usage:
            yield sse(chunk_object(rid, model, chat, created, None, None, usage_counts=generation.usage()))
    except ApiError as err:
        yield sse(err.body())
    yield b"data: [DONE]\n\n"


async def complete(service: Service, http: HttpRequest, chat: bool):
    arrived = time.perf_counter()
    body = parse_json(await read_body(http, service.limits.max_body_bytes))
    parsed = parse_request(body, chat=chat, model_name=service.model_name, vocab_size=service.model.args.vocab_size)
    ids = service.prompt_ids(parsed)
    budget = check_context(len(ids), parsed.max_tokens, service.model.args.max_seq_len,
                           "messages" if chat else "prompt")
    generation = Generation(service, parsed, ids, budget, arrived)
    generation.submit()
    rid, created = response_id(chat), int(time.time())
    if parsed.stream:
        return EventStream(stream_events(generation, rid, service.model_name, created), generation.cancel)
    watcher = asyncio.create_task(watch_disconnect(http.receive, generation.cancel))
    try:
        text, reason = "", None
        async for piece, reason in generation.pieces():
            text += piece
    finally:
        watcher.cancel()
        generation.cancel()
    return JSONResponse(completion_object(rid, service.model_name, chat, text, reason, generation.usage(), created))


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def make_app(service: Service) -> Starlette:
    def endpoint(name: str, handler):
        async def route(http: HttpRequest):
            try:
                response = await handler(http)
                status = getattr(response, "status_code", 200)
            except ApiError as err:
                response, status = error_response(err), err.status
            except Exception as err:  # noqa: BLE001 -- a bug: a 500 with the reason, the server keeps serving
                traceback.print_exc()
                response, status = JSONResponse(error_body(f"internal server error: {err}", "server_error"), 500), 500
            service.metrics.requests.labels(name, str(status)).inc()
            return response
        return route

    async def models(_):
        return JSONResponse({"object": "list", "data": [
            {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "dsv3-jax",
             "max_model_len": service.model.args.max_seq_len}]})

    async def health(_):
        if service.scheduler.error is not None:
            return JSONResponse({"status": "error", "error": service.scheduler.error}, status_code=503)
        return JSONResponse({"status": "ok", "running": service.scheduler.running,
                             "waiting": service.scheduler.waiting, "free_rows": service.scheduler.free_rows})

    async def metrics(_):
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(_, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{exc.detail}", kind), status_code=exc.status_code, headers=exc.headers)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        service.start()
        try:
            yield
        finally:
            service.stop()

    routes = [Route("/v1/completions", endpoint("completions", lambda h: complete(service, h, False)),
                    methods=["POST"]),
              Route("/v1/chat/completions", endpoint("chat_completions", lambda h: complete(service, h, True)),
                    methods=["POST"]),
              Route("/v1/models", endpoint("models", models), methods=["GET"]),
              Route("/health", endpoint("health", health), methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)

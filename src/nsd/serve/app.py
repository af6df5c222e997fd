"""The FastAPI app: OpenAI-style routes over one engine and its decode worker.

A generation request is validated and tokenised on the event loop side (tokenising in a
thread pool), admitted to the worker's bounded FIFO queue or refused with 429, and then
answered from the events the worker hands back: as one JSON body, or as server-sent events
in OpenAI's chunk format ending with ``data: [DONE]``. No path returns a traceback, and no
error costs the client its keep-alive connection.

The engine may be loaded after the app starts (``load_engine``): the server then listens at
once, answering ``/health`` 503 ``loading`` and every other route 503 until it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import math
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nsd import options as optspec
from nsd.api import GenerationResult
from nsd.errors import NSDError
from nsd.prefix_cache import PrefixCache
from nsd.serve.config import ServerConfig
from nsd.serve.metrics import ServeMetrics
from nsd.serve.protocol import (ApiError, ChatRequest, CompletionRequest, ResponseBuilder,
                                finish_reason, generation_config, parse_request, sse)
from nsd.serve.worker import DecodeWorker, Job, QueueFull, ShuttingDown

log = logging.getLogger("nsd.serve")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OPEN_PATHS = ("/health",)  # liveness probes need no key
LOADING_PATHS = ("/health", "/metrics")  # answered while the model loads; the rest get 503
LOADING_RETRY_AFTER_S = 5


class _Model:
    """The engine, or where its background load stands (``engine`` None while loading)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.error: BaseException | None = None

    @property
    def status(self) -> str:
        return "ok" if self.engine is not None else ("failed" if self.error else "loading")


def _json_number(value: Any) -> Any:
    """JSON has no infinity: an unlimited budget or cap is reported as null."""
    return None if isinstance(value, float) and math.isinf(value) else value


def create_app(engine: Any, config: ServerConfig, load_engine: Callable[[], Any] | None = None,
               on_loaded: Callable[[BaseException | None], None] | None = None) -> FastAPI:
    """The app for ``engine`` (an :class:`nsd.api.Engine` or anything with its ``encode``,
    ``stream`` and ``context_length``). The worker thread lives as long as the app's
    lifespan: started at startup, stopped (running job cancelled) at shutdown.

    With ``engine`` None, ``load_engine`` is called on a thread of its own at startup, so
    the server answers (503) while a model of a minute's load comes up; ``on_loaded`` is
    then called on the event loop with None, or with the exception the load raised."""
    if (engine is None) == (load_engine is None):
        raise ValueError("give either an engine or a function that loads one")
    model = _Model(engine)
    worker = DecodeWorker(engine, config.queue_size, config.parallel, config.prefill_chunk)
    metrics = ServeMetrics(lambda: worker.depth,
                           lambda: getattr(model.engine, "prefix_cache", None),
                           lambda: worker.batcher, lambda: worker.running)
    if engine is not None:
        _attach_prefix_cache(engine, config)
    started = int(time.time())

    def loaded(result: Any, error: BaseException | None) -> None:
        model.engine, model.error = result, error
        if error is None:
            _attach_prefix_cache(result, config)
        if error is None and not worker.closing:  # a signal during the load: never start
            worker.start(result)
        if on_loaded is not None:
            on_loaded(error)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if load_engine is None:
            worker.start()
        else:
            _load_in_background(load_engine, loaded, asyncio.get_running_loop())
        yield
        await asyncio.to_thread(worker.stop, config.shutdown_timeout_s)

    app = FastAPI(title="nsd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config
    app.state.model = model
    app.add_middleware(ApiMiddleware, api_key=config.api_key, metrics=metrics,
                       ready=lambda: model.engine is not None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), code=code).body(),
                            status_code=exc.status_code)

    # Unexpected exceptions are answered by ApiMiddleware: a handler registered here for
    # Exception would answer but then re-raise, and uvicorn drops the connection for it.

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "shutting_down" if worker.closing else model.status
        body = {"status": status, "model": config.model_name, "busy": worker.busy,
                "running": worker.running, "parallel": config.parallel, "queue_depth": worker.depth}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        # What a request gets for every ``nsd`` knob it leaves out: the server's settings,
        # keyed by the same option names the request's ``nsd`` object takes.
        defaults = {name: _json_number(getattr(config.defaults, name))
                    for name in (*optspec.RULE, *optspec.DRAFT_LENGTH)}
        return {"id": config.model_name, "object": "model", "created": started, "owned_by": "nsd",
                "nsd": {"defaults": defaults}}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> JSONResponse:
        if model_id != config.model_name:
            raise ApiError(404, f"model {model_id!r} is not served here (this server has "
                           f"{config.model_name!r})", param="model", code="model_not_found")
        return JSONResponse(model_card())

    async def generate(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        raw = await _read_body(request, config.max_body_bytes)
        req = parse_request(raw, ChatRequest if chat else CompletionRequest)
        if req.model != config.model_name:
            raise ApiError(404, f"model {req.model!r} is not served here (this server has "
                           f"{config.model_name!r})", param="model", code="model_not_found")
        # Validate every knob before tokenising; the token budget is fixed afterwards.
        gen_config = generation_config(req, config.defaults,
                                       req.requested_tokens or config.defaults.max_new_tokens,
                                       check=worker.check)
        engine = model.engine
        vocab = getattr(getattr(engine, "target", None), "vocab_size", None)
        if vocab is not None and any(t >= vocab for t, _ in req.logit_bias_pairs):
            bad = next(t for t, _ in req.logit_bias_pairs if t >= vocab)
            raise ApiError(400, f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})",
                           param="logit_bias", code="invalid_value")
        prompt_ids = await _encode(engine, req)
        gen_config = dataclasses.replace(gen_config, max_new_tokens=_max_new_tokens(
            req, len(prompt_ids), getattr(engine, "context_length", None),
            config.defaults.max_new_tokens))
        job = Job(prompt_ids, gen_config, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull as exc:
            metrics.rejections.labels("queue_full").inc()
            raise ApiError(429, f"the server is busy: {config.queue_size} requests are already "
                           "waiting; retry later", code="queue_full", type_="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except ShuttingDown:
            metrics.rejections.labels("shutting_down").inc()
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           type_="server_error") from None
        run = _Run(job, worker, metrics, arrived, arrived + config.request_timeout_s)
        builder = ResponseBuilder(config.model_name, chat, gen_config)
        if req.stream:
            return StreamingResponse(_stream(run, builder, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collector = asyncio.ensure_future(run.result())
        watcher = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn gave up on this request (shutdown grace over)
            collector.cancel()
            run.abandon("shutdown")
            raise
        finally:
            watcher.cancel()
        if not collector.done():  # the client left: stop its generation at the next block
            collector.cancel()
            run.abandon("disconnect")
            return Response(status_code=499)
        return JSONResponse(builder.full(collector.result()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


def _attach_prefix_cache(engine: Any, config: ServerConfig) -> None:
    """Give the engine a prefix cache of the configured budget (an engine-like object
    without the attribute is left alone: its caches are its business)."""
    if hasattr(engine, "prefix_cache"):
        engine.prefix_cache = PrefixCache(int(config.prefix_cache_mb * (1 << 20)))


def _load_in_background(load_engine: Callable[[], Any],
                        loaded: Callable[[Any, BaseException | None], None],
                        loop: asyncio.AbstractEventLoop) -> None:
    """Run ``load_engine`` on a daemon thread (a shutdown need not wait for a half-loaded
    model) and hand its result, or its exception, to ``loaded`` on the loop."""

    def run() -> None:
        try:
            result, error = load_engine(), None
        except BaseException as exc:  # reported to the server, which exits with it
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(loaded, result, error)
        except RuntimeError:  # the loop is closed: the server stopped during the load
            pass

    threading.Thread(target=run, name="nsd-load", daemon=True).start()


class _Run:
    """The loop-side view of one admitted job: its deadline, timings and bookkeeping."""

    def __init__(self, job: Job, worker: DecodeWorker, metrics: ServeMetrics, arrived: float,
                 deadline: float) -> None:
        self.job, self.worker, self.metrics = job, worker, metrics
        self.arrived, self.deadline = arrived, deadline
        self.started: float | None = None
        self.first_text: float | None = None
        self.closed = False
        metrics.in_progress.inc()

    async def next_event(self) -> tuple[str, Any]:
        """The worker's next event; raises :class:`ApiError` (504) past the deadline."""
        remaining = self.deadline - time.perf_counter()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            kind, payload = await asyncio.wait_for(self.job.events.get(), remaining)
        except asyncio.TimeoutError:
            self.abandon("timeout")
            raise ApiError(504, "the request timed out", code="timeout", type_="server_error") from None
        now = time.perf_counter()
        if kind == "start":
            self.started = now
        elif kind == "chunk" and self.first_text is None:
            self.first_text = now
        elif kind == "done":
            self._finish(payload, now)
        elif kind == "error":
            self._close()
            if isinstance(payload, NSDError):
                raise ApiError(400, str(payload), code="invalid_value")
            self.metrics.errors.inc()
            raise ApiError(500, "generation failed", type_="server_error")
        elif kind == "cancelled":
            self._cancelled(payload or "unknown")
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           type_="server_error")
        return kind, payload

    async def result(self) -> GenerationResult:
        while True:
            kind, payload = await self.next_event()
            if kind == "done":
                return payload

    def abandon(self, reason: str) -> None:
        """Stop the job (at its next block, or now if it has not started)."""
        if self.closed:
            return
        self.job.cancel(reason)
        self.worker.withdraw(self.job)
        self._cancelled(reason)

    def _cancelled(self, reason: str) -> None:
        self.metrics.cancellations.labels(reason).inc()
        if self.first_text is not None:  # its first token came: a TTFT like any other
            self.metrics.ttft.observe(self.first_text - self.arrived)
        self._close()

    def _finish(self, result: GenerationResult, now: float) -> None:
        started = self.started if self.started is not None else now
        ttft = None if self.first_text is None else self.first_text - self.arrived
        self.metrics.observe(result, self.job.config.method, ttft, started - self.arrived,
                             now - self.arrived)
        self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.metrics.in_progress.dec()


async def _stream(run: _Run, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        if builder.chat:
            yield sse(builder.chunk(role=True))
        while True:
            try:
                kind, payload = await run.next_event()
            except ApiError as exc:  # headers are gone: report in-band, then end the stream
                yield sse(exc.body())
                break
            except Exception:  # the same for a bug, so the stream still ends well-formed
                log.exception("unexpected error in a stream")
                yield sse(ApiError(500, "internal server error", type_="server_error").body())
                break
            if kind == "chunk":
                yield sse(builder.chunk(text=payload))
            elif kind == "done":
                yield sse(builder.chunk(finish=finish_reason(payload)))
                if include_usage:
                    yield sse(builder.chunk(usage_body=builder.usage(payload)))
                break
        yield sse("[DONE]")
    finally:
        # Reached with the run still open only when the client went away mid-stream
        # (the response task is cancelled); stop its generation.
        run.abandon("disconnect")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="too_large")
    raw = await request.body()
    if len(raw) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="too_large")
    return raw


async def _encode(engine: Any, req: CompletionRequest | ChatRequest) -> list[int]:
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list):
        # Token ids, checked against the vocabulary.
        vocab = getattr(getattr(engine, "target", None), "vocab_size", None)
        if vocab is not None and not all(0 <= t < vocab for t in req.prompt):
            raise ApiError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt",
                           code="invalid_value")
        return list(req.prompt)
    try:
        if isinstance(req, ChatRequest):
            return await asyncio.to_thread(_encode_chat, engine, req)
        return await asyncio.to_thread(engine.encode, req.prompt)
    except NSDError as exc:
        raise ApiError(400, f"{req.prompt_param}: {exc}", param=req.prompt_param,
                       code="invalid_value") from None


def _encode_chat(engine: Any, req: ChatRequest) -> list[int]:
    """The conversation's token ids. Messages' ``name`` goes to the chat template; names the
    template does not show (many ignore them) are refused, since they would otherwise be
    dropped unseen. Templates decide by role, so per role with named messages the
    conversation is rendered once more without that role's names: the same tokens, and the
    template ignored them (at most one render per role, however many messages)."""
    ids = engine.encode([m.as_dict() for m in req.messages])
    first_named: dict[str, int] = {}
    for i, m in enumerate(req.messages):
        if m.name is not None:
            first_named.setdefault(m.role, i)
    for role, i in sorted(first_named.items(), key=lambda item: item[1]):
        if engine.encode([m.as_dict(name=m.role != role) for m in req.messages]) == ids:
            raise ApiError(400, f"messages[{i}].name: this model's chat template does not show "
                           f"the name of a message with role {role}, so it would be ignored; "
                           "leave name out (or write it into the content)",
                           param=f"messages[{i}].name", code="invalid_value")
    return ids


def _max_new_tokens(req: CompletionRequest | ChatRequest, prompt_len: int, limit: int | None,
                    default: int) -> int:
    """The request's token budget: what it asked for, else the server default cut to fit."""
    requested = req.requested_tokens
    if limit is None:
        return requested or default
    room = limit - prompt_len
    if room < 1:
        raise ApiError(400, f"{req.prompt_param}: the prompt has {prompt_len} tokens but the "
                       f"context holds {limit}", param=req.prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return min(default, room)
    if requested > room:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"{name}: {prompt_len} prompt tokens + {requested} new tokens exceed "
                       f"the context of {limit} tokens", param=name, code="context_length_exceeded")
    return requested


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so only that is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ApiMiddleware:
    """Bearer-key check before anything else (a wrong key learns nothing, not even which
    paths exist), 503 while the model loads, a request count per endpoint and status, and
    the answer to any unexpected exception: a 500 error object, never a traceback.

    It sits inside Starlette's ServerErrorMiddleware, so no exception reaches that one, which
    would re-raise it to uvicorn after answering, and uvicorn then drops the connection
    without a ``Connection: close``; here the 500 is an ordinary response and the
    keep-alive connection stays usable."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServeMetrics,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.app, self.metrics, self.ready = app, metrics, ready
        self.key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        status = [0]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key is not None and path not in OPEN_PATHS and not self._authorized(scope):
                error = ApiError(401, "invalid or missing API key", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await _send_error(error, scope, receive, counting_send)
            elif not self.ready() and path not in LOADING_PATHS:
                error = ApiError(503, "the model is still loading; retry shortly",
                                 code="model_loading", type_="server_error",
                                 headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
                await _send_error(error, scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            pass
        except Exception:
            log.exception("unexpected error")  # the details go to the log, never to the client
            if status[0]:  # the response has begun: it cannot become a 500 any more
                raise
            error = ApiError(500, "internal server error", type_="server_error")
            await _send_error(error, scope, receive, counting_send)
        finally:
            # No status sent: the client left before its answer (nginx's 499).
            self.metrics.requests.labels(endpoint, str(status[0] or 499)).inc()

    def _authorized(self, scope: Scope) -> bool:
        # "Bearer" is an auth-scheme, and RFC 7235 makes those case-insensitive.
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(b" "), self.key)


async def _send_error(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
    await response(scope, receive, send)

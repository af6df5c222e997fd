"""The FastAPI app: OpenAI-style routes over one engine and its decode worker.

A generation request is validated and tokenised on the event loop side (tokenising in a
thread pool), admitted to the worker's bounded FIFO queue or refused with 429, and then
answered from the events the worker hands back (:mod:`nsd.serve.relay`): as one JSON body,
or as server-sent events in OpenAI's chunk format ending with ``data: [DONE]``. No path
returns a traceback, and no error costs the client its keep-alive connection
(:mod:`nsd.serve.middleware`).

The engine may be loaded after the app starts (``load_engine``): the server then listens at
once, answering ``/health`` 503 ``loading`` and every other route 503 until it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nsd import options as optspec
from nsd.errors import NSDError
from nsd.prefix_cache import PrefixCache
from nsd.serve.config import ServerConfig
from nsd.serve.metrics import ServeMetrics
from nsd.serve.middleware import (LOADING_RETRY_AFTER_S, SHUTDOWN_RETRY_AFTER_S, ApiMiddleware,
                                  shutting_down_error)
from nsd.serve.protocol import (ApiError, ChatRequest, CompletionRequest, ResponseBuilder,
                                generation_config, parse_request)
from nsd.serve.relay import Run, client_gone, stream_events
from nsd.serve.worker import DecodeWorker, Job, QueueFull, ShuttingDown


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


@dataclass
class _Served:
    """What the routes share: the settings, the model (or its load), the worker, metrics."""

    config: ServerConfig
    model: _Model
    worker: DecodeWorker
    metrics: ServeMetrics
    started: int


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
    served = _Served(config, model, worker, metrics, int(time.time()))

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
                       ready=lambda: model.engine is not None, closing=lambda: worker.closing)
    _add_error_handlers(app)
    _add_info_routes(app, served)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, served, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, served, chat=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
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


def _add_info_routes(app: FastAPI, served: _Served) -> None:
    """``/health``, ``/metrics`` and the model list."""
    config, worker, model = served.config, served.worker, served.model

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "shutting_down" if worker.closing else model.status
        body = {"status": status, "model": config.model_name, "busy": worker.busy,
                "running": worker.running, "parallel": config.parallel, "queue_depth": worker.depth}
        if status == "ok":
            return JSONResponse(body)
        retry = LOADING_RETRY_AFTER_S if status == "loading" else SHUTDOWN_RETRY_AFTER_S
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(retry)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(served.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        # What a request gets for every ``nsd`` knob it leaves out: the server's settings,
        # keyed by the same option names the request's ``nsd`` object takes.
        defaults = {name: _json_number(getattr(config.defaults, name))
                    for name in (*optspec.RULE, *optspec.DRAFT_LENGTH)}
        return {"id": config.model_name, "object": "model", "created": served.started,
                "owned_by": "nsd", "nsd": {"defaults": defaults}}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> JSONResponse:
        if model_id != config.model_name:
            raise _unknown_model(model_id, config)
        return JSONResponse(model_card())


def _unknown_model(name: str, config: ServerConfig) -> ApiError:
    return ApiError(404, f"model {name!r} is not served here (this server has "
                    f"{config.model_name!r})", param="model", code="model_not_found")


async def _generate(request: Request, served: _Served, chat: bool) -> Response:
    """A completion or chat completion: admitted, then answered whole or streamed."""
    arrived = time.perf_counter()
    req, job = await _admit(request, served, chat, arrived)
    config = served.config
    run = Run(job, served.worker, served.metrics, arrived, arrived + config.request_timeout_s)
    builder = ResponseBuilder(config.model_name, chat, job.config)
    if req.stream:
        return StreamingResponse(stream_events(run, builder, req.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(request, run, builder)


async def _admit(request: Request, served: _Served, chat: bool,
                 arrived: float) -> tuple[CompletionRequest | ChatRequest, Job]:
    """Validate, tokenise and queue a generation request; every refusal is an ApiError."""
    config, worker, metrics = served.config, served.worker, served.metrics
    _check_content_type(request)
    raw = await _read_body(request, config.max_body_bytes)
    req = parse_request(raw, ChatRequest if chat else CompletionRequest, config.max_stop)
    if req.model != config.model_name:
        raise _unknown_model(req.model, config)
    # Validate every knob before tokenising; the token budget is fixed afterwards.
    gen_config = generation_config(req, config.defaults,
                                   req.requested_tokens or config.defaults.max_new_tokens,
                                   check=worker.check,
                                   proposer=getattr(served.model.engine, "proposer_kind", None))
    engine = served.model.engine
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
        raise shutting_down_error() from None
    return req, job


async def _whole(request: Request, run: Run, builder: ResponseBuilder) -> Response:
    """The whole answer as one body; a client that leaves first stops its generation."""
    collector = asyncio.ensure_future(run.result())
    watcher = asyncio.ensure_future(client_gone(request))
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


def _check_content_type(request: Request) -> None:
    """A body declared as anything but JSON is refused (415) rather than parsed as JSON;
    one declared as nothing is read as JSON."""
    given = request.headers.get("content-type")
    if given is None:
        return
    media = given.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), "
                       f"got Content-Type {given!r}", code="unsupported_media_type")


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

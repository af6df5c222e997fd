"""The middleware every request passes: the API key, 503 while the model loads, request
counts, and the answer to any unexpected exception."""

from __future__ import annotations

import hmac
import logging
from typing import Callable

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nsd.serve.metrics import ServeMetrics
from nsd.serve.protocol import ApiError

log = logging.getLogger("nsd.serve")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)  # liveness probes need no key
LOADING_PATHS = ("/health", "/metrics")  # answered while the model loads; the rest get 503
LOADING_RETRY_AFTER_S = 5
# During a graceful shutdown the server still listens and answers 503 (a load balancer's
# health check reads it and sends the traffic elsewhere); its clients may try again then.
SHUTDOWN_RETRY_AFTER_S = 5
SHUTDOWN_HEADERS = {"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)}


def shutting_down_error() -> ApiError:
    return ApiError(503, "the server is shutting down", code="shutting_down",
                    type_="server_error", headers=SHUTDOWN_HEADERS)


class ApiMiddleware:
    """Bearer-key check before anything else (a wrong key learns nothing, not even which
    paths exist), 503 while the model loads and once a shutdown has begun (both with
    ``Retry-After``; ``/health`` and ``/metrics`` still answer), a request count per
    endpoint and status, and the answer to any unexpected exception: a 500 error object,
    never a traceback.

    It sits inside Starlette's ServerErrorMiddleware, so no exception reaches that one, which
    would re-raise it to uvicorn after answering, and uvicorn then drops the connection
    without a ``Connection: close``; here the 500 is an ordinary response and the
    keep-alive connection stays usable."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServeMetrics,
                 ready: Callable[[], bool] = lambda: True,
                 closing: Callable[[], bool] = lambda: False) -> None:
        self.app, self.metrics, self.ready, self.closing = app, metrics, ready, closing
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
            refusal = self._refusal(path, scope)
            if refusal is not None:
                if refusal.code == "shutting_down" and path in GENERATION_PATHS:
                    self.metrics.rejections.labels("shutting_down").inc()
                await send_error(refusal, scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            pass
        except Exception:
            log.exception("unexpected error")  # the details go to the log, never to the client
            if status[0]:  # the response has begun: it cannot become a 500 any more
                raise
            error = ApiError(500, "internal server error", type_="server_error")
            await send_error(error, scope, receive, counting_send)
        finally:
            # No status sent: the client left before its answer (nginx's 499).
            self.metrics.requests.labels(endpoint, str(status[0] or 499)).inc()

    def _refusal(self, path: str, scope: Scope) -> ApiError | None:
        """What the request gets instead of its route, if anything."""
        if self.key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            return ApiError(401, "invalid or missing API key", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        if path in LOADING_PATHS:  # these say for themselves how the server stands
            return None
        if not self.ready():
            return ApiError(503, "the model is still loading; retry shortly",
                            code="model_loading", type_="server_error",
                            headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        if self.closing():
            return shutting_down_error()
        return None

    def _authorized(self, scope: Scope) -> bool:
        # "Bearer" is an auth-scheme, and RFC 7235 makes those case-insensitive.
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(b" "), self.key)


async def send_error(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
    await response(scope, receive, send)

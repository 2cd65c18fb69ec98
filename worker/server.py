"""The worker's HTTP API (docs/worker-api.md): thin FastAPI routes over
``WorkerService``.

Routes::

    POST   /internal/generate                 SSE: token events, final event, [DONE]
    GET    /internal/kv/stats                  pool, leases, queue, reuse counts
    GET    /internal/kv/agent                  NIXL agent metadata and pool layout
    GET    /internal/kv/leases[?conversation_key=K]
    POST   /internal/kv/leases/{lease_id}/renew
    POST   /internal/kv/leases/{lease_id}/hold     a puller's pin of the pages for one READ
    DELETE /internal/kv/leases/{lease_id}
    GET    /health  /ready  /metrics

Every error is ``{"error": {"message", "type", "code"}}`` with a one-line
message: 400 bad JSON or input the engine refuses, 422 a body of the wrong
shape, 409 a request id already in flight, 404 an unknown lease or route,
413 a body over ``max_body_bytes`` (counted while read, chunked too), 503
loading or draining; 401 on ``/internal/*`` without the deployment's internal
credential (``gate.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from kvserving.config import STREAM_KEEPALIVE_S
from kvserving.worker.async_engine import DuplicateRequestError
from kvserving.worker.gate import WorkerGate
from kvserving.worker.service import Admitted, LeaseMismatchError, LeaseNotFoundError, NotReadyError, WorkerService
from kvserving.worker.api_bodies import GenerateBody, HoldBody, RenewBody, error_body, validation_message

log = logging.getLogger(__name__)

# A prompt of a long context is a few MB of JSON; nothing legitimate is larger.
MAX_BODY_BYTES = 64 << 20


def error_response(status: int, message: str, *, type_: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_=type_, code=code), status_code=status)


def sse(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: no event, a sign of life


class EventStream(StreamingResponse):
    """The SSE response of one generate request; however it ends (finished, the
    client gone, the server stopping), the request is aborted unless it finished.
    While nothing else is sent (a long prefill, a queue, a slow step) a keep-alive
    comment goes out every ``STREAM_KEEPALIVE_S``: the gateway tells a busy worker
    from a frozen one by it (``gateway.event_timeout_s``)."""

    def __init__(self, service: WorkerService, admitted: Admitted) -> None:
        self.admitted = admitted
        self.service = service
        super().__init__(
            self._events(service), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def _events(self, service: WorkerService) -> AsyncIterator[bytes]:
        async for event in service.events(self.admitted):
            yield sse(event)
        yield sse("[DONE]")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keepalive = _KeepAlive(send)
        try:
            await super().__call__(scope, receive, keepalive.send)
        finally:
            keepalive.stop()
            self.service.close_stream(self.admitted)


class _KeepAlive:
    """``send`` of an SSE response, plus a comment whenever nothing went out for
    ``STREAM_KEEPALIVE_S`` once the response started: one timer per stream, moved
    lazily (an event costs a clock read, no timer)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._last = 0.0  # loop time of the last send
        self._open = False  # between the response's start and its last body message
        self._timer: asyncio.TimerHandle | None = None
        self._pending: asyncio.Task[None] | None = None

    async def send(self, message: Message) -> None:
        self._last = self._loop.time()
        if message["type"] == "http.response.start":
            await self._send(message)
            self._open = True
            self._timer = self._loop.call_at(self._last + STREAM_KEEPALIVE_S, self._tick)
            return
        if not message.get("more_body", False):
            self.stop()
        await self._send(message)

    def _tick(self) -> None:
        self._timer = None
        if not self._open:
            return
        now = self._loop.time()
        due = self._last + STREAM_KEEPALIVE_S
        if now + 1e-3 >= due:
            if self._pending is None:  # one still waiting means the client is not reading: no more
                self._pending = self._loop.create_task(self._keepalive())
            due = now + STREAM_KEEPALIVE_S
        self._timer = self._loop.call_at(due, self._tick)

    async def _keepalive(self) -> None:
        try:
            if self._open:
                self._last = self._loop.time()
                await self._send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
        except Exception:  # noqa: BLE001 - the client went away or the response ended: its own send reports it
            pass
        finally:
            self._pending = None

    def stop(self) -> None:
        self._open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def create_app(
    service: WorkerService,
    *,
    registry: CollectorRegistry,
    internal_token: str,
    startup: Callable[[], Coroutine[Any, Any, None]] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The worker's app. ``startup`` (model loading) runs as a background task from the
    lifespan, so /health answers while it runs and /ready turns 200 when it is done.
    ``internal_token``: the credential every ``/internal/*`` call must carry (``gate.py``)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(startup()) if startup is not None else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            await service.close()

    app = FastAPI(title="kvserving worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    app.add_middleware(WorkerGate, token=internal_token, max_body_bytes=max_body_bytes)

    @app.post("/internal/generate", response_model=None)
    async def generate(body: GenerateBody) -> Response:
        try:
            admitted = service.admit(body)
        except NotReadyError as exc:
            return error_response(503, str(exc), type_="unavailable")
        except DuplicateRequestError as exc:
            return error_response(409, str(exc), type_="conflict", code="duplicate_request_id")
        except ValueError as exc:  # ContextLengthError carries its code
            return error_response(400, str(exc), type_="invalid_request_error", code=getattr(exc, "code", None))
        return EventStream(service, admitted)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "state": service.state, "role": service.role, "engine_id": service.engine_id}

    @app.get("/ready", response_model=None)
    async def ready() -> Response:
        if not service.ready:
            return error_response(503, f"worker is {service.state}", type_="unavailable")
        return JSONResponse({"ready": True, "role": service.role, "engine_id": service.engine_id, **service.capacity()})

    @app.get("/metrics")
    async def metrics() -> Response:
        await service.refresh_metrics()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/kv/stats", response_model=None)
    async def kv_stats() -> Response:
        try:
            return JSONResponse(await service.kv_stats_body())
        except NotReadyError as exc:
            return error_response(503, str(exc), type_="unavailable")

    _add_kv_routes(app, service)
    return app


def _add_kv_routes(app: FastAPI, service: WorkerService) -> None:
    @app.get("/internal/kv/agent", response_model=None)
    async def kv_agent() -> Response:
        try:
            return JSONResponse(await service.agent())
        except NotReadyError as exc:
            return error_response(503, str(exc), type_="unavailable")

    @app.get("/internal/kv/leases", response_model=None)
    async def list_leases(conversation_key: str | None = None) -> Response:
        try:
            return JSONResponse({"leases": await service.leases(conversation_key=conversation_key)})
        except NotReadyError as exc:
            return error_response(503, str(exc), type_="unavailable")

    @app.post("/internal/kv/leases/{lease_id}/renew", response_model=None)
    async def renew(lease_id: str, body: RenewBody | None = None) -> Response:
        try:
            renewed = await service.renew(lease_id, ttl_s=None if body is None else body.ttl_s)
        except NotReadyError as exc:
            return error_response(503, str(exc), type_="unavailable")
        except LeaseNotFoundError as exc:
            return error_response(404, str(exc), type_="not_found", code="unknown_lease")
        return JSONResponse(renewed)

    @app.post("/internal/kv/leases/{lease_id}/hold", response_model=None)
    async def hold(lease_id: str, body: HoldBody) -> Response:
        try:
            held = await service.hold(lease_id, digest=body.digest, hold_s=float(body.hold_s), consume=body.consume)
        except NotReadyError as exc:
            return error_response(503, str(exc), type_="unavailable")
        except LeaseNotFoundError as exc:
            return error_response(404, str(exc), type_="not_found", code="unknown_lease")
        except LeaseMismatchError as exc:
            return error_response(409, str(exc), type_="conflict", code="lease_mismatch")
        return JSONResponse(held)

    @app.delete("/internal/kv/leases/{lease_id}", response_model=None)
    async def release(lease_id: str) -> Response:
        try:
            await service.release(lease_id)
        except NotReadyError as exc:
            return error_response(503, str(exc), type_="unavailable")
        except LeaseNotFoundError as exc:
            return error_response(404, str(exc), type_="not_found", code="unknown_lease")
        return JSONResponse({"lease_id": lease_id, "released": True})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        bad_json = any(e.get("type") == "json_invalid" for e in errors)
        return error_response(400 if bad_json else 422, validation_message(errors), type_="invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), type_="invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type_="internal_error")

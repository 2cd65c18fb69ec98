"""The gateway's HTTP routes (thin): everything it registers is listed here.

    POST /v1/chat/completions   Completions.chat          (auth)
    POST /v1/completions        Completions.text          (auth)
    GET  /v1/models             the served model          (auth)
    GET  /v1/models/{id}        it, or 404                (auth)
    GET  /health                alive
    GET  /ready                 200 once a worker can take a whole turn, else 503
    GET  /metrics               Prometheus text

Around every route: API keys (when configured, everything but /health,
/ready, /metrics needs ``Authorization: Bearer <key>``: 401), the body-size
limit (413), errors in OpenAI's shape, requests counted by route and status.
Lifespan: the worker pool's health loop and the lease heartbeat start with the
app and stop with it (a last sweep releases the leases idle past their TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserving.config import ServingConfig

from . import openai_types as oa
from .completions import Completions, EventStream, ModelInfo
from .errors import GatewayError, authentication, invalid_request, model_not_found, not_found, payload_too_large
from .identity import ConversationIndex
from .leases import LeaseKeeper, LeaseTable
from .metrics import GatewayMetrics
from .turn import Turns
from .workers import WorkerClient, WorkerPool

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
ROUTES = OPEN_PATHS | {"/v1/chat/completions", "/v1/completions", "/v1/models"}  # metric labels; the rest: "other"


@dataclass(slots=True)
class GatewayState:
    """What the routes reach: built by ``build_app``, started by its lifespan."""

    config: ServingConfig
    model: ModelInfo
    metrics: GatewayMetrics
    client: WorkerClient
    pool: WorkerPool
    keeper: LeaseKeeper
    completions: Completions


def build_state(config: ServingConfig, *, model: ModelInfo, registry: CollectorRegistry) -> GatewayState:
    gw = config.gateway
    metrics = GatewayMetrics(registry)
    client = WorkerClient(request_timeout_s=gw.request_timeout_s, connect_timeout_s=gw.connect_timeout_s)
    pool = WorkerPool(gw, client)
    table = LeaseTable(lease_ttl_s=config.reuse.lease_ttl_s, heartbeat_s=gw.lease_heartbeat_s, max_leases=gw.max_leases)
    keeper = LeaseKeeper(table, client, retention_ttl_s=config.reuse.retention_ttl_s, events=metrics, clock=time.time)
    turns = Turns(pool=pool, client=client, keeper=keeper, metrics=metrics,
                  max_inflight_per_worker=gw.max_inflight_per_worker, bidirectional=config.reuse.bidirectional)
    index = ConversationIndex(page_size=config.kv_cache.effective_page_size)
    completions = Completions(model=model, turns=turns, metrics=metrics, index=index)
    return GatewayState(config, model, metrics, client, pool, keeper, completions)


def build_app(state: GatewayState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.pool.refresh()
        state.pool.start()
        state.keeper.start()
        try:
            yield
        finally:
            await state.keeper.stop(final_sweep=True)
            await state.pool.stop()
            await state.client.aclose()

    app = FastAPI(title="kvserving gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = state
    _install_errors(app)
    app.add_middleware(_Guard, state=state)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        started = time.perf_counter()
        parsed = oa.parse_chat_request(await _json_body(request, state.config.gateway.max_body_bytes))
        result = await _unless_disconnected(request, state.completions.chat(parsed, headers=request.headers,
                                                                            started=started))
        return _respond(result)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        started = time.perf_counter()
        parsed = oa.parse_completion_request(await _json_body(request, state.config.gateway.max_body_bytes))
        result = await _unless_disconnected(request, state.completions.text(parsed, headers=request.headers,
                                                                            started=started))
        return _respond(result)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return oa.models_list(name=state.model.name, created=state.model.created, max_model_len=state.model.max_model_len)

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != state.model.name:
            raise model_not_found(model)
        entry: dict[str, Any] = oa.models_list(name=state.model.name, created=state.model.created,
                                               max_model_len=state.model.max_model_len)["data"][0]
        return entry

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        roles = {w.role for w in state.pool.workers.values() if w.healthy}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        return JSONResponse({"ready": ok, "healthy_roles": sorted(roles)}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        for role in ("prefill", "decode", "both"):
            state.metrics.workers_healthy.labels(role).set(sum(w.healthy for w in state.pool.by_role(role)))
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _respond(result: dict[str, Any] | EventStream) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return _EventStreamResponse(result)


class _EventStreamResponse(StreamingResponse):
    """Server-sent events: the first frame, then the rest as they come; a client that goes
    away cancels the sending, which closes the frames and with them the worker request.

    StreamingResponse does the same with an anyio task group under uvicorn's ASGI 2.3
    (~0.1 ms per response); this is one plain asyncio task and one wait."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream.rest, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send_all(send))
        watch = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait({sending, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            if not sending.done():
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sending
        if not sending.cancelled():
            sending.result()  # its error, if any

    async def _send_all(self, send: Send) -> None:
        async with contextlib.aclosing(self.stream.rest) as rest:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.stream.first, "more_body": True})
            async for frame in rest:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _json_body(request: Request, limit: int) -> Any:
    """The JSON body, refusing one over ``limit`` bytes (413) and invalid JSON (400)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise payload_too_large(f"Request body exceeds the limit of {limit} bytes.")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"We could not parse the JSON body of your request: {exc}.", code="invalid_json") from exc


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (closing any worker stream)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise GatewayError(499, "client disconnected", type="client_closed_request")  # never sent: nobody listens
    return task.result()


async def _disconnected(request: Request) -> None:
    await _disconnect(request.receive)


async def _disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Guard:
    """ASGI middleware: API keys, in-flight gauge, requests by route and status, duration to the last byte."""

    def __init__(self, app: ASGIApp, *, state: GatewayState) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in state.config.gateway.api_keys)
        self.metrics = state.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        if self.keys and path not in OPEN_PATHS and not _key_ok(_header(scope, b"authorization"), self.keys):
            self.metrics.requests.labels(route, "401").inc()
            response = JSONResponse(authentication().to_body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        counted = False

        async def send_status(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start":
                # counted before the client can see the response
                self.metrics.requests.labels(route, str(message["status"])).inc()
                counted = True
            await send(message)

        served = path not in OPEN_PATHS  # probes and scrapes are not requests in flight
        if served:
            self.metrics.in_flight.inc()
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_status)
        finally:
            if served:
                self.metrics.in_flight.dec()
            self.metrics.duration.labels(route).observe(time.perf_counter() - started)
            if not counted:  # the app failed before answering
                self.metrics.requests.labels(route, "500").inc()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _key_ok(header: str | None, keys: tuple[bytes, ...]) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer "):].strip().encode()
    return any(hmac.compare_digest(given, key) for key in keys)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = not_found(f"Unknown request URL: {request.method} {request.url.path}.", code="unknown_url")
        else:
            error = GatewayError(exc.status_code if 400 <= exc.status_code <= 599 else 500, str(exc.detail))
        return JSONResponse(error.to_body(), status_code=error.status, headers=dict(exc.headers or {}) or None)

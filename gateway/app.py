"""The gateway's HTTP routes (thin): everything it registers is listed here.

    POST /v1/chat/completions   Completions.chat          (auth)
    POST /v1/completions        Completions.text          (auth)
    GET  /v1/models             the served model          (auth)
    GET  /v1/models/{id}        it, or 404                (auth)
    GET  /health                alive
    GET  /ready                 200 once a worker can take a whole turn, else 503
    GET  /metrics               Prometheus text

One FastAPI app; around every route one ASGI middleware (``Requests``): API
keys (when configured, everything but /health, /ready, /metrics needs
``Authorization: Bearer <key>``: 401 with ``WWW-Authenticate``), requests
counted by route and status before the client sees the response, the
in-flight gauge, the duration to the last byte, a last-resort 500 in
OpenAI's shape, and one access-log line (``access_line``: route, status,
conversation, prompt / cached / computed tokens, TTFT, duration; no content,
no keys) on the ``kvserving.gateway.access`` logger, at INFO for API routes
and DEBUG for /health, /ready, /metrics. The completion routes read the body against
``gateway.max_body_bytes`` while it arrives (413), answer invalid JSON with a
400, other methods with a 405 (``Allow: POST``), and stream SSE through
Starlette's ``StreamingResponse``. A client that goes away before the response
starts cancels its request (counted as 499); after, the stream's disconnect
watch ends it; either way the worker stream closes, which aborts the request
upstream.
Lifespan: the worker pool's health loop and the lease heartbeat start with the
app and stop with it (a last sweep releases the leases idle past their TTL).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserving.config import ServingConfig

from . import openai_types as oa
from .completions import Completions, build_conversations
from .errors import GatewayError, authentication, model_not_found, not_found, payload_too_large, server_error
from .model import ModelInfo
from .relay import SSE_DONE, EventStream
from .leases import LeaseKeeper, LeaseTable
from .metrics import REQUEST, GatewayMetrics, PromptReuse, RequestRecord
from .tenants import Tenants
from .turn import Turns
from .workers import WorkerClient, WorkerPool

log = logging.getLogger(__name__)
# One line per request: API routes at INFO, probes and scrapes at DEBUG (``--log-level``).
access_log = logging.getLogger("kvserving.gateway.access")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
ROUTES = OPEN_PATHS | {"/v1/chat/completions", "/v1/completions", "/v1/models"}  # metric labels; the rest: "other"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


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
    token = config.security.read_internal_token()
    client = WorkerClient(
        request_timeout_s=gw.request_timeout_s,
        connect_timeout_s=gw.connect_timeout_s,
        first_byte_timeout_s=gw.first_byte_timeout_s,
        event_timeout_s=gw.event_timeout_s,
        token=token,
    )
    pool = WorkerPool(gw, client)
    conversations = build_conversations(config, model)  # one record per conversation: leases, held ids, kept prompts
    table = LeaseTable(conversations, lease_ttl_s=config.reuse.lease_ttl_s, heartbeat_s=gw.lease_heartbeat_s, max_leases=gw.max_leases)
    keeper = LeaseKeeper(table, client, retention_ttl_s=config.reuse.retention_ttl_s, events=metrics, clock=time.time)
    turns = Turns(
        pool=pool,
        client=client,
        keeper=keeper,
        metrics=metrics,
        max_inflight_per_worker=gw.max_inflight_per_worker,
        bidirectional=config.reuse.bidirectional,
    )
    # Tenant ids are keyed with the internal credential: every replica of a deployment computes the same.
    tenants = Tenants(keyed=bool(gw.api_keys), share=config.security.tenants_share_cache, secret=(token or "").encode())
    completions = Completions(
        model=model,
        turns=turns,
        metrics=metrics,
        conversations=conversations,
        tenants=tenants,
        page_size=config.kv_cache.effective_page_size,
    )
    registry.register(PromptReuse(model.tagger))
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

    # The gateway's telemetry is its own (Prometheus metrics, the access log): FastAPI's native
    # OpenTelemetry stays off rather than asking the OpenTelemetry API for providers on every request.
    telemetry: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="kvserving gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, telemetry=telemetry)
    app.state.gateway = state
    _install_errors(app)
    app.add_middleware(Requests, api_keys=state.config.gateway.api_keys, metrics=state.metrics)
    completions = state.completions
    max_body = state.config.gateway.max_body_bytes
    # Every check of the request (openai_types) before anything renders or tokenizes it.
    limits = oa.RequestLimits(max_model_len=state.model.max_model_len, max_token_chars=state.model.tokenizer.max_token_chars)

    async def chat_run(body: Any, headers: Mapping[str, str], started: float) -> dict[str, Any] | EventStream:
        return await completions.chat(oa.parse_chat_request(body, limits=limits), headers=headers, started=started)

    async def text_run(body: Any, headers: Mapping[str, str], started: float) -> dict[str, Any] | EventStream:
        return await completions.text(oa.parse_completion_request(body, limits=limits), headers=headers, started=started)

    async def chat(request: Request) -> Response:
        return await _complete(request, chat_run, max_body)

    async def text(request: Request) -> Response:
        return await _complete(request, text_run, max_body)

    # Starlette routes: the request as it is, without FastAPI's per-request dependency solving
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", text, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return oa.models_list(name=state.model.name, created=state.model.created, max_model_len=state.model.max_model_len)

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != state.model.name:
            raise model_not_found(model)
        entry: dict[str, Any] = oa.models_list(name=state.model.name, created=state.model.created, max_model_len=state.model.max_model_len)[
            "data"
        ][0]
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


Handler = Callable[[Any, Mapping[str, str], float], Awaitable[dict[str, Any] | EventStream]]


async def _complete(request: Request, handler: Handler, max_body: int) -> Response:
    """One completion request: the body (413 past ``max_body`` while it arrives, 400 if not JSON),
    the handler's answer as JSON or as an SSE stream. Until the response starts, a client that
    goes away cancels this task (``ClientDisconnect``: counted 499 by ``Requests``). A refusal is
    answered here, not raised through the framework: its traceback (which holds the request's
    body and parse) is gone with the response, never left to the cyclic collector."""
    started = time.perf_counter()
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.scope["headers"]}
    try:
        return await _answer(request, handler, headers, started, max_body)
    except GatewayError as exc:
        return JSONResponse(exc.to_body(), status_code=exc.status, headers=exc.headers or None)


async def _answer(request: Request, handler: Handler, headers: Mapping[str, str], started: float, max_body: int) -> Response:
    body = await _read_json(request, headers.get("content-length"), max_body)
    watch = _Disconnect(request.receive)
    try:
        result = await handler(body, headers, started)
    except asyncio.CancelledError:
        watch.stop()
        if not watch.gone:
            raise  # the server is shutting down
        watch.task.uncancel()  # the client went away: nobody listens, the worker stream is closed
        raise ClientDisconnect() from None
    except BaseException:
        watch.stop()
        raise
    if isinstance(result, dict):
        watch.stop()
        return JSONResponse(result)
    # the same watch goes on through the stream (one task per request, not one per phase)
    return _EventStreamResponse(_frames(result), watch, media_type="text/event-stream", headers=SSE_HEADERS)


class _Disconnect:
    """The watch for the client going away while its request is served: a task reading the
    request's ASGI messages that cancels the serving task at the first ``http.disconnect``
    (then ``gone``). One per completion request, from the body read to the last frame."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.gone = False
        self._receive = receive
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            # ``stop``: the watch ends here rather than with the error. A task that ends cancelled
            # keeps its CancelledError, whose traceback holds this frame, which holds the watch
            # and so the task: a reference cycle per request, left to the cyclic collector.
            return
        self.gone = True
        self.task.cancel()

    def stop(self) -> None:
        self._watcher.cancel()


class _EventStreamResponse(StreamingResponse):
    """``StreamingResponse`` whose client-gone watch is the request's (``_Disconnect``): it cancels
    the sending task, which closes the frames, and so the worker stream; Starlette's own runs the
    sending and a watch in a task group of two more tasks per response."""

    def __init__(self, content: AsyncGenerator[bytes, None], watch: _Disconnect, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self.watch
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with aclosing(self.body_iterator) as frames:  # type: ignore[type-var]
                async for frame in frames:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            watch.stop()  # before the last byte: the server then answers `receive` with a disconnect
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # the server is shutting down
            watch.task.uncancel()  # the client went away: nobody listens
        finally:
            watch.stop()


async def _read_json(request: Request, declared: str | None, max_body: int) -> Any:
    """The body as JSON, read against ``max_body`` while it arrives (413) and parsed (400 if not JSON)."""
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise payload_too_large(f"Request body of {declared} bytes exceeds the limit of {max_body} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise payload_too_large(f"Request body exceeds the limit of {max_body} bytes.")
        chunks.append(chunk)
    return oa.decode_json(chunks[0] if len(chunks) == 1 else b"".join(chunks))


async def _frames(stream: EventStream) -> AsyncGenerator[bytes, None]:
    """The frames of a streamed response up to and including the one that ends with [DONE];
    closing it early (a client gone) closes the worker stream."""
    async with aclosing(stream.rest) as rest:
        yield stream.first
        if stream.first.endswith(SSE_DONE):
            return
        async for frame in rest:
            yield frame
            if frame.endswith(SSE_DONE):
                return


class Requests:
    """The one ASGI middleware: API keys, requests by route and status (counted before the client
    sees the response), in-flight gauge, duration to the last byte, a last-resort 500."""

    def __init__(self, app: ASGIApp, *, api_keys: tuple[str, ...], metrics: GatewayMetrics) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in api_keys)
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        metrics = self.metrics
        if self.keys and path not in OPEN_PATHS and not api_key_ok(_header(scope, b"authorization"), self.keys):
            started = time.perf_counter()
            metrics.requests.labels(route, "401").inc()
            response = JSONResponse(authentication().to_body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            access_log.info("%s", access_line(scope["method"], path, 401, RequestRecord(), started, time.perf_counter()))
            return
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                metrics.requests.labels(route, str(status)).inc()  # before the client can see it
            await send(message)

        served = path not in OPEN_PATHS  # probes and scrapes are not requests in flight
        if served:
            metrics.in_flight.inc()
        record = RequestRecord()
        current = REQUEST.set(record)
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_status)
        except ClientDisconnect:
            if not status:
                status = 499
                metrics.requests.labels(route, "499").inc()
        except Exception:
            if status:
                raise  # mid-stream: uvicorn closes the connection
            log.exception("%s failed", path)
            error = server_error("The server had an error while processing your request.")
            await JSONResponse(error.to_body(), status_code=500)(scope, receive, send_status)
        finally:
            ended = time.perf_counter()
            REQUEST.reset(current)
            if served:
                metrics.in_flight.dec()
            metrics.duration.labels(route).observe(ended - started)
            level = logging.INFO if served else logging.DEBUG
            if access_log.isEnabledFor(level):
                access_log.log(level, "%s", access_line(scope["method"], path, status, record, started, ended))


def access_line(method: str, path: str, status: int, record: RequestRecord, started: float, ended: float) -> str:
    """``POST /v1/chat/completions 200 conv=1a2b3c4d5e6f prompt=812 cached=768 computed=44 ttft_ms=12.4 ms=80.2``:
    no content, no key; the conversation is the first 12 hex digits of the key workers see (itself a
    digest of the tenant and the client's id); "-" for what the request did not have."""
    if path not in ROUTES:  # a client's URL: escaped and cut, one line whatever it holds
        path = path.encode("unicode_escape").decode("ascii")[:200]
    conv = record.conversation.removeprefix("conv-")[:12] if record.conversation else "-"
    prompt, computed = record.prompt_tokens, record.computed_tokens
    cached = prompt - computed if prompt is not None and computed is not None else None
    ttft = f"{1e3 * (record.first_token_s - started):.1f}" if record.first_token_s is not None else "-"
    return (
        f"{method} {path} {status or '-'} conv={conv} prompt={_or_dash(prompt)} cached={_or_dash(cached)} "
        f"computed={_or_dash(computed)} ttft_ms={ttft} ms={1e3 * (ended - started):.1f}"
    )


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def api_key_ok(header: str | None, keys: tuple[bytes, ...]) -> bool:
    """`Authorization: Bearer <key>` with one of `keys` (compared in constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer ") :].strip().encode()
    return any(hmac.compare_digest(given, key) for key in keys)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


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

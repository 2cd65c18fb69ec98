"""The gateway's HTTP routes (thin): everything it registers is listed here.

    POST /v1/chat/completions   Completions.chat          (auth; served by front.py on plain ASGI)
    POST /v1/completions        Completions.text          (auth; served by front.py on plain ASGI)
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

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserving.config import ServingConfig

from . import openai_types as oa
from .completions import Completions, build_conversations
from .model import ModelInfo
from .errors import GatewayError, authentication, model_not_found, not_found, server_error
from .front import CompletionRoutes, api_key_ok
from .leases import LeaseKeeper, LeaseTable
from .metrics import GatewayMetrics, PromptReuse
from .tenants import Tenants
from .turn import Turns
from .workers import WorkerClient, WorkerPool

log = logging.getLogger(__name__)

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
    token = config.security.read_internal_token()
    client = WorkerClient(request_timeout_s=gw.request_timeout_s, connect_timeout_s=gw.connect_timeout_s,
                          first_byte_timeout_s=gw.first_byte_timeout_s, event_timeout_s=gw.event_timeout_s,
                          token=token)
    pool = WorkerPool(gw, client)
    conversations = build_conversations(config, model)  # one record per conversation: leases, held ids, kept prompts
    table = LeaseTable(conversations, lease_ttl_s=config.reuse.lease_ttl_s, heartbeat_s=gw.lease_heartbeat_s,
                       max_leases=gw.max_leases)
    keeper = LeaseKeeper(table, client, retention_ttl_s=config.reuse.retention_ttl_s, events=metrics, clock=time.time)
    turns = Turns(pool=pool, client=client, keeper=keeper, metrics=metrics,
                  max_inflight_per_worker=gw.max_inflight_per_worker, bidirectional=config.reuse.bidirectional)
    # Tenant ids are keyed with the internal credential: every replica of a deployment computes the same.
    tenants = Tenants(keyed=bool(gw.api_keys), share=config.security.tenants_share_cache,
                      secret=(token or "").encode())
    completions = Completions(model=model, turns=turns, metrics=metrics, conversations=conversations, tenants=tenants,
                              page_size=config.kv_cache.effective_page_size)
    registry.register(PromptReuse(model.tagger))
    return GatewayState(config, model, metrics, client, pool, keeper, completions)


def build_app(state: GatewayState) -> CompletionRoutes:
    """The ASGI app to serve: the completion routes (front.py) in front of the FastAPI app of the rest."""
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

    limits = oa.RequestLimits(max_model_len=state.model.max_model_len, max_token_chars=state.model.tokenizer.max_token_chars)
    return CompletionRoutes(app, completions=state.completions, metrics=state.metrics, api_keys=state.config.gateway.api_keys,
                            max_body_bytes=state.config.gateway.max_body_bytes, limits=limits)


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
        if self.keys and path not in OPEN_PATHS and not api_key_ok(_header(scope, b"authorization"), self.keys):
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


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(Exception)
    async def server_fault(_: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc)
        return JSONResponse(server_error("The server had an error while processing your request.").to_body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = not_found(f"Unknown request URL: {request.method} {request.url.path}.", code="unknown_url")
        else:
            error = GatewayError(exc.status_code if 400 <= exc.status_code <= 599 else 500, str(exc.detail))
        return JSONResponse(error.to_body(), status_code=error.status, headers=dict(exc.headers or {}) or None)

"""The completion routes on plain ASGI: what uvicorn calls for every request.

    POST /v1/chat/completions   Completions.chat   (auth)
    POST /v1/completions        Completions.text   (auth)
    anything else               the FastAPI app of app.py

The two routes carry nearly every request and every streamed frame, so they
skip the framework: one body read, one JSON parse, responses written straight
to uvicorn's ``send`` (starlette's middleware stack wrapped each streamed frame
in four more ``send`` layers), and one task per request besides uvicorn's own:
the watch for the client going away, which cancels the request's task (that
closes the worker stream: an abort upstream). The old path ran five tasks per
streamed request (docs/performance-log/gateway.md). What the routes answer is unchanged:
the same status codes, OpenAI error bodies and headers (401 with
``WWW-Authenticate``, 413, 400 for invalid JSON, 405 with ``Allow``, 503 with
``Retry-After``), the same metrics (requests by route and code, counted before
the client sees the response; in flight; duration to the last byte).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from . import openai_types as oa
from .completions import SSE_DONE, Completions, EventStream
from .errors import GatewayError, authentication, payload_too_large, server_error
from .metrics import GatewayMetrics

log = logging.getLogger(__name__)


class _ClientGone(Exception):
    """The client disconnected before its body was read."""

# status line and headers of a streamed reply (what starlette's StreamingResponse sent)
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_TYPE = (b"content-type", b"application/json")

# starlette's JSONResponse encoding (json.dumps with these arguments), one encoder for all
_ENCODE = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode

Handler = Callable[[Any, Mapping[str, str], float], Awaitable[dict[str, Any] | EventStream]]


class CompletionRoutes:
    """ASGI app: the two completion routes served here, every other request by ``fallback``."""

    def __init__(self, fallback: ASGIApp, *, completions: Completions, metrics: GatewayMetrics,
                 api_keys: tuple[str, ...], max_body_bytes: int, limits: oa.RequestLimits | None = None) -> None:
        self.fallback = fallback
        self.metrics = metrics
        self.keys = tuple(k.encode() for k in api_keys)
        self.max_body_bytes = max_body_bytes

        # Every check of the request (openai_types) before anything renders or tokenizes it.
        async def chat(body: Any, headers: Mapping[str, str], started: float) -> dict[str, Any] | EventStream:
            return await completions.chat(oa.parse_chat_request(body, limits=limits), headers=headers, started=started)

        async def text(body: Any, headers: Mapping[str, str], started: float) -> dict[str, Any] | EventStream:
            return await completions.text(oa.parse_completion_request(body, limits=limits), headers=headers,
                                          started=started)

        self.routes: dict[str, Handler] = {"/v1/chat/completions": chat, "/v1/completions": text}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            await self.fallback(scope, receive, send)
            return
        await _Exchange(self, scope["path"], receive, send).serve(handler, scope)


class _Exchange:
    """One request on a completion route: its response and its metrics."""

    __slots__ = ("routes", "route", "receive", "send", "status", "gone", "_task", "_watch")

    def __init__(self, routes: CompletionRoutes, route: str, receive: Receive, send: Send) -> None:
        self.routes, self.route, self.receive, self.send = routes, route, receive, send
        self.status: int | None = None  # once the response started
        self.gone = False  # the client disconnected
        self._task: asyncio.Task[Any] | None = None
        self._watch: asyncio.Task[None] | None = None

    async def serve(self, handler: Handler, scope: Scope) -> None:
        metrics = self.routes.metrics
        metrics.in_flight.inc()
        started = time.perf_counter()
        try:
            await self._serve(handler, scope, started)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.gone or task is None:
                raise  # the server is shutting down
            task.uncancel()  # the client went away: nobody listens, the worker stream is closed
            if self.status is None:
                self._count(499)
        except _ClientGone:
            self._count(499)
        except Exception:
            if self.status is not None:
                raise  # mid-stream: uvicorn closes the connection
            log.exception("%s failed", self.route)
            await self._error(server_error("The server had an error while processing your request."))
        finally:
            self._stop_watching()
            metrics.in_flight.dec()
            metrics.duration.labels(self.route).observe(time.perf_counter() - started)

    async def _serve(self, handler: Handler, scope: Scope, started: float) -> None:
        routes = self.routes
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if routes.keys and not api_key_ok(headers.get("authorization"), routes.keys):
            await self._error(authentication(), {"WWW-Authenticate": "Bearer"})
            return
        if scope["method"] != "POST":
            await self._error(GatewayError(405, "Method Not Allowed"), {"Allow": "POST"})
            return
        try:
            body = await self._body(headers.get("content-length"))
            self._watch_disconnect()
            result = await handler(body, headers, started)
        except GatewayError as exc:
            await self._error(exc)
            return
        if isinstance(result, dict):
            await self._json(200, result)
            return
        send = self.send
        async with aclosing(result.rest) as rest:
            await self._start(200, SSE_HEADERS)
            frame, last = result.first, result.first.endswith(SSE_DONE)
            if not last:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                async for frame in rest:
                    last = frame.endswith(SSE_DONE)
                    if last:
                        break
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
        self._stop_watching()  # before the last byte: uvicorn then answers `receive` with a disconnect
        await send({"type": "http.response.body", "body": frame if last else b"", "more_body": False})

    async def _body(self, declared: str | None) -> Any:
        """The JSON body, refusing one over the limit (413) and invalid JSON (400)."""
        limit = self.routes.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise payload_too_large(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
        message = await self.receive()
        body = message.get("body", b"")
        if message.get("more_body", False):
            chunks = bytearray(body)
            while message.get("more_body", False):
                message = await self.receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunks += message.get("body", b"")
                if len(chunks) > limit:
                    raise payload_too_large(f"Request body exceeds the limit of {limit} bytes.")
            body = bytes(chunks)
        elif len(body) > limit:
            raise payload_too_large(f"Request body exceeds the limit of {limit} bytes.")
        return oa.decode_json(body)

    # ------------------------------------------------------------ disconnects
    def _watch_disconnect(self) -> None:
        """From here on a client that goes away cancels this request's task (the body has been read)."""
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._wait_disconnect())

    async def _wait_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if self._task is not None:  # still serving
            self.gone = True
            self._task.cancel()

    def _stop_watching(self) -> None:
        self._task = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -------------------------------------------------------------- responses
    def _count(self, status: int) -> None:
        self.routes.metrics.requests.labels(self.route, str(status)).inc()

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._count(status)  # counted before the client can see the response
        self.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def _json(self, status: int, content: Any, extra: Mapping[str, str] | None = None) -> None:
        # starlette's JSONResponse, byte for byte
        body = _ENCODE(content).encode()
        headers = [(b"content-length", str(len(body)).encode()), JSON_TYPE]
        if extra:
            headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
        await self._start(status, headers)
        self._stop_watching()
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _error(self, error: GatewayError, extra: Mapping[str, str] | None = None) -> None:
        await self._json(error.status, error.to_body(), {**error.headers, **(extra or {})})


def api_key_ok(header: str | None, keys: tuple[bytes, ...]) -> bool:
    """`Authorization: Bearer <key>` with one of `keys` (compared in constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer "):].strip().encode()
    return any(hmac.compare_digest(given, key) for key in keys)

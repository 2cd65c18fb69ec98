"""The worker's gate, in front of every route: the deployment's internal
credential on ``/internal/*`` and the request-body limit (DESIGN.md, Security;
docs/worker-api.md). Plain ASGI, so it holds for every route, known or not.

- ``/internal/*`` needs ``Authorization: Bearer <token>``, compared in constant
  time (``hmac.compare_digest``); anything else gets a 401 whose body is always
  the same (it never says what was wrong). ``/health``, ``/ready`` and
  ``/metrics`` stay open.
- A body is counted while it is read, chunked or not: once it passes
  ``max_body_bytes`` the request gets a 413 and the rest of the body is never
  kept (the connection closes). A ``Content-Length`` over the limit is refused
  before any byte of the body is read.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserving.worker.api_bodies import error_body

INTERNAL_PREFIX = "/internal"
UNAUTHORIZED_BODY = json.dumps(
    error_body("missing or invalid internal credential", type_="authentication_error", code="unauthorized"),
    separators=(",", ":"),
).encode()


async def _send_json(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class WorkerGate:
    """ASGI middleware: the credential check on ``/internal/*``, then the body limit."""

    def __init__(self, app: ASGIApp, *, token: str, max_body_bytes: int) -> None:
        if not token:
            raise ValueError("the internal token must not be empty")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self._token = token.encode()
        self.max_body_bytes = max_body_bytes

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credential = bytes(value).partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self._token)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if (path == INTERNAL_PREFIX or path.startswith(INTERNAL_PREFIX + "/")) and not self.authorized(scope):
            await _send_json(send, 401, UNAUTHORIZED_BODY, [(b"www-authenticate", b"Bearer")])
            return
        length = next((bytes(v) for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._too_large(send)
            return
        # Read the body here, counting: the app gets it whole once it is known to fit.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body ended
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        # handed over once, then forgotten here (a stream keeps ``replay`` for its whole life)
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        del chunks

        async def replay() -> Message:
            if pending:
                return pending.pop()
            return await receive()  # after the body: the disconnect a streaming response waits for

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        message = error_body(f"request body over {self.max_body_bytes} bytes", type_="invalid_request_error")
        body = json.dumps(message, separators=(",", ":")).encode()
        await _send_json(send, 413, body, [(b"connection", b"close")])

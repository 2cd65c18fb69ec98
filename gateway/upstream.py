"""A lean HTTP/1.1 client for the one hot call to workers: ``POST /internal/generate``.

Every turn makes one such request and reads its server-sent events; aiohttp
spent ~0.3 ms of gateway CPU on each (URL and header objects, cookie jar,
tracing hooks, a task per timer; docs/performance-log/gateway.md). Here a request is
one pre-built head plus the JSON body in one write on a kept-alive
connection, and the response is parsed by ``httptools`` (the C parser
uvicorn uses) straight into a byte buffer the caller drains.

    conn = await pool.open(url)                  # idle kept-alive connection, else a new one
    status = await conn.request(path, body)      # -> HTTP status, once the headers are in
    chunk = await conn.read()                    # body bytes as they arrive (dechunked); b"" at its end
    pool.release(conn)                           # back to the pool if reusable, else closed
    conn.close()                                 # abort: the worker sees the disconnect

Rules: a connection is reused only after its previous response ended (a reply
that stopped reading at ``[DONE]`` is parked and joins the idle ones once its
last chunk arrives), only while it is younger than ``keepalive_s``
idle (below uvicorn's 5 s, so the worker never closes one under a request),
and only if both sides said keep-alive. A reused connection that the worker
closed before answering (reset, restart) is reported as ``Reset`` so the
caller can retry once on a fresh one.

Deadlines (one timer per request, moved rather than re-armed per chunk): the
whole request, from connecting to the end of the body, ends by ``deadline``;
its response headers must come within ``first_byte_s`` of sending it
(``FirstByteTimeout``), and once they have, no gap between two received
chunks may pass ``idle_s`` (``EventTimeout``: workers send keep-alive comments
while they compute, so a silent one is frozen). ``pool.abort_all()`` fails
every request in flight with ``Closing`` at once (the gateway's drain).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from urllib.parse import urlsplit

import httptools


class Reset(ConnectionError):
    """A reused connection closed before any response byte: the worker never saw the request."""


class ConnectFailed(ConnectionError):
    """The worker could not be reached."""


class FirstByteTimeout(TimeoutError):
    """The worker accepted the request but sent no response headers in time."""


class EventTimeout(TimeoutError):
    """The worker's response went silent for longer than the gap allowed between events."""


class Closing(Exception):
    """The gateway is shutting down: the request was ended by ``ConnectionPool.abort_all``."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, the response buffered as it arrives."""

    def __init__(self, host: str, key: str, pool: ConnectionPool) -> None:
        self.key = key  # the pool's key: scheme://host:port
        self.pool = pool
        self.parked = False  # released before its response ended: idle once it has
        self.host = host.encode("latin-1")
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.idle_since = 0.0
        self.status = 0
        self.keep_alive = False
        self.complete = True  # the previous response ended (a new connection has none)
        self.got_bytes = False
        self.error: BaseException | None = None
        self._body: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadline = 0.0  # loop time: the request's end
        self._first_by = 0.0  # loop time: its response headers
        self._idle_s: float | None = None  # longest gap between chunks once the headers are in
        self._last = 0.0  # loop time of the last chunk received

    # ------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no asyncio.Transport subclass)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._loop is not None:
            self._last = self._loop.time()  # any byte is a sign of life: keep-alive comments too
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.parked:
            self.parked = False
            self.pool._parked.discard(self)
        if not self.complete:
            if self.reused and not self.got_bytes:
                self._fail(Reset("connection closed before the response"))
            else:
                self._fail(ConnectionError(f"connection closed mid-response{f': {exc}' if exc else ''}"))

    # ---------------------------------------------------- parser callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self._timer is not None and self._idle_s is not None and self._loop is not None:
            # from here on the timer watches the gaps between chunks
            self._timer.cancel()
            self._timer = self._loop.call_at(min(self._deadline, self._last + self._idle_s), self._check_time)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()
        if self.parked:
            self.parked = False
            self.pool._idle_now(self)

    # ------------------------------------------------------------- client
    async def request(self, path: str, body: bytes, *, deadline: float, first_byte_s: float | None = None,
                      idle_s: float | None = None) -> int:
        """Send ``POST path`` with a JSON body; the response status once its headers arrived."""
        if self.transport is None:
            raise Reset("connection closed while idle") if self.reused else ConnectionError("not connected")
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.complete, self.got_bytes, self.error, self._body = 0, False, False, None, []
        loop = self._loop = asyncio.get_running_loop()
        now = self._last = loop.time()
        self._deadline, self._idle_s = deadline, idle_s
        self._first_by = min(deadline, now + first_byte_s) if first_byte_s is not None else deadline
        self._timer = loop.call_at(self._first_by, self._check_time)
        self.pool._busy.add(self)
        self.transport.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                             b"%scontent-length: %d\r\n\r\n%s" % (path.encode("latin-1"), self.host, self.pool.auth, len(body), body))
        while not self.status:
            await self._wait()
        return self.status

    async def read(self) -> bytes:
        """The body bytes received since the last call (waiting for some); b"" once the body ended."""
        while not self._body:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            await self._wait()
        out = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        return out

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _check_time(self) -> None:
        """The request's timer: fail it if a deadline passed, else move the timer to the next one."""
        assert self._loop is not None
        self._timer = None
        if self.complete:
            return  # the response is all in: nothing left to wait for
        now = self._loop.time() + 1e-3  # a timer may fire a little early
        if now >= self._deadline:
            error: TimeoutError = TimeoutError()
        elif not self.status:
            if now < self._first_by:
                self._timer = self._loop.call_at(self._first_by, self._check_time)
                return
            error = FirstByteTimeout()
        else:
            due = self._last + self._idle_s if self._idle_s is not None else self._deadline
            if now < due:
                self._timer = self._loop.call_at(min(self._deadline, due), self._check_time)
                return
            error = EventTimeout()
        self._fail(error)
        self.close()

    def abort(self, error: BaseException) -> None:
        """End the request in flight with ``error`` (the worker sees the connection close)."""
        self._fail(error)
        self.close()

    def reusable(self) -> bool:
        return self.transport is not None and self.complete and self.keep_alive and self.error is None

    def close(self) -> None:
        self.complete = True  # no response to wait for any more: a close is not a failure of one
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def done(self) -> None:
        """The request is over (read to its end, or left at ``[DONE]``): stop its timer."""
        self.pool._busy.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ConnectionPool:
    """Kept-alive connections per worker, most recently used first."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float = 4.0, max_idle_per_host: int = 1024,
                 token: str | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        # the workers' internal credential, sent with every request (their /internal/* routes need it)
        self.auth = b"authorization: Bearer %s\r\n" % token.encode("latin-1") if token else b""
        self.keepalive_s = keepalive_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: defaultdict[str, list[_Connection]] = defaultdict(list)
        self._where: dict[str, tuple[str, str, int, str]] = {}  # url -> (key, host, port, Host header)
        self._parked: set[_Connection] = set()  # released before their response ended
        self._busy: set[_Connection] = set()  # a request in flight
        self._closing = False  # set by abort_all: no new request

    async def open(self, url: str, *, fresh: bool = False) -> _Connection:
        """An idle kept-alive connection to ``url``'s worker (unless ``fresh``), else a new one."""
        if self._closing:
            raise Closing("the gateway is shutting down")
        key, host, port, host_header = self._parse(url)
        if not fresh:
            idle = self._idle.get(key)
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.reusable() and now - conn.idle_since < self.keepalive_s:
                    conn.reused = True
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(host_header, key, self), host, port), self.connect_timeout_s)
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        return conn

    def release(self, conn: _Connection) -> None:
        """Back to the pool, or closed: one whose response has not ended yet is parked and
        joins the idle ones when it has (its last chunk usually follows ``[DONE]`` at once;
        closing it instead, a closed loop of requests opened a connection per request, and
        the worker's accept queue overflowed: connects timed out, health polls failed)."""
        conn.done()
        if conn.transport is None or conn.error is not None or not conn.keep_alive:
            conn.close()
            return
        if not conn.complete:
            conn.parked = True
            self._parked.add(conn)
            return
        self._idle_now(conn)

    def _idle_now(self, conn: _Connection) -> None:
        self._parked.discard(conn)
        idle = self._idle[conn.key]
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def abort_all(self) -> None:
        """Fail every request in flight with ``Closing`` now, and every later one at ``open``."""
        self._closing = True
        for conn in list(self._busy):
            conn.abort(Closing("the gateway is shutting down"))

    def close(self) -> None:
        for idle in [*self._idle.values(), list(self._parked)]:
            for conn in idle:
                conn.close()
        self._idle.clear()
        self._parked.clear()

    def _parse(self, url: str) -> tuple[str, str, int, str]:
        where = self._where.get(url)
        if where is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"worker URL must be http://host[:port], got {url!r}")
            port = parts.port or 80
            where = (f"http://{parts.netloc}", parts.hostname, port, parts.netloc)
            self._where[url] = where
        return where

"""The one module that talks to workers (docs/worker-api.md): the HTTP client,
server-sent-event parsing, worker discovery and health polling.

Calls it makes:

    POST   /internal/generate                         WorkerClient.generate (SSE stream)
    GET    /internal/kv/leases?conversation_key=K     WorkerClient.find_leases
    POST   /internal/kv/leases/{id}/renew             WorkerClient.renew_lease
    DELETE /internal/kv/leases/{id}                   WorkerClient.release_lease
    GET    /ready                                     WorkerPool health polling

Every generate is bounded (aiohttp's timeouts): connect, response headers within
``gateway.first_byte_timeout_s``, no gap between events longer than
``gateway.event_timeout_s`` (workers send keep-alive comments), and the whole
request within ``request_timeout_s``; the rare lease and health calls end within
twice the connect timeout.

A worker sends a generate's headers when it admits the request (its KV pull
runs behind them, with keep-alive comments), so late headers are a worker whose
event loop is stalled or frozen. While they are late the client probes the
worker's ``/health`` every ``PROBE_AFTER_S``; one that does not answer within
``PROBE_TIMEOUT_S`` is frozen. With another worker to turn to
(``generate(probe=True)``) a frozen worker's generate ends ``unresponsive``
and a live one's headers are awaited up to ``first_byte_timeout_s``; a lone
worker is waited for while it answers (each answer restarts the first-byte
deadline: it measures liveness, not load) and runs the deadline out once it
stops answering. Once the headers are in, the stream carries an event or a
keep-alive at least every ``STREAM_KEEPALIVE_S``; with another worker to turn
to, a stream silent for ``EVENTS_LATE_S`` (a keep-alive is late) gets the same
probe, and an unanswered one ends it ``unresponsive`` too: a worker frozen
after its headers (before its first token, or mid-reply) is found within
``EVENTS_LATE_S + PROBE_TIMEOUT_S`` (2.25 s), not ``event_timeout_s``; a lone
worker's stream is bounded by ``event_timeout_s`` alone. With every worker of a
role out of the rotation, a turn goes to the one whose ``/ready`` answered 200
last (``WorkerPool.fallback``): a 503 only when none is reachable. The probe
never cancels the request's task: it sets the error on the request's connection
(on its body once the headers are in), which the request's own task raises
where it waits, so it cannot collide with a deadline or an abort.

The holder check (``WorkerClient.frozen``, started by turn.py when a turn is
routed, beside its prefill): the lease holder's ``/health`` is asked, and a
live peer's of its part too once the holder's answer is ``WITNESS_AFTER_S``
late; the holder is frozen when the peer answered after ``p`` seconds and the
holder had not after ``max(FROZEN_FLOOR_S, FROZEN_RATIO * p)`` from then; gone
when its connection is refused; alive when it answered, or when bytes of any
of its streams reached this gateway since it was asked (a worker busy with
streams of this gateway is told alive by them). The
deadline is relative to what this gateway and machine show right now: a
stalled gateway event loop or a loaded machine makes the peer late too, and
the holder is given ``FROZEN_RATIO`` times as long; the floor is set above how
late a worker whose engine is saturated answers ``/health`` (its event loop
answers while the engine steps on another thread). No verdict (neither
answered within ``PROBE_TIMEOUT_S``) leaves the turn to the probe above. A
frozen holder is found 0.11 s after the turn was routed, not 1.25 s after its
decode was sent, and its turn recomputes on the peer within twice its
fault-free time.

Discovery: a static list of URLs (local mode) or the headless Services
``gateway.prefill_service`` / ``decode_service`` resolved by DNS every
``dns_refresh_s`` (cluster mode: one address per ready pod). A URL listed both
as prefill and as decode is a ``both`` worker; decode workers with no prefill
worker configured at all also take whole turns (``both``). A worker leaves the
rotation when ``/ready`` answers anything but 200 or its connection is
refused (it says it cannot serve), and on silence — ``READY_MISSES`` polls in a
row without an answer in time, or a request it left unanswered past a deadline —
only while another healthy worker can do its part: one slow poll (e.g. while the
gateway's event loop tokenizes a long prompt) says nothing about the worker, and
the last worker of a role that is slow is busy more often than frozen (a
saturated GPU worker misses deadlines); taken out, every turn would be a 503
until it answered again, while kept, its turns are bounded by the deadlines. It
comes back when ``/ready`` answers 200 again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import json.scanner
import logging
import socket
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvserving.config import STREAM_KEEPALIVE_S, WORKER_CLIENT_IDLE_S, GatewayConfig

from .metrics import REQUEST, RequestRecord
from .router import WorkerView

log = logging.getLogger(__name__)

GENERATE_PATH = "/internal/generate"
# Unanswered /ready polls in a row that take a worker out of the rotation (an answer other
# than 200, or a refused connection, takes it out at once).
READY_MISSES = 2
# the roles that can do a worker's part of a turn (the silent-worker rule)
SAME_PART = {"prefill": ("prefill", "both"), "decode": ("decode", "both"), "both": ("both",)}
# While a generate's response headers are late: /health probed this often, and a probe
# unanswered this long ends the generate as ``unresponsive`` (a live worker's event loop
# answers it while it pulls or queues: it sends a keep-alive every STREAM_KEEPALIVE_S too).
PROBE_AFTER_S = 0.25
PROBE_TIMEOUT_S = 1.0
# The holder check (``WorkerClient.frozen``): a worker is frozen when a peer answered /health
# after p seconds and it had not after max(FROZEN_FLOOR_S, FROZEN_RATIO * p). A worker answers
# /health on its event loop while its engine steps on another thread: with its engine saturated
# (the fault matrix's busy_lone_decode row, 8 long requests on one CPU decode worker of a 2-core
# machine) 0.8-1.2 ms at the median, 10-17 ms at p99, 11-61 ms at most over 180 calls (two runs),
# as timed by a client that itself reads the load's streams (``busy_worker_health_ms``), against
# 1-11 ms idle; the floor stays under the 0.17-0.3 s of a CPU turn, so that a frozen holder costs less
# than the turn itself. The ratio covers a gateway or machine that answers everything late.
FROZEN_FLOOR_S = 0.1
FROZEN_RATIO = 4.0
HEARD_POLL_S = 0.01  # while its /health answer is late, how often the holder check looks for its streams' bytes
# The peer is asked only once the holder's answer is this late (about the median of a busy
# worker's, ten times an idle one's): most checks cost one call, not two.
WITNESS_AFTER_S = 0.01
# Silence of a started stream after which its keep-alive is late and, with another worker to
# turn to, /health is probed (a live worker sends one every STREAM_KEEPALIVE_S).
EVENTS_LATE_S = STREAM_KEEPALIVE_S + PROBE_AFTER_S
_JSON = {"Content-Type": "application/json"}
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps(.., separators=..) without an encoder per call


@dataclass(frozen=True, slots=True)
class RawJson:
    """A body value already encoded as JSON text (``generate`` splices it in as is)."""

    text: str


def runs_json(runs: Sequence[tuple[int, int]]) -> str:
    """``json.dumps(expand_runs(runs))`` (compact) from (end, value) runs of small ints without a step
    per element: a prompt's tags are a few hundred runs over tens of thousands of tokens,
    and encoding them one int at a time was ~1.5 ms of a 33K-token turn's critical path."""
    parts: list[str] = []
    lo = 0
    for end, value in runs:
        if end > lo:
            parts.append(f"{int(value)}," * (end - lo))
            lo = end
    return "[" + "".join(parts)[:-1] + "]"


def encode_body(body: dict[str, Any]) -> bytes:
    """The JSON of ``body``; ``RawJson`` values are spliced in as they are."""
    raw = {k: v for k, v in body.items() if isinstance(v, RawJson)}
    if not raw:
        return _ENCODE(body).encode()
    head = _ENCODE({k: v for k, v in body.items() if k not in raw})
    fields = [f"{_ENCODE(k)}:{v.text}" for k, v in raw.items()]
    return (head[:-1] + ("," if len(head) > 2 else "") + ",".join(fields) + "}").encode()


class UpstreamError(Exception):
    """A worker call failed; ``kind`` is the metric label, ``status`` the worker's HTTP status if any.

    Kinds: ``connect`` (unreachable), ``first_byte_timeout`` (no response headers in time),
    ``event_timeout`` (its stream went silent: frozen), ``timeout`` (``request_timeout_s``),
    ``unresponsive`` (headers late and ``/health`` unanswered: frozen), ``status`` (an error
    status), ``stream`` (broken or malformed), ``worker_error`` (an error event), ``draining``
    (this gateway is shutting down)."""

    def __init__(self, kind: str, message: str, *, url: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.url = url
        self.status = status
        self.message = message
        self.code = code  # the worker's error code, if it sent one (context_length_exceeded)


@dataclass(slots=True)
class WorkerState:
    """What the gateway knows about one worker."""

    url: str
    role: str  # "prefill" | "decode" | "both"
    healthy: bool = False
    inflight: int = 0
    misses: int = 0  # /ready polls in a row without an answer in time
    answered_at: float | None = None  # monotonic time of its last 200 from /ready
    refused: bool = False  # it said it cannot serve since (refused connection, not ready, draining)
    # (max_model_len, kv_capacity_tokens) from its /ready answer; None until it told
    capacity: tuple[int, int] | None = None

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether the worker admits the request (its own check: worker/engine.py add_request);
        a worker that has not told its capacity is assumed to."""
        if self.capacity is None:
            return True
        max_model_len, kv_tokens = self.capacity
        return prompt_tokens < max_model_len and min(prompt_tokens + max_tokens, max_model_len) <= kv_tokens

    def polled(self, ready: bool | None, body: dict[str, Any] | None = None) -> None:
        """One /ready poll's outcome: True (200), False (another answer, or refused), None (no
        answer in time); ``body``: a 200's JSON (the worker's capacity)."""
        if body is not None:
            try:
                self.capacity = (int(body["max_model_len"]), int(body["kv_capacity_tokens"]))
            except (KeyError, TypeError, ValueError):
                pass
        if ready is None:
            self.misses += 1
            if self.misses >= READY_MISSES:
                self.healthy = False
            return
        self.misses = 0
        self.healthy = ready
        self.refused = not ready
        if ready:
            self.answered_at = time.monotonic()

    def view(self) -> WorkerView:
        return WorkerView(self.url, self.healthy, self.inflight)


class _Closing(Exception):
    """The gateway is shutting down: the request was ended by ``WorkerClient.abort_streams``."""


class _Unresponsive(Exception):
    """The worker's headers are late and it does not answer ``/health``: set on the request's connection."""


class _Stream:
    """A generate in flight: its task (until the response headers are in), its connection
    (once the connector gave it one) and its response."""

    __slots__ = ("task", "response", "aborted", "connection", "unresponsive", "watch", "last", "timer")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.response: aiohttp.ClientResponse | None = None
        self.aborted = False
        self.connection: aiohttp.connector.Connection | None = None
        self.unresponsive = False
        self.watch: asyncio.Task[None] | None = None  # the /health prober, while the headers or events are late
        self.last = 0.0  # loop time the last bytes of its body came (once the headers are in)
        self.timer: asyncio.TimerHandle | None = None  # when its events are next due (``WorkerClient._events_due``)

    def stop_watching(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None

    def abort(self) -> None:
        self.aborted = True
        if self.response is not None:
            self.response.content.set_exception(_Closing())
        elif self.task is not None:
            self.task.cancel()  # it waits for the response headers (``WorkerClient._post``)


# The generate whose connection the connector is handing out (set around ``session.post`` in
# the request's own task, whose context the connector's ``connect`` runs in).
_CONNECTING: contextvars.ContextVar[_Stream | None] = contextvars.ContextVar("kvserving_connecting", default=None)


class _Connector(aiohttp.TCPConnector):
    """A TCP connector that tells a generate which connection carries it (the prober ends a
    frozen worker's request on it)."""

    async def connect(self, req: aiohttp.ClientRequest, traces: list[Any], timeout: aiohttp.ClientTimeout) -> aiohttp.connector.Connection:
        connection = await super().connect(req, traces, timeout)
        stream = _CONNECTING.get()
        if stream is not None:
            stream.connection = connection
        return connection


class WorkerClient:
    """HTTP calls to workers over one pooled ``aiohttp.ClientSession`` (created on first use).

    aiohttp rather than httpx: its C HTTP parser and connection pool cost a fraction of
    httpcore's per request under hundreds of concurrent streams (httpcore's pool scanned
    every connection per request: docs/performance-log/gateway.md).

    A generate's deadlines come from the library: ``sock_connect`` (connect), ``sock_read``
    (no response headers within ``first_byte_timeout_s``; once they are in, no gap between
    received bytes longer than ``event_timeout_s``: workers send keep-alive comments while
    they compute, so a silent one is frozen) and ``total`` (``request_timeout_s``).
    """

    def __init__(
        self,
        *,
        request_timeout_s: float,
        connect_timeout_s: float,
        max_connections: int = 4096,
        first_byte_timeout_s: float | None = None,
        event_timeout_s: float | None = None,
        token: str | None = None,
    ) -> None:
        # every call carries the workers' internal credential (``security.internal_token_file``)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._request_timeout_s = request_timeout_s
        # generate's deadlines besides the whole request's (None: only that one)
        self._first_byte_s = first_byte_timeout_s
        self._event_s = event_timeout_s
        self._generate_timeout = aiohttp.ClientTimeout(
            total=request_timeout_s, sock_connect=connect_timeout_s, sock_read=first_byte_timeout_s
        )
        self._short = aiohttp.ClientTimeout(total=max(connect_timeout_s, 1.0) * 2, sock_connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # a generate's retry after a kept-alive connection failed: never from the pool, where the
        # worker may have closed every other idle connection too
        self._fresh: aiohttp.ClientSession | None = None
        self._streams: set[_Stream] = set()  # generates in flight (abort_streams ends them)
        self._ending: set[asyncio.Task[None]] = set()  # replies left at [DONE] whose body is still ending
        self._closing = False
        # loop time of the last bytes each worker sent a generate (the holder check: a process that
        # sends is not frozen, however late its /health answer)
        self._heard: dict[str, float] = {}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # idle connections are dropped before the worker's server closes them (WORKER_KEEP_ALIVE_S)
            connector = _Connector(limit=self._max_connections, limit_per_host=0, keepalive_timeout=WORKER_CLIENT_IDLE_S)
            self._session = self._new_session(connector)
        return self._session

    def _fresh_http(self) -> aiohttp.ClientSession:
        """A session whose every request opens its own connection (closed after it)."""
        if self._fresh is None:
            self._fresh = self._new_session(_Connector(limit=self._max_connections, limit_per_host=0, force_close=True))
        return self._fresh

    def _new_session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._generate_timeout,
            auto_decompress=False,
            headers=self._headers,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    def abort_streams(self) -> None:
        """End every generate in flight now (``UpstreamError`` kind ``draining``), and refuse new ones."""
        self._closing = True
        for stream in list(self._streams):
            stream.abort()

    async def aclose(self) -> None:
        for task in list(self._ending):
            task.cancel()
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    async def generate(self, url: str, body: dict[str, Any], *, probe: bool = False) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The events of one generate stream (token events, then the final one), in batches:
        every event that has arrived when the gateway reads the socket, so a reply that comes
        faster than the gateway relays it (a loaded gateway, a burst) is relayed in fewer,
        larger steps; a token is never held back waiting for the next.

        Raises UpstreamError on a refused request, a broken stream or an error
        event (after the batch of events before it). While the headers are late the worker's
        /health is probed. ``probe``: end the call ``unresponsive`` when a probe goes
        unanswered (for a caller with another worker to turn to); without it each answered
        probe restarts the first-byte deadline (a lone busy worker is waited for) and an
        unanswered one lets it run out (a briefly frozen worker gets its chance). Closing the iterator early
        closes the connection, which the worker takes as an abort.
        """
        if self._closing:
            raise UpstreamError("draining", "the gateway is shutting down", url=url)
        payload = encode_body(body)
        record = REQUEST.get()
        if record is not None and record.conversation is None:
            record.conversation = body.get("conversation_key")
        stream = _Stream(asyncio.current_task())
        self._streams.add(stream)
        response: aiohttp.ClientResponse | None = None
        finished = False  # read to [DONE] (or a refusal read whole): the connection may be reused
        try:
            try:
                response = await self._post(url, payload, stream, probe=probe)
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    finished = True
                    raise UpstreamError(
                        "status", _error_message(text, response.status), url=url, status=response.status, code=_error_code(text)
                    )
                connection = response.connection
                if connection is not None and connection.protocol is not None:
                    # from here on the read deadline is the gap allowed between events
                    connection.protocol.read_timeout = self._event_s
                    connection.protocol.start_timeout()
                loop = asyncio.get_running_loop()
                self._heard[url] = loop.time()
                if probe:  # late events are probed (module docstring): a timer, moved lazily
                    stream.last = loop.time()
                    stream.timer = loop.call_at(stream.last + EVENTS_LATE_S, self._events_due, url, stream)
                events = SSEEvents(url)
                content = response.content
                while not events.done:
                    chunk = await content.readany()
                    stream.last = self._heard[url] = loop.time()
                    if not chunk:
                        raise UpstreamError("stream", f"worker {url} closed the stream before [DONE]", url=url)
                    batch = events.feed(chunk)
                    if batch:
                        if record is not None:
                            _note(record, batch)
                        yield batch
                    if events.error is not None:
                        raise events.error
                finished = True
            except _Closing as exc:
                raise UpstreamError("draining", "the gateway is shutting down", url=url) from exc
            except _Unresponsive as exc:
                silent = "no response headers" if response is None else f"nothing for {EVENTS_LATE_S:g} s"
                raise UpstreamError(
                    "unresponsive", f"worker {url} sent {silent} and did not answer /health within {PROBE_TIMEOUT_S:g} s", url=url
                ) from exc
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise UpstreamError("connect", f"cannot reach worker {url}: {exc}", url=url) from exc
            except aiohttp.SocketTimeoutError as exc:
                if response is None:
                    raise UpstreamError(
                        "first_byte_timeout", f"worker {url} did not answer within {self._first_byte_s:g} s", url=url
                    ) from exc
                raise UpstreamError("event_timeout", f"worker {url} sent nothing for {self._event_s:g} s", url=url) from exc
            except asyncio.TimeoutError as exc:
                raise UpstreamError("timeout", f"worker {url} timed out", url=url) from exc
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise UpstreamError("stream", f"worker {url} stream broke: {type(exc).__name__}: {exc}", url=url) from exc
        finally:
            self._streams.discard(stream)
            stream.stop_watching()
            if response is not None:
                if not finished:  # closed early or broken: the worker sees the disconnect (abort)
                    response.close()
                elif response.content.is_eof():
                    response.release()
                else:
                    self._end_later(response)

    async def _post(self, url: str, payload: bytes, stream: _Stream, *, probe: bool) -> aiohttp.ClientResponse:
        """The response once its headers are in; a kept-alive connection the worker closed
        meanwhile (it never saw the request) is retried once on a fresh one."""
        for attempt in (0, 1):
            session = self._fresh_http() if attempt else self._http()
            # a timer, not a task per request: most headers come before the first probe is due
            watch = asyncio.get_running_loop().call_later(PROBE_AFTER_S, self._start_watch, url, stream, probe)
            connecting = _CONNECTING.set(stream)
            try:
                response = await session.post(url + GENERATE_PATH, data=payload, headers=_JSON)
                if stream.unresponsive:  # the headers came as the probe gave up: the connection is spoilt
                    response.close()
                    raise _Unresponsive
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not stream.aborted or task is None:
                    raise
                task.uncancel()  # ended by abort_streams while waiting for the headers
                raise _Closing from None
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if attempt:
                    raise
                continue
            finally:
                _CONNECTING.reset(connecting)
                if watch is not None:
                    watch.cancel()
                if stream.watch is not None:
                    stream.watch.cancel()
                    stream.watch = None
            stream.response = response
            return response
        raise AssertionError("unreachable")

    def _start_watch(self, url: str, stream: _Stream, leave: bool) -> None:
        stream.watch = asyncio.get_running_loop().create_task(self._watch(url, stream, leave))

    async def _watch(self, url: str, stream: _Stream, leave: bool) -> None:
        """Probe ``url``'s /health while the request's headers are late. With ``leave`` (the
        caller has another worker) the first unanswered probe ends the request
        (``_Unresponsive`` on its connection); without, each answered probe restarts the
        first-byte deadline (a lone worker that answers is busy, not frozen) and a frozen one
        runs it out. Cancelled once the headers are in."""
        while True:
            connection = stream.connection
            if await self._alive(url):
                if not leave and connection is not None and connection.protocol is not None:
                    connection.protocol.start_timeout()
                await asyncio.sleep(PROBE_AFTER_S)
                continue
            if not leave or connection is None or connection.protocol is None:
                await asyncio.sleep(PROBE_AFTER_S)  # alone, or still connecting: the deadlines cover it
                continue
            stream.unresponsive = True
            connection.protocol.set_exception(_Unresponsive())
            return

    def _events_due(self, url: str, stream: _Stream) -> None:
        """A started stream's events are due: silent for ``EVENTS_LATE_S``, its worker is probed
        (``_watch_events``); else the check moves to when they are due next."""
        stream.timer = None
        loop = asyncio.get_running_loop()
        due = stream.last + EVENTS_LATE_S
        if loop.time() < due:
            stream.timer = loop.call_at(due, self._events_due, url, stream)
        elif stream.watch is None:
            stream.watch = loop.create_task(self._watch_events(url, stream))

    async def _watch_events(self, url: str, stream: _Stream) -> None:
        """Probe ``url``'s /health for a stream whose events are late: unanswered while the stream
        stayed silent, the stream ends ``unresponsive`` (``_Unresponsive`` on its body); answered,
        or bytes came meanwhile, the next check is when its events are due again."""
        last = stream.last
        alive = await self._alive(url)
        stream.watch = None
        response = stream.response
        if response is None or stream.aborted:
            return
        if alive or stream.last != last:
            loop = asyncio.get_running_loop()
            stream.timer = loop.call_at(max(stream.last + EVENTS_LATE_S, loop.time() + PROBE_AFTER_S), self._events_due, url, stream)
            return
        stream.unresponsive = True
        response.content.set_exception(_Unresponsive())

    async def _alive(self, url: str) -> bool:
        """Whether ``url``'s process answers /health (any status) within ``PROBE_TIMEOUT_S``."""
        return await self._health(url) is True

    async def _health(self, url: str) -> bool | None:
        """``url``'s /health: True answered (any status), False refused or broken (gone), None no
        answer within ``PROBE_TIMEOUT_S``."""
        try:
            async with self._http().get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as response:
                await response.read()
                return True
        except asyncio.TimeoutError:  # aiohttp's ServerTimeoutError is one too
            return None
        except aiohttp.ClientError:
            return False

    async def frozen(self, url: str, *, peer: str) -> bool | None:
        """Whether ``url`` is frozen or gone, told against ``peer``, a worker that could do its part
        (module docstring, the holder check): /health of ``url``, and of ``peer`` too once
        ``url``'s answer is ``WITNESS_AFTER_S`` late; True when ``url`` refused the connection, or
        when ``peer`` answered after ``p`` seconds and ``url`` had not answered ``max(FROZEN_FLOOR_S,
        FROZEN_RATIO * p)`` after ``peer`` was asked; False when ``url`` answered, or sent bytes of
        a stream since it was asked; None (no verdict) when neither answered within
        ``PROBE_TIMEOUT_S`` (this gateway, or the machine, is what stalls) or ``peer`` is gone."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        suspect = loop.create_task(self._health(url))
        witness: asyncio.Task[bool | None] | None = None
        deadline = t0 + PROBE_TIMEOUT_S
        try:
            # most answers come sooner: the peer's call is spent only on a holder that is late
            await asyncio.wait((suspect,), timeout=WITNESS_AFTER_S)
            pending: set[asyncio.Task[bool | None]] = {suspect}
            if not suspect.done():
                w0 = loop.time()
                witness = loop.create_task(self._health(peer))
                pending.add(witness)
            while not suspect.done() and (wait := deadline - loop.time()) > 0:
                if self._heard.get(url, t0) > t0:
                    return False  # it sent a stream's bytes since it was asked: busy, not frozen
                await asyncio.wait(pending, timeout=min(wait, HEARD_POLL_S), return_when=asyncio.FIRST_COMPLETED)
                if witness is not None and witness in pending and witness.done():
                    pending.discard(witness)
                    if witness.result() is True:  # the time it took: what this gateway and machine show now
                        deadline = min(deadline, w0 + max(FROZEN_FLOOR_S, FROZEN_RATIO * (loop.time() - w0)))
            if suspect.done() and suspect.result() is not None:
                return not suspect.result()
            if self._heard.get(url, t0) > t0:
                return False
            return True if witness is not None and witness.done() and witness.result() is True else None
        finally:
            suspect.cancel()
            if witness is not None:
                witness.cancel()

    def _end_later(self, response: aiohttp.ClientResponse) -> None:
        """A reply left at [DONE] before its body ended (its last chunk usually follows at once):
        back to the pool once it has, closed if it does not come (closing it instead, a closed
        loop of requests opened a connection per request and overflowed the worker's accept queue)."""

        async def end() -> None:
            try:
                async with asyncio.timeout(self._event_s or 5.0):
                    while await response.content.readany():
                        pass
                response.release()
            except (asyncio.TimeoutError, aiohttp.ClientError, _Closing):
                response.close()

        task = asyncio.get_running_loop().create_task(end())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def find_leases(self, url: str, *, conversation_key: str) -> list[dict[str, Any]]:
        async with self._http().get(
            f"{url}/internal/kv/leases", params={"conversation_key": conversation_key}, timeout=self._short
        ) as response:
            response.raise_for_status()
            leases = (await response.json()).get("leases", [])
        return [entry for entry in leases if entry.get("conversation_key") == conversation_key]

    async def renew_lease(self, url: str, lease_id: str, *, ttl_s: float) -> float | None:
        """The new expiry, or None if the worker does not know the lease (404)."""
        async with self._http().post(f"{url}/internal/kv/leases/{lease_id}/renew", json={"ttl_s": ttl_s}, timeout=self._short) as response:
            if response.status == 404:
                return None
            response.raise_for_status()
            return float((await response.json())["expires_at"])

    async def release_lease(self, url: str, lease_id: str) -> bool:
        async with self._http().delete(f"{url}/internal/kv/leases/{lease_id}", timeout=self._short) as response:
            if response.status == 404:
                return False
            response.raise_for_status()
            return True

    async def ready(self, url: str) -> tuple[bool | None, dict[str, Any] | None]:
        """Whether ``url`` is ready: True (200), False (another status, refused, broken), None (no
        answer in time); and a 200's JSON body."""
        try:
            async with self._http().get(f"{url}/ready", timeout=self._short) as response:
                if response.status != 200:
                    return False, None
                try:
                    body = await response.json(content_type=None)
                except ValueError:
                    body = None
                return True, body if isinstance(body, dict) else None
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            return None, None
        except aiohttp.ClientError:
            return False, None


def _note(record: RequestRecord, batch: list[dict[str, Any]]) -> None:
    """The first token's arrival and the first final event's prompt counts (a split turn's
    prefill, else the one worker: where the prompt was computed)."""
    if record.first_token_s is None and batch[0].get("token_ids"):
        record.first_token_s = time.perf_counter()
    usage = batch[-1].get("usage")
    if record.computed_tokens is None and isinstance(usage, dict) and "computed_prompt_tokens" in usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.computed_tokens = usage.get("computed_prompt_tokens")


class SSEEvents:
    """Server-sent events from raw bytes: ``data: <json>`` events until ``data: [DONE]``.

    ``feed`` takes whatever the socket delivered (any split, even mid-line) and
    returns the complete events in it; lines that are not ``data:`` (blank
    separators, comments, other fields) are skipped: a worker's ``: keep-alive``
    comment is no event, only a sign of life, which the connection's
    between-events deadline sees (``sock_read``). After ``[DONE]``, ``done``
    is set and the rest is ignored; an ``error`` event (or a malformed one)
    stops the parse and is left in ``error`` for the caller to raise after the
    events before it.
    """

    __slots__ = ("url", "done", "error", "_partial")

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = False
        self.error: UpstreamError | None = None
        self._partial = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        if self.done or self.error is not None:
            return []
        lines = (self._partial + chunk).split(b"\n") if self._partial else chunk.split(b"\n")
        self._partial = lines.pop()  # what follows the last newline: an incomplete line
        out: list[dict[str, Any]] = []
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                break
            event = _event(data)
            if event is None:
                self.error = UpstreamError("stream", f"worker {self.url} sent a malformed event: {data[:200]!r}", url=self.url)
                break
            if "error" in event:
                self.error = UpstreamError("worker_error", _error_message(json.dumps(event), None), url=self.url)
                break
            out.append(event)
        return out


# the C scanner under json.loads: one event is one call (json.loads adds ~1.5 us of
# Python per call, paid for every token event of every stream)
_SCAN = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # typeshed types its argument as itself


def _event(data: bytes) -> dict[str, Any] | None:
    """The JSON object that is all of ``data`` (stripped), or None."""
    try:
        text = data.decode()
        event, end = _SCAN(text, 0)
    except (UnicodeDecodeError, StopIteration, ValueError):
        return None
    return event if end == len(text) and isinstance(event, dict) else None


def _error_message(text: str, status: int | None) -> str:
    try:
        message = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = text[:500]
    return f"worker error ({status}): {message}" if status is not None else f"worker error: {message}"


def _error_code(text: str) -> str | None:
    try:
        code = json.loads(text)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


async def resolve_service(host: str, port: int) -> list[str]:
    """Every address of a headless Service, as worker URLs (sorted, deduplicated)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    urls = set()
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        urls.add(f"http://[{address}]:{port}" if family == socket.AF_INET6 else f"http://{address}:{port}")
    return sorted(urls)


class WorkerPool:
    """The workers in rotation, their health and load; a background task keeps it current."""

    def __init__(self, config: GatewayConfig, client: WorkerClient, *, resolve: Callable[[str, int], Any] = resolve_service) -> None:
        self.config = config
        self.client = client
        self._resolve = resolve
        self.workers: dict[str, WorkerState] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._last_dns = float("-inf")
        self.set_members(prefill=list(config.prefill_urls), decode=list(config.decode_urls))

    @property
    def uses_dns(self) -> bool:
        return bool(self.config.prefill_service or self.config.decode_service)

    def set_members(self, *, prefill: list[str], decode: list[str]) -> None:
        """Replace the member list; known workers keep their health and load."""
        prefill_set = {u.rstrip("/") for u in prefill}
        decode_set = {u.rstrip("/") for u in decode}
        roles: dict[str, str] = {}
        for url in sorted(prefill_set | decode_set):
            if url in prefill_set and url in decode_set:
                roles[url] = "both"
            elif url in prefill_set:
                roles[url] = "prefill"
            else:
                roles[url] = "decode" if prefill_set else "both"
        old = self.workers
        self.workers = {url: old.get(url) or WorkerState(url, role) for url, role in roles.items()}
        for url, state in self.workers.items():
            state.role = roles[url]

    def by_role(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role]

    def get(self, url: str) -> WorkerState | None:
        return self.workers.get(url)

    def _others(self, worker: WorkerState, roles: tuple[str, ...] | None = None) -> Iterator[WorkerState]:
        """The other healthy workers of ``roles`` (default: those that can do ``worker``'s part of a
        turn, ``SAME_PART``) in the rotation."""
        roles = roles or SAME_PART[worker.role]
        return (w for w in self.workers.values() if w is not worker and w.healthy and w.role in roles)

    def has_other(self, worker: WorkerState, roles: tuple[str, ...] | None = None) -> bool:
        """Whether another healthy worker of ``roles`` (default: ``SAME_PART``) is in the rotation."""
        return next(self._others(worker, roles), None) is not None

    def peer(self, worker: WorkerState) -> WorkerState | None:
        """The least loaded other healthy worker that can do ``worker``'s part (``SAME_PART``), or None."""
        return min(self._others(worker), key=lambda w: w.inflight, default=None)

    def take_out(self, url: str, *, refused: bool) -> bool:
        """Take ``url`` out of the rotation (until ``/ready`` answers 200): always when it
        ``refused`` (connection refused, not ready, draining), and when it was only silent
        (a deadline passed) while another healthy worker can do its part. Whether it left."""
        state = self.workers.get(url)
        if state is None or not (refused or self.has_other(state)):
            return False
        state.healthy = False
        state.refused = refused
        return True

    def fallback(self, roles: tuple[str, ...]) -> WorkerState | None:
        """For a turn when no worker of ``roles`` is healthy: the one whose /ready answered 200
        most recently and that has not refused since (out only for silence: busy more often
        than frozen, and its turns stay bounded by the deadlines); None when none is
        reachable (each refused its connection or answered not ready): then a 503."""
        candidates = [w for w in self.workers.values() if w.role in roles and not w.refused and w.answered_at is not None]
        return max(candidates, key=lambda w: w.answered_at or 0.0, default=None)

    async def refresh(self) -> None:
        """Re-resolve the Services (when due) and poll every worker's /ready once."""
        loop = asyncio.get_running_loop()
        if self.uses_dns and loop.time() - self._last_dns >= self.config.dns_refresh_s:
            self._last_dns = loop.time()
            await self._resolve_members()
        states = list(self.workers.values())
        results = await asyncio.gather(*(self.client.ready(w.url) for w in states))
        was = [w.healthy for w in states]
        for state, (ok, body) in zip(states, results):
            state.polled(ok, body)
        # silence takes a worker out only while another of its part is healthy: of several
        # silent ones, the first in the list stays (module docstring)
        for state, (ok, _), healthy in zip(states, results, was):
            if healthy and ok is None and not state.healthy and not self.has_other(state):
                state.healthy = True

    async def _resolve_members(self) -> None:
        port = self.config.worker_port
        found: dict[str, list[str]] = {"prefill": list(self.config.prefill_urls), "decode": list(self.config.decode_urls)}
        for role, host in (("prefill", self.config.prefill_service), ("decode", self.config.decode_service)):
            if not host:
                continue
            try:
                found[role] += await self._resolve(host, port)
            except OSError as exc:  # no ready pod yet: NXDOMAIN; keep the old list
                log.warning("cannot resolve %s service %s: %s", role, host, exc)
                found[role] += [w.url for w in self.workers.values() if w.role in (role, "both")]
        self.set_members(prefill=found["prefill"], decode=found["decode"])

    def start(self) -> None:
        """Poll every ``health_interval_s`` from now on (the caller has run the first ``refresh``)."""
        self._stop.clear()
        self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        # the first poll runs before ``start`` (the gateway's startup awaits it), so the loop's first
        # is an interval later, not a second poll at once whose answers could overtake the first's
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.config.health_interval_s)
            if self._stop.is_set():
                return
            try:
                await self.refresh()
            except Exception:  # one failed poll must not end the loop
                log.exception("worker health poll failed")

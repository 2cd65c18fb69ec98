"""The worker client (WorkerClient.generate, on aiohttp) against a scripted HTTP/1.1 server
on 127.0.0.1: kept-alive reuse, a reply left at [DONE], a connection the worker closed
meanwhile (retried once, fresh), refusals, timeouts, aborts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvserving.gateway.workers import UpstreamError, WorkerClient

Reader, Writer = asyncio.StreamReader, asyncio.StreamWriter
EVENTS = [{"token_ids": [1]}, {"token_ids": [2, 3]}, {"finish_reason": "stop", "usage": {"prompt_tokens": 2}}]


def sse_reply(events: list[dict[str, Any]], *, done: bool = True) -> list[bytes]:
    """The chunks of a chunked SSE response, one event per chunk, [DONE] then the last chunk."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    frames = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + ([b"data: [DONE]\n\n"] if done else [])
    return [head] + [b"%x\r\n%s\r\n" % (len(f), f) for f in frames]


async def reply_whole(writer: Writer) -> None:
    """One reply with its body ended: the connection may carry the next request."""
    writer.write(b"".join(sse_reply(EVENTS)) + b"0\r\n\r\n")
    await writer.drain()


async def read_request(reader: Reader) -> dict[str, Any] | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    assert head.startswith(b"POST /internal/generate HTTP/1.1\r\n")
    return json.loads(await reader.readexactly(length))


Script = Callable[[int, Reader, Writer], Awaitable[None]]


async def serve(script: Script) -> tuple[asyncio.Server, str, list[int]]:
    """A server running ``script(connection number, reader, writer)`` per connection."""
    conns: list[int] = []

    async def handle(reader: Reader, writer: Writer) -> None:
        conns.append(len(conns))
        try:
            await script(conns[-1], reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", conns


async def collect(client: WorkerClient, url: str, *, probe: bool = False) -> list[dict[str, Any]]:
    return [e async for batch in client.generate(url, {"request_id": "r"}, probe=probe) for e in batch]


async def ended(client: WorkerClient, timeout_s: float = 10.0) -> None:
    """Until every reply left at [DONE] has ended and its connection is back in the pool (no fixed sleep:
    on a loaded machine the last chunk's arrival may take longer than any chosen pause)."""
    async with asyncio.timeout(timeout_s):
        while client._ending:
            await asyncio.sleep(0.005)


def client(**kw: Any) -> WorkerClient:
    return WorkerClient(request_timeout_s=kw.pop("timeout", 5.0), connect_timeout_s=1.0, **kw)


@dataclass
class Served:
    """What a check sees: the scripted server, its URL, its connections so far, a fresh client."""

    server: asyncio.Server
    url: str
    conns: list[int]
    client: WorkerClient


def with_server(script: Script, check: Callable[[Served], Awaitable[None]], **client_kw: Any) -> None:
    """Run ``check`` against a server running ``script`` and a client made by ``client(**client_kw)``;
    both are closed after it, whatever it raised."""

    async def run() -> None:
        server, url, conns = await serve(script)
        c = client(**client_kw)
        try:
            await check(Served(server, url, conns, c))
        finally:
            await c.aclose()
            server.close()

    asyncio.run(run())


def test_kept_alive_connection_is_reused_and_chunks_are_dechunked() -> None:
    async def script(_: int, reader: Reader, writer: Writer) -> None:
        while await read_request(reader) is not None:
            for chunk in sse_reply(EVENTS):
                writer.write(chunk)
                await writer.drain()
            writer.write(b"0\r\n\r\n")

    async def check(s: Served) -> None:
        for _ in range(3):
            assert await collect(s.client, s.url) == EVENTS
            await asyncio.sleep(0.01)  # the last chunk arrives
        assert len(s.conns) == 1

    with_server(script, check)


def test_reply_left_at_done_is_reused_once_its_last_chunk_arrived() -> None:
    gate = asyncio.Event()

    async def script(_: int, reader: Reader, writer: Writer) -> None:
        while await read_request(reader) is not None:
            writer.write(b"".join(sse_reply(EVENTS)))
            await gate.wait()  # the end of the body comes later
            writer.write(b"0\r\n\r\n")

    async def check(s: Served) -> None:
        assert await collect(s.client, s.url) == EVENTS  # returns at [DONE]
        gate.set()
        await ended(s.client)
        assert await collect(s.client, s.url) == EVENTS
        assert len(s.conns) == 1

    with_server(script, check)


def test_a_reply_still_ending_is_parked_not_closed_when_the_next_request_comes() -> None:
    """A closed loop sends its next request while the last reply's final chunk is still in
    flight: that request takes another connection and the first is kept (closing it, a
    closed loop opened a connection per request and overflowed the worker's accept queue)."""
    gate = asyncio.Event()
    served: dict[int, int] = {}

    async def script(n: int, reader: Reader, writer: Writer) -> None:
        while await read_request(reader) is not None:
            served[n] = served.get(n, 0) + 1
            writer.write(b"".join(sse_reply(EVENTS)))
            await writer.drain()
            if n == 0:
                await gate.wait()  # the first reply's end comes late
            writer.write(b"0\r\n\r\n")

    async def check(s: Served) -> None:
        assert await collect(s.client, s.url) == EVENTS  # connection 0, its reply not ended
        assert await collect(s.client, s.url) == EVENTS  # connection 1
        gate.set()
        await ended(s.client)
        for _ in range(3):
            assert await collect(s.client, s.url) == EVENTS
            await ended(s.client)
        assert len(s.conns) == 2 and served[0] >= 2, (s.conns, served)

    with_server(script, check)


def test_a_reply_still_open_is_not_reused_a_fresh_connection_is() -> None:
    async def script(_: int, reader: Reader, writer: Writer) -> None:
        while await read_request(reader) is not None:
            writer.write(b"".join(sse_reply(EVENTS)))  # never ends the body

    async def check(s: Served) -> None:
        assert await collect(s.client, s.url) == EVENTS
        assert await collect(s.client, s.url) == EVENTS
        assert len(s.conns) == 2

    with_server(script, check)


def test_connection_closed_by_the_worker_before_answering_is_retried_once_fresh() -> None:
    async def script(n: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        if n == 0:
            await reply_whole(writer)
            await read_request(reader)  # the second request on this connection: closed unanswered
            return
        await reply_whole(writer)
        await reader.read()

    async def check(s: Served) -> None:
        assert await collect(s.client, s.url) == EVENTS
        await asyncio.sleep(0.01)
        assert await collect(s.client, s.url) == EVENTS
        assert len(s.conns) == 2

    with_server(script, check)


def test_the_retry_opens_a_new_connection_when_every_kept_alive_one_was_closed() -> None:
    """Two kept-alive connections the worker closed (the gateway's loop stalled past their idle
    margin): the first attempt takes one, the retry must not take the other."""
    both = asyncio.Event()

    async def script(n: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        if n < 2:
            if n == 1:
                both.set()
            await both.wait()  # two requests in flight at once: two connections in the pool after
            await reply_whole(writer)
            await read_request(reader)  # the next request on this connection: closed unanswered
            return
        await reply_whole(writer)
        await reader.read()

    async def check(s: Served) -> None:
        assert await asyncio.gather(collect(s.client, s.url), collect(s.client, s.url)) == [EVENTS, EVENTS]
        await ended(s.client)
        assert await collect(s.client, s.url) == EVENTS
        assert len(s.conns) == 3  # one stale connection tried, then a new one

    with_server(script, check)


def test_refusal_broken_stream_timeout_and_unreachable_worker_are_upstream_errors() -> None:
    async def script(n: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        if n == 0:
            body = json.dumps({"error": {"message": "engine full"}}).encode()
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()  # and closes: the next request needs a new connection
        elif n == 1:
            writer.write(sse_reply(EVENTS[:1], done=False)[0] + sse_reply(EVENTS[:1], done=False)[1])
            await writer.drain()  # then the worker goes away mid-stream
        else:
            await reader.read()  # never answers

    async def check(s: Served) -> None:
        with pytest.raises(UpstreamError) as err:
            await collect(s.client, s.url)
        assert (err.value.kind, err.value.status) == ("status", 503) and "engine full" in err.value.message
        got: list[Any] = []
        with pytest.raises(UpstreamError) as err:
            async for batch in s.client.generate(s.url, {}):
                got += batch
        assert err.value.kind == "stream" and got == EVENTS[:1]
        with pytest.raises(UpstreamError) as err:
            await collect(s.client, s.url)
        assert err.value.kind == "timeout"
        s.server.close()
        await s.server.wait_closed()
        with pytest.raises(UpstreamError) as err:
            await collect(s.client, s.url)
        assert err.value.kind == "connect"

    # the whole-request deadline the last call runs out: long enough that the refusal and the
    # broken stream before it are read whole even when the event loop stalls
    with_server(script, check, timeout=2.0)


def test_closing_the_stream_early_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def script(_: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        writer.write(b"".join(sse_reply(EVENTS[:1], done=False)))
        await writer.drain()
        assert await reader.read() == b""  # EOF: the gateway hung up (the worker aborts)
        closed.set()

    async def check(s: Served) -> None:
        stream = s.client.generate(s.url, {})
        assert await anext(stream) == EVENTS[:1]
        await stream.aclose()
        await asyncio.wait_for(closed.wait(), 5)

    with_server(script, check)


def chunk(frame: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(frame), frame)


def test_keep_alive_comments_keep_a_stream_alive_and_silence_past_the_gap_is_an_event_timeout() -> None:
    async def script(n: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        head, *frames = sse_reply(EVENTS)
        writer.write(head)
        if n == 0:  # busy: 3 s of keep-alive comments (longer than the gap allowed) before the events
            for _ in range(12):
                await asyncio.sleep(0.25)  # far inside the 2 s gap: a stalled event loop still keeps it alive
                writer.write(chunk(b": keep-alive\n\n"))
            writer.write(b"".join(frames) + b"0\r\n\r\n")
            await writer.drain()
            return  # and closes: the next request takes a new connection
        writer.write(frames[0])  # frozen after its first event
        await writer.drain()
        await reader.read()

    async def check(s: Served) -> None:
        assert await collect(s.client, s.url) == EVENTS  # the comments are no events
        got: list[Any] = []
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamError) as err:
            async for batch in s.client.generate(s.url, {}):
                got += batch
        assert (err.value.kind, got) == ("event_timeout", EVENTS[:1]), err.value.message
        assert 1.95 < asyncio.get_running_loop().time() - t0 < 10.0

    with_server(script, check, timeout=30.0, first_byte_timeout_s=10.0, event_timeout_s=2.0)


def test_no_response_headers_in_time_is_a_first_byte_timeout() -> None:
    async def script(_: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        await reader.read()  # accepted, never answered (a frozen process: the kernel still accepts)

    async def check(s: Served) -> None:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamError) as err:
            await collect(s.client, s.url)
        assert err.value.kind == "first_byte_timeout" and "did not answer within 0.3 s" in err.value.message
        assert asyncio.get_running_loop().time() - t0 < 10.0  # at the deadline, not the request's 30 s

    with_server(script, check, timeout=30.0, first_byte_timeout_s=0.3, event_timeout_s=10.0)


def test_abort_streams_ends_every_request_in_flight_and_refuses_new_ones() -> None:
    async def script(_: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        head, *frames = sse_reply(EVENTS)
        writer.write(head + frames[0])
        await writer.drain()
        await reader.read()  # the rest never comes

    async def check(s: Served) -> None:
        streams = [s.client.generate(s.url, {}) for _ in range(2)]
        for stream in streams:
            assert await anext(stream) == EVENTS[:1]
        s.client.abort_streams()
        for stream in streams:
            with pytest.raises(UpstreamError) as err:
                await anext(stream)
            assert err.value.kind == "draining"
        with pytest.raises(UpstreamError) as err:
            await collect(s.client, s.url)
        assert err.value.kind == "draining"

    with_server(script, check)


def test_abort_streams_ends_a_request_still_waiting_for_its_response_headers() -> None:
    asked = asyncio.Event()

    async def script(_: int, reader: Reader, writer: Writer) -> None:
        await read_request(reader)
        asked.set()
        await reader.read()  # never answers

    async def check(s: Served) -> None:
        waiting = asyncio.ensure_future(collect(s.client, s.url))
        await asyncio.wait_for(asked.wait(), 10)  # the request is out, its headers are not in
        assert not waiting.done()
        s.client.abort_streams()
        with pytest.raises(UpstreamError) as err:
            await asyncio.wait_for(waiting, 5)
        assert err.value.kind == "draining"

    with_server(script, check, timeout=30.0, first_byte_timeout_s=20.0, event_timeout_s=10.0)


async def read_head(reader: Reader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def test_late_headers_from_a_worker_that_answers_health_are_awaited() -> None:
    """A busy worker (its KV pull takes 2.5 s) answers its /health probes: its reply is read whole."""
    probes: list[int] = []

    async def script(_: int, reader: Reader, writer: Writer) -> None:
        head = await read_head(reader)
        while head.startswith(b"GET /health "):  # kept alive: the next probe comes on the same connection
            probes.append(1)
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 15\r\n\r\n{"status":"ok"}')
            await writer.drain()
            head = await read_head(reader)
        length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        await asyncio.sleep(2.5)
        for part in sse_reply(EVENTS):
            writer.write(part)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def run() -> None:
        server, url, _ = await serve(script)
        c = WorkerClient(request_timeout_s=30.0, connect_timeout_s=1.0, first_byte_timeout_s=20.0, event_timeout_s=10.0)
        try:
            assert await collect(c, url, probe=True) == EVENTS
            assert len(probes) >= 2  # probed while the headers were late, and alive every time
        finally:
            await c.aclose()
            server.close()

    asyncio.run(run())


def test_late_headers_from_a_worker_that_does_not_answer_health_end_the_call_unresponsive() -> None:
    """A frozen worker (the kernel still accepts, the process answers nothing): the call ends
    ``unresponsive`` at the first unanswered probe, long before the first-byte deadline."""

    async def script(_: int, reader: Reader, writer: Writer) -> None:
        await read_head(reader)
        await reader.read()  # accepted, never answered

    async def run() -> None:
        from kvserving.gateway.workers import PROBE_AFTER_S, PROBE_TIMEOUT_S

        server, url, _ = await serve(script)
        c = WorkerClient(request_timeout_s=30.0, connect_timeout_s=1.0, first_byte_timeout_s=20.0, event_timeout_s=10.0)
        try:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamError) as err:
                await collect(c, url, probe=True)
            took = asyncio.get_running_loop().time() - t0
            assert err.value.kind == "unresponsive" and err.value.url == url
            assert PROBE_AFTER_S + PROBE_TIMEOUT_S <= took < PROBE_AFTER_S + PROBE_TIMEOUT_S + 3.0
            assert not c._streams  # nothing left in flight
        finally:
            await c.aclose()
            server.close()

    asyncio.run(run())


def health_server(delay_s: float | None) -> Script:
    """A worker whose /health answers after ``delay_s`` (None: never, the process is frozen)."""

    async def script(_: int, reader: Reader, writer: Writer) -> None:
        while True:
            await read_head(reader)
            if delay_s is None:
                await reader.read()
                return
            await asyncio.sleep(delay_s)
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{"status":"ok"}')
            await writer.drain()

    return script


@pytest.mark.parametrize(
    ("suspect_s", "peer_s", "verdict", "took_s"),
    [
        (0.0, 0.0, False, (0.0, 0.1)),  # answered: alive, at once
        (0.06, 0.0, False, (0.06, 0.16)),  # busy: answered within the floor
        (None, 0.0, True, (0.1, 0.2)),  # frozen: the peer answered, the floor passed
        (0.3, 0.1, False, (0.3, 0.4)),  # everything late (a stalled gateway): the ratio applies
        (None, 0.1, True, (0.4, 0.6)),  # frozen, told at FROZEN_RATIO x the peer's 0.1 s
        (None, None, None, (1.0, 1.1)),  # neither answers: no verdict at PROBE_TIMEOUT_S
        ("refused", None, True, (0.0, 0.1)),  # gone: its connection refused
    ],
    ids=["alive", "busy", "frozen", "all-late", "frozen-slow-peer", "no-verdict", "gone"],
)
def test_the_holder_check_tells_frozen_from_busy_against_a_peer(
    suspect_s: float | str | None, peer_s: float | None, verdict: bool | None, took_s: tuple[float, float]
) -> None:
    """``WorkerClient.frozen``: the peer is asked once the suspect's answer is WITNESS_AFTER_S
    late; the suspect is frozen when the peer answered after p and it had not after
    max(FROZEN_FLOOR_S, FROZEN_RATIO x p) from then; the bounds (plus 0.1 s for scheduling) follow."""
    from kvserving.gateway.workers import FROZEN_FLOOR_S, FROZEN_RATIO, PROBE_TIMEOUT_S, WITNESS_AFTER_S

    assert (FROZEN_FLOOR_S, FROZEN_RATIO, PROBE_TIMEOUT_S, WITNESS_AFTER_S) == (0.1, 4.0, 1.0, 0.01)  # the table's numbers

    async def run() -> None:
        servers = []
        urls = []
        asked: list[list[int]] = []  # each server's connections
        for delay in (suspect_s, peer_s):
            if delay == "refused":
                server, url, conns = await serve(health_server(None))
                server.close()
                await server.wait_closed()
            else:
                assert not isinstance(delay, str)
                server, url, conns = await serve(health_server(delay))
                servers.append(server)
            urls.append(url)
            asked.append(conns)
        c = WorkerClient(request_timeout_s=30.0, connect_timeout_s=1.0)
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert await c.frozen(urls[0], peer=urls[1]) is verdict
            took = loop.time() - t0
            assert took_s[0] <= took < took_s[1], took
            # the peer is asked only about a suspect late by WITNESS_AFTER_S
            assert len(asked[1]) == (0 if suspect_s == 0.0 or suspect_s == "refused" else 1), asked
        finally:
            await c.aclose()
            for server in servers:
                server.close()

    asyncio.run(run())


def test_the_holder_check_takes_a_worker_whose_stream_is_flowing_for_alive() -> None:
    """/health unanswered (its event loop is slow to it) but a stream of this gateway's keeps
    bringing its bytes: a process that sends is not frozen; told alive by the first bytes that
    came after the probes went out, not at the floor."""

    async def script(_: int, reader: Reader, writer: Writer) -> None:
        head = await read_head(reader)
        if head.startswith(b"GET /health"):
            await reader.read()  # never answered
            return
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        for chunk in sse_reply([{"token_ids": [i]} for i in range(200)]):
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.02)

    async def run() -> None:
        from kvserving.gateway.workers import FROZEN_FLOOR_S

        server, url, _ = await serve(script)
        peer_server, peer, _ = await serve(health_server(0.0))
        c = WorkerClient(request_timeout_s=30.0, connect_timeout_s=1.0, first_byte_timeout_s=5.0, event_timeout_s=5.0)
        flowing = asyncio.Event()

        async def read_stream() -> None:
            async for _ in c.generate(url, {"request_id": "r"}):
                flowing.set()

        loop = asyncio.get_running_loop()
        reader = loop.create_task(read_stream())
        try:
            await flowing.wait()
            t0 = loop.time()
            assert await c.frozen(url, peer=peer) is False
            assert loop.time() - t0 < FROZEN_FLOOR_S
        finally:
            reader.cancel()
            await asyncio.wait((reader,))
            await c.aclose()
            server.close()
            peer_server.close()

    asyncio.run(run())

"""The puller's HTTP client (kv_wire.PeerHttp, aiohttp on a loop of its own) from plain threads,
against a scripted peer: the credential on every call, hold answers and refusals, a frozen peer
bounded by the timeout, a closed client refusing calls."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvserving.config import WORKER_CLIENT_IDLE_S, WORKER_KEEP_ALIVE_S
from kvserving.worker.kv import protocol
from kvserving.worker.kv.protocol import PeerHttp

TOKEN = "peer-token"


class Peer:
    """An HTTP/1.1 server in a thread answering by path; records each request's method, path, auth and body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None, Any]] = []
        self.ports: list[int] = []  # the client's port of each request's connection
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self.handle, "127.0.0.1", 0), self.loop).result()
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                method, path, _ = head.split(" ", 2)
                fields = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)}
                raw = await reader.readexactly(int(fields.get("content-length", 0)))
                body = json.loads(raw) if raw else None
                self.seen.append((method, path, fields.get("authorization"), body))
                self.ports.append(writer.get_extra_info("peername")[1])
                if path.endswith("/frozen/hold"):
                    await asyncio.sleep(30)
                if path.endswith("/busy/hold"):  # a sender answering after an engine step of 1.2 s
                    await asyncio.sleep(1.2)
                status, reply = {
                    "/internal/kv/agent": (200, {"agent": "meta"}),
                    "/internal/kv/leases/ok/hold": (200, {"held": True}),
                    "/internal/kv/leases/busy/hold": (200, {"held": True}),
                    "/internal/kv/leases/gone/hold": (404, {}),
                    "/internal/kv/leases/other/hold": (409, {}),
                    "/internal/kv/leases/bad/hold": (500, {}),
                }.get(path, (200, {}))
                data = json.dumps(reply).encode()
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(data), data))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        async def shutdown() -> None:  # every handler ended on the loop, none left for the collector
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.stop()


def test_calls_from_many_threads_carry_the_credential_and_map_the_answers(peer: Peer) -> None:
    http = PeerHttp(token=TOKEN, timeout_s=2.0)
    try:
        assert http.fetch_agent_info(peer.url + "/") == {"agent": "meta"}
        with ThreadPoolExecutor(8) as pool:  # the server's pull threads share one client
            held = list(pool.map(lambda _: http.hold(peer.url, "ok", "d", 1.5, True), range(16)))
        assert held == [{"held": True}] * 16
        assert http.hold(peer.url, "gone", "d", 1.5, False) == {"refused": "unknown_lease"}
        assert http.hold(peer.url, "other", "d", 1.5, False) == {"refused": "lease_mismatch"}
        with pytest.raises(ConnectionError, match="HTTP 500"):
            http.hold(peer.url, "bad", "d", 1.5, False)
        http.release(peer.url, "ok")
    finally:
        http.close()
    assert {auth for _, _, auth, _ in peer.seen} == {f"Bearer {TOKEN}"}
    assert ("POST", "/internal/kv/leases/ok/hold", f"Bearer {TOKEN}", {"digest": "d", "hold_s": 1.5, "consume": True}) in peer.seen
    assert peer.seen[-1][:2] == ("DELETE", "/internal/kv/leases/ok")
    with pytest.raises(RuntimeError):
        http.hold(peer.url, "ok", "d", 1.5, False)  # closed: refused at once, never waits


def test_an_idle_connection_is_not_reused_past_the_clients_idle_time(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's server closes a connection idle WORKER_KEEP_ALIVE_S; the client must not send on one that old
    (a hold sent as the server closed it failed with ServerDisconnectedError: a recomputed pull). Here the idle
    time is 1.5 s (two holds back to back stay within it on a stalled machine): two holds back to back share a
    connection, a third after 2 s opens a new one."""
    assert WORKER_CLIENT_IDLE_S < WORKER_KEEP_ALIVE_S
    monkeypatch.setattr(protocol, "WORKER_CLIENT_IDLE_S", 1.5)
    http = PeerHttp(token=TOKEN, timeout_s=2.0)
    try:
        for pause in (0.0, 0.0, 2.0):
            time.sleep(pause)
            assert http.hold(peer.url, "ok", "d", 1.5, False) == {"held": True}
    finally:
        http.close()
    assert peer.ports[0] == peer.ports[1] != peer.ports[2]


def test_a_frozen_peer_costs_a_bounded_wait(peer: Peer) -> None:
    http = PeerHttp(token=TOKEN, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - a timeout of the client's own kind: the puller catches them all
            http.hold(peer.url, "frozen", "d", 1.5, False)
        assert time.monotonic() - t0 < 5.0
    finally:
        http.close()


def test_a_hold_waits_longer_than_the_session_deadline_only_when_asked(peer: Peer) -> None:
    # the puller asks for as long as recomputing the offered tokens would take (``Puller.hold_wait_s``)
    http = PeerHttp(token=TOKEN, timeout_s=0.5)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the session's 0.5 s: the busy sender's 1.2 s answer is too late
            http.hold(peer.url, "busy", "d", 1.5, True)
        assert http.hold(peer.url, "busy", "d", 1.5, True, 3.0) == {"held": True}
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - a frozen sender still costs at most the wait asked for
            http.hold(peer.url, "frozen", "d", 1.5, False, 1.0)
        assert time.monotonic() - t0 < 5.0
        assert http.hold(peer.url, "ok", "d", 1.5, True, 0.1) == {"held": True}  # shorter than the session's: the session's
    finally:
        http.close()

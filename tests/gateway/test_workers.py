"""Worker discovery and health (gateway/workers.py): static lists, roles,
headless-Service DNS re-resolution, SSE parsing."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvserving.config import GatewayConfig
from kvserving.gateway.prompt.tag_spans import expand_runs
from kvserving.gateway.workers import (
    RawJson,
    SSEEvents,
    UpstreamError,
    WorkerClient,
    WorkerPool,
    encode_body,
    resolve_service,
    runs_json,
)


def pool(config: GatewayConfig, resolve=None) -> WorkerPool:  # type: ignore[no-untyped-def]
    client = WorkerClient(request_timeout_s=5, connect_timeout_s=1)
    return WorkerPool(config, client, resolve=resolve) if resolve else WorkerPool(config, client)


def test_static_roles_a_url_in_both_lists_is_a_both_worker() -> None:
    p = pool(GatewayConfig(prefill_urls=("http://p/", "http://x"), decode_urls=("http://d", "http://x")))
    assert {u: w.role for u, w in p.workers.items()} == {"http://p": "prefill", "http://d": "decode", "http://x": "both"}
    only_decode = pool(GatewayConfig(decode_urls=("http://d",)))
    assert only_decode.workers["http://d"].role == "both"  # no prefill worker at all: whole turns


def test_services_are_resolved_and_re_resolved_keeping_known_workers_state() -> None:
    answers = {"pre.svc": ["http://10.0.0.1:8000"], "dec.svc": ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]}

    async def resolve(host: str, port: int) -> list[str]:
        assert port == 8000
        if host not in answers:
            raise OSError("NXDOMAIN")
        return list(answers[host])

    cfg = GatewayConfig(prefill_service="pre.svc", decode_service="dec.svc", dns_refresh_s=0.001, health_interval_s=1)
    p = pool(cfg, resolve)

    async def scenario() -> None:
        await p._resolve_members()
        assert {u: w.role for u, w in p.workers.items()} == {
            "http://10.0.0.1:8000": "prefill",
            "http://10.0.0.2:8000": "decode",
            "http://10.0.0.3:8000": "decode",
        }
        p.workers["http://10.0.0.2:8000"].inflight = 3
        answers["dec.svc"] = ["http://10.0.0.2:8000", "http://10.0.0.4:8000"]  # a pod went, one came
        await p._resolve_members()
        assert sorted(p.workers) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.4:8000"]
        assert p.workers["http://10.0.0.2:8000"].inflight == 3
        del answers["pre.svc"]  # a failed lookup keeps the last known list
        await p._resolve_members()
        assert "http://10.0.0.1:8000" in p.workers
        await p.client.aclose()

    asyncio.run(scenario())


def test_resolve_service_returns_urls_for_every_address() -> None:
    urls = asyncio.run(resolve_service("localhost", 8000))
    assert "http://127.0.0.1:8000" in urls or "http://[::1]:8000" in urls


def _collect(*lines: str) -> list[dict]:
    """The events of ``lines`` fed in one piece; fed split at every byte they are the same."""
    raw = "".join(line + "\n" for line in lines).encode()
    whole = SSEEvents("http://w")
    events = whole.feed(raw)
    for cut in range(len(raw) + 1):
        split = SSEEvents("http://w")
        assert split.feed(raw[:cut]) + split.feed(raw[cut:]) == events
        assert (split.done, repr(split.error)) == (whole.done, repr(whole.error))
    if whole.error is not None:
        raise whole.error
    if not whole.done:
        raise UpstreamError("stream", "closed before [DONE]", url="http://w")
    return events


def test_sse_events_until_done_errors_raise() -> None:
    assert _collect('data: {"token_ids": [1]}', "", ": comment", 'data: {"token_ids": []}', "data: [DONE]", 'data: {"never": 1}') == [
        {"token_ids": [1]},
        {"token_ids": []},
    ]
    assert _collect('data: {"token_ids": [1]}\r', "\r", "data:[DONE]") == [{"token_ids": [1]}]  # CRLF, no space
    events = SSEEvents("http://w")
    assert events.feed(b'data: {"token_ids": [1]}\n\ndata: {"error": {"message": "oom", "type": "server_error"}}\n') == [
        {"token_ids": [1]}
    ]  # the events before an error are delivered; the error is left to raise
    assert events.error is not None and events.error.kind == "worker_error" and "oom" in events.error.message
    with pytest.raises(UpstreamError) as err:
        _collect('data: {"token_ids": [1]}', 'data: {"error": {"message": "oom", "type": "server_error"}}')
    assert err.value.kind == "worker_error" and "oom" in err.value.message
    with pytest.raises(UpstreamError, match="before \\[DONE\\]"):
        _collect('data: {"token_ids": [1]}')
    with pytest.raises(UpstreamError, match="malformed"):
        _collect("data: {nope")


@pytest.mark.parametrize("data", ['{"token_ids": [1]} x', '{"token_ids": [1]}{"token_ids": [2]}', "[1]", "5", '"text"', ""])
def test_sse_event_that_is_not_exactly_one_object_is_malformed(data: str) -> None:
    events = SSEEvents("http://w")
    assert events.feed(f'data: {{"token_ids": [7]}}\ndata: {data}\ndata: {{"token_ids": [8]}}\n'.encode()) == [
        {"token_ids": [7]}
    ]  # the events before it are delivered, none after
    assert events.error is not None and events.error.kind == "stream" and "malformed" in events.error.message


def test_sse_event_with_invalid_utf8_is_malformed() -> None:
    events = SSEEvents("http://w")
    assert events.feed(b'data: {"text": "\xff"}\n') == []
    assert events.error is not None and "malformed" in events.error.message
    assert SSEEvents("http://w").feed('data: {"text": "é ☃"}\n'.encode()) == [{"text": "é ☃"}]


@pytest.mark.parametrize("runs", [[], [(1, 0)], [(3, 5), (4, 55), (10, 5)], [(0, 7), (2, 1), (2, 9), (5, 12)]])
def test_runs_json_is_the_json_of_the_expanded_runs(runs: list[tuple[int, int]]) -> None:
    text = runs_json(runs)
    assert json.loads(text) == expand_runs(runs)
    assert text == json.dumps(expand_runs(runs), separators=(",", ":"))


def test_encode_body_splices_raw_values_and_equals_the_plain_encoding() -> None:
    tags = [3, 3, 3, 10, 10, 4]
    plain = {"request_id": "r", "input_ids": [1, 2, 3, 4, 5, 6], "sampling": {"max_tokens": 2}, "tags": tags}
    raw = dict(plain, tags=RawJson(runs_json([(3, 3), (5, 10), (6, 4)])))
    assert json.loads(encode_body(raw)) == plain
    assert json.loads(encode_body(plain)) == plain
    assert json.loads(encode_body({"tags": RawJson("[1,2]")})) == {"tags": [1, 2]}  # nothing but raw values


def test_a_worker_leaves_the_rotation_after_ready_misses_in_a_row_or_at_once_on_a_refusal() -> None:
    from kvserving.gateway.workers import READY_MISSES, WorkerState

    assert READY_MISSES == 2
    w = WorkerState("http://w", "decode")
    seen = []
    for outcome in (True, None, True, None, None, None, True, False, None, True):
        w.polled(outcome)
        seen.append((w.healthy, w.misses))
    assert seen == [(True, 0), (True, 1), (True, 0), (True, 1), (False, 2), (False, 3), (True, 0), (False, 0), (False, 1), (True, 0)]


def ready_server(plan: list[str]):  # type: ignore[no-untyped-def]
    """A handler for ``asyncio.start_server`` whose /ready answers by ``plan``, one step per poll:
    "200", "503", or "hang" (no answer: the gateway gives up on the poll)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /ready ")
                step = plan.pop(0)
                if step == "hang":
                    await reader.read()  # a poll the gateway gives up on: it closes the connection
                    return
                status = b"200 OK" if step == "200" else b"503 Service Unavailable"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


async def poll_servers(plans: list[list[str]], rounds: int) -> list[list[bool]]:
    """Decode workers whose /ready answers by ``plans`` (one each), polled ``rounds`` times:
    each worker's health after each round."""
    servers = [await asyncio.start_server(ready_server(plan), "127.0.0.1", 0) for plan in plans]
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    client = WorkerClient(request_timeout_s=5, connect_timeout_s=0.5)
    p = WorkerPool(GatewayConfig(decode_urls=tuple(urls)), client)
    seen: list[list[bool]] = [[] for _ in urls]
    try:
        for _ in range(rounds):
            await p.refresh()
            for i, url in enumerate(urls):
                seen[i].append(p.workers[url].healthy)
    finally:
        await client.aclose()
        for s in servers:
            s.close()
    assert all(plan == [] for plan in plans)
    return seen


def test_one_unanswered_ready_poll_keeps_a_worker_two_in_a_row_take_it_out_a_503_at_once() -> None:
    """Two workers on real HTTP servers; the first answers 200, then not in time (twice), then 200,
    then 503, while the second answers every poll."""
    seen = asyncio.run(poll_servers([["200", "hang", "hang", "200", "503"], ["200"] * 5], 5))
    assert seen == [[True, True, False, True, False], [True] * 5]


def test_the_last_worker_of_a_role_stays_in_the_rotation_while_silent_but_not_when_it_refuses() -> None:
    """A lone worker that misses polls (busy: a saturated GPU worker answers late) stays routable;
    its 503 still takes it out. Of two silent workers, one stays."""
    assert asyncio.run(poll_servers([["200", "hang", "hang", "hang", "200", "503"]], 6)) == [[True, True, True, True, True, False]]
    both_silent = asyncio.run(poll_servers([["200", "hang", "hang"], ["200", "hang", "hang"]], 3))
    assert [s[:2] for s in both_silent] == [[True, True]] * 2 and sorted(s[2] for s in both_silent) == [False, True]


def test_a_deadline_takes_a_worker_out_only_while_another_can_do_its_part() -> None:
    p = pool(GatewayConfig(prefill_urls=("http://p1", "http://p2"), decode_urls=("http://d",)))
    for w in p.workers.values():
        w.healthy = True
    assert p.take_out("http://d", refused=False) is False and p.workers["http://d"].healthy  # the lone decode worker
    assert p.take_out("http://p1", refused=False) is True and not p.workers["http://p1"].healthy
    assert p.take_out("http://p2", refused=False) is False and p.workers["http://p2"].healthy  # now the last prefill
    assert p.take_out("http://p2", refused=True) is True and not p.workers["http://p2"].healthy  # it said it cannot serve
    assert p.take_out("http://d", refused=True) is True
    assert p.take_out("http://unknown", refused=True) is False


def test_a_worker_fits_a_request_by_the_capacity_its_ready_answer_told() -> None:
    from kvserving.gateway.workers import WorkerState

    w = WorkerState("http://w", "decode")
    assert w.fits(10_000, 10_000)  # nothing told yet: assumed to fit (the worker's own check still runs)
    w.polled(True, {"ready": True, "max_model_len": 1024, "kv_capacity_tokens": 400})
    assert w.capacity == (1024, 400)
    # the worker's admission check: prompt < max_model_len, min(prompt + max_tokens, max_model_len) <= pool
    assert [w.fits(p, m) for p, m in ((392, 8), (393, 8), (1023, 1), (1024, 1))] == [True, False, False, False]
    w.polled(True, {"ready": True, "max_model_len": 1024, "kv_capacity_tokens": 4096})
    assert [w.fits(p, m) for p, m in ((636, 8), (1000, 5000), (1024, 1))] == [True, True, False]
    w.polled(True, {"ready": True})  # an answer without the fields keeps what was told
    assert w.capacity == (1024, 4096)


def test_with_every_worker_of_a_role_out_the_one_that_answered_last_is_the_fallback() -> None:
    p = pool(GatewayConfig(prefill_urls=("http://p",), decode_urls=("http://d1", "http://d2")))
    assert p.fallback(("decode", "both")) is None  # nothing ever answered
    for url in ("http://p", "http://d2", "http://d1"):  # d1 answers last
        p.workers[url].polled(True)
    for w in p.workers.values():
        w.healthy = False  # out for silence
    assert [p.fallback(("decode", "both")), p.fallback(("prefill", "both"))] == [p.workers["http://d1"], p.workers["http://p"]]
    assert p.take_out("http://d1", refused=True)  # refused its connection: not reachable
    assert p.fallback(("decode", "both")) == p.workers["http://d2"]
    p.workers["http://d2"].polled(False)  # answered not ready
    assert p.fallback(("decode", "both")) is None
    p.workers["http://d1"].polled(True)  # back
    assert p.fallback(("decode", "both")) == p.workers["http://d1"]


def test_the_poll_loop_runs_its_first_poll_an_interval_after_start_not_at_once() -> None:
    """The gateway's startup runs the first poll, then ``start``: the loop's next poll comes
    ``health_interval_s`` later, so a worker that stops being ready just after the first poll stays
    in the rotation until then (a second poll at once would have raced the first's answers)."""

    async def main() -> None:
        plan = ["200", "503"]  # the poll at startup, then the loop's first
        server = await asyncio.start_server(ready_server(plan), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = WorkerClient(request_timeout_s=5, connect_timeout_s=0.5)
        p = WorkerPool(GatewayConfig(decode_urls=(url,), health_interval_s=2.0), client)
        try:
            await p.refresh()
            p.start()
            await asyncio.sleep(0.1)  # far inside the interval: no poll yet
            assert plan == ["503"] and p.workers[url].healthy
            deadline = asyncio.get_running_loop().time() + 30.0
            while p.workers[url].healthy:  # the poll an interval later sees the 503
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
            assert plan == [] and p.workers[url].refused
        finally:
            await p.stop()
            await client.aclose()
            server.close()

    asyncio.run(main())

"""The worker's internal plane on a real uvicorn socket: every ``/internal/*``
route needs the deployment's credential (401 with a fixed body otherwise), the
probes and /metrics stay open and name no conversation, a request body cannot
make the worker connect anywhere but to the deployment's workers, a frozen peer
costs a bounded wait and a recompute, holds are capped by
``security.max_hold_s``, bodies are counted while read (chunked too), and the
gateway's worker client carries the credential."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from live_worker import Live, start_live, stop_live

from kvserving.config import GatewayConfig, KVCacheConfig, ModelConfig, ReuseConfig, SecurityConfig, ServingConfig
from kvserving.gateway.workers import UpstreamError, WorkerClient
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.leases import lease_digest
from kvserving.worker.kv.page_pool import chain_hashes
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.service import WorkerService

UNAUTHORIZED = {"error": {"message": "missing or invalid internal credential", "type": "authentication_error", "code": "unauthorized"}}
MAX_HOLD_S = 5.0
PEER_TIMEOUT_S = 0.5  # reuse.peer_timeout_s: half the default


class Listener:
    """A TCP socket on loopback that accepts and records every connection and the request
    head sent on it, and never answers (a frozen peer, or an address a request names)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.heads: list[bytes] = []
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.conns.append(conn)
            conn.settimeout(5)
            head = b""
            try:
                while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                    head += chunk
            except OSError:
                pass
            self.heads.append(head)

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.sock.close()


@pytest.fixture(scope="module")
def frozen() -> Iterator[Listener]:
    peer = Listener()
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path, frozen: Listener) -> ServingConfig:
    return ServingConfig(
        model=ModelConfig(path=str(tiny_model_dir), max_model_len=512),
        kv_cache=KVCacheConfig(dtype="bf16", memory_bytes=4 << 20),
        gateway=GatewayConfig(decode_urls=(frozen.url,)),  # the deployment's other worker: frozen
        security=SecurityConfig(max_hold_s=MAX_HOLD_S),
        reuse=ReuseConfig(peer_timeout_s=PEER_TIMEOUT_S),
    )


def stream(live: Live, body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    r = httpx.post(live.url + "/internal/generate", json=body, headers=live.headers, timeout=60)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    return [t for e in events for t in e["token_ids"]], events[-1]


def fallbacks(live: Live, reason: str) -> float:
    for line in httpx.get(live.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'kvserving_worker_kv_reuse_fallbacks_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no fallback counter for {reason}")


# (method, path template, path, JSON body, status with the right token)
ROUTES: list[tuple[str, str, str, Any, int]] = [
    (
        "POST",
        "/internal/generate",
        "/internal/generate",
        {"request_id": "auth", "input_ids": [1, 2, 3], "sampling": {"max_tokens": 2}},
        200,
    ),
    ("GET", "/internal/kv/stats", "/internal/kv/stats", None, 200),
    ("GET", "/internal/kv/agent", "/internal/kv/agent", None, 200),
    ("GET", "/internal/kv/leases", "/internal/kv/leases", None, 200),
    ("POST", "/internal/kv/leases/{lease_id}/renew", "/internal/kv/leases/nope/renew", {"ttl_s": 5}, 404),
    ("POST", "/internal/kv/leases/{lease_id}/hold", "/internal/kv/leases/nope/hold", {"digest": "d", "hold_s": 1}, 404),
    ("DELETE", "/internal/kv/leases/{lease_id}", "/internal/kv/leases/nope", None, 404),
    ("GET", "", "/internal/not-a-route", None, 404),  # unknown /internal paths are behind the gate too
]
BAD_AUTH = {
    "none": {},
    "wrong token": {"Authorization": "Bearer not-the-token"},
    "scheme only": {"Authorization": "Bearer"},
}


def test_the_route_table_covers_every_internal_route(live: Live) -> None:
    app = live.server.config.app
    served = {(m, r.path) for r in app.routes if r.path.startswith("/internal") for m in r.methods - {"HEAD"}}
    assert served == {(m, t) for m, t, _, _, _ in ROUTES if t}


@pytest.mark.parametrize("auth", list(BAD_AUTH), ids=list(BAD_AUTH))
@pytest.mark.parametrize(("method", "template", "path", "body", "status"), ROUTES, ids=[r[2] for r in ROUTES])
def test_every_internal_route_is_401_without_the_token_and_answers_with_it(
    live: Live, auth: str, method: str, template: str, path: str, body: Any, status: int
) -> None:
    headers = dict(BAD_AUTH[auth])
    if auth == "wrong token":  # the right token under another scheme, or with a byte added, is no better
        for bad in (f"Basic {live.token}", f"Bearer {live.token}x", live.token):
            r = httpx.request(method, live.url + path, json=body, headers={"Authorization": bad}, timeout=10)
            assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
    r = httpx.request(method, live.url + path, json=body, headers=headers, timeout=10)
    assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
    assert r.headers["www-authenticate"] == "Bearer"
    ok = httpx.request(method, live.url + path, json=body, headers=live.headers, timeout=60)
    assert ok.status_code == status, ok.text


def test_probes_and_metrics_stay_open_and_name_no_conversation_or_user(live: Live) -> None:
    _, final = stream(
        live,
        {
            "request_id": "alice-1",
            "input_ids": list(range(100, 150)),
            "retain": True,
            "conversation_key": "user:alice@example.com",
            "sampling": {"max_tokens": 3},
        },
    )
    lease = final["kv_transfer_params"]["lease_id"]
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(live.url + path, timeout=10).status_code == 200, path
    text = httpx.get(live.url + "/metrics", timeout=10).text
    assert "kvserving_worker_kv_leases 1.0" in text  # the lease is counted, never named
    assert "alice" not in text and "user:" not in text and lease not in text
    assert httpx.delete(f"{live.url}/internal/kv/leases/{lease}", headers=live.headers, timeout=10).status_code == 200


def _params(live: Live, prompt: list[int], *, agent_url: str, engine_id: str) -> dict[str, Any]:
    """kv_transfer_params of a lease on ``agent_url`` holding ``prompt``'s first 5 pages, worth
    pulling (this pool's layout, matching hashes, 80 tokens over the 64-token threshold)."""
    agent = httpx.get(live.url + "/internal/kv/agent", headers=live.headers, timeout=10).json()
    return {
        "engine_id": engine_id,
        "agent_url": agent_url,
        "lease_id": "kv-1-0123456789abcdef",
        "page_ids": [0, 1, 2, 3, 4],
        "page_hashes": chain_hashes(prompt[:80], 16),
        "num_tokens": 80,
        "page_size": 16,
        "dtype": "bf16",
        "layout_hash": agent["layout_hash"],
        "expires_at": time.time() + 60,
    }


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_an_agent_url_outside_the_deployment_is_never_contacted(live: Live, config: ServingConfig, host: str) -> None:
    """SSRF: the URL a request body names is no worker of this deployment. The request runs,
    recomputing (fallback ``unknown_peer``, counted), and nothing connects to the address."""
    target = Listener()
    try:
        prompt = list(range(400, 500)) if host == "127.0.0.1" else list(range(700, 800))
        want = LLMEngine(config).generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        before = fallbacks(live, "unknown_peer")
        url = target.url.replace("127.0.0.1", host)
        tokens, final = stream(
            live,
            {
                "request_id": f"ssrf-{host}",
                "input_ids": prompt,
                "sampling": {"max_tokens": 4, "ignore_eos": True},
                "kv_transfer_params": _params(live, prompt, agent_url=url, engine_id="w-elsewhere"),
            },
        )
        assert tokens == want
        u = final["usage"]
        assert (u["reuse_fallback"], u["remote_pulled_tokens"], u["computed_prompt_tokens"]) == ("unknown_peer", 0, 100)
        assert fallbacks(live, "unknown_peer") == before + 1
        time.sleep(0.5)  # a connection attempt, had there been one, has arrived by now
        assert target.heads == [] and target.conns == []
    finally:
        target.close()


def test_a_frozen_peer_costs_a_bounded_wait_then_a_recompute(live: Live, config: ServingConfig, frozen: Listener) -> None:
    """The lease holder (a worker of the deployment) accepts and never answers: the pull gives
    up after its HTTP deadline, ``reuse.peer_timeout_s`` (``remote_unreachable``, counted) and the request recomputes the
    tokens of a fault-free run. The peer call carried the internal credential."""
    prompt = list(range(500, 600))
    want = LLMEngine(config).generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    before = fallbacks(live, "remote_unreachable")
    t0 = time.monotonic()
    tokens, final = stream(
        live,
        {
            "request_id": "frozen",
            "input_ids": prompt,
            "sampling": {"max_tokens": 4, "ignore_eos": True},
            "kv_transfer_params": _params(live, prompt, agent_url=frozen.url, engine_id="w-frozen"),
        },
    )
    wall = time.monotonic() - t0
    assert tokens == want and final["usage"]["reuse_fallback"] == "remote_unreachable"
    assert fallbacks(live, "remote_unreachable") == before + 1
    assert PEER_TIMEOUT_S <= wall < 2 * PEER_TIMEOUT_S + 5, wall
    # the agent fetch is the call that waited, for reuse.peer_timeout_s (not the 1 s default)
    assert PEER_TIMEOUT_S <= final["timings"]["pull_contact_agent"] / 1e3 < PEER_TIMEOUT_S + 0.45, final["timings"]
    assert frozen.heads and frozen.heads[0].startswith(b"GET /internal/kv/agent HTTP/1.1\r\n")
    assert f"authorization: bearer {live.token}\r\n".lower().encode() in frozen.heads[0].lower()


def test_a_hold_is_capped_by_max_hold_s(live: Live) -> None:
    _, final = stream(
        live,
        {
            "request_id": "hold-1",
            "input_ids": list(range(600, 650)),
            "retain": True,
            "conversation_key": "hold",
            "sampling": {"max_tokens": 2},
        },
    )
    p = final["kv_transfer_params"]
    digest = lease_digest(p["page_ids"], p["page_hashes"], p["num_tokens"])
    t0 = time.time()
    r = httpx.post(
        f"{live.url}/internal/kv/leases/{p['lease_id']}/hold", json={"digest": digest, "hold_s": 3600}, headers=live.headers, timeout=10
    )
    assert r.status_code == 200, r.text
    assert t0 + MAX_HOLD_S - 1 < r.json()["expires_at"] <= time.time() + MAX_HOLD_S + 0.5
    for lid in (r.json()["hold_id"], p["lease_id"]):
        assert httpx.delete(f"{live.url}/internal/kv/leases/{lid}", headers=live.headers, timeout=10).status_code == 200


@pytest.fixture(scope="module")
def small_body(config: ServingConfig) -> Iterator[Live]:
    """A worker whose body limit is 1 KiB (its engine never starts: the gate answers first)."""

    async def no_engine(_: WorkerService) -> None:
        return None

    w = start_live(config, startup=no_engine, wait_ready=False, max_body_bytes=1024)
    try:
        yield w
    finally:
        stop_live(w)


def test_a_chunked_body_over_the_limit_gets_413_before_its_end_and_the_connection_closes(small_body: Live) -> None:
    host, port = small_body.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /internal/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + small_body.token.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(2):  # 1,600 bytes, and the body never ends (no last chunk)
            sock.sendall(b"320\r\n" + b" " * 800 + b"\r\n")
        reply = b""
        while chunk := sock.recv(65536):  # until the worker closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413")
    assert reply.endswith(b'{"error":{"message":"request body over 1024 bytes","type":"invalid_request_error","code":null}}')


def test_a_chunked_body_under_the_limit_reaches_the_route_and_one_without_the_token_does_not(small_body: Live) -> None:
    body = json.dumps({"request_id": "c", "input_ids": list(range(100))}).encode()
    assert 300 < len(body) < 1024

    def chunks() -> Iterator[bytes]:
        yield body[:200]
        yield body[200:]

    r = httpx.post(
        small_body.url + "/internal/generate",
        content=chunks(),
        timeout=10,
        headers={"content-type": "application/json", **small_body.headers},
    )
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert (r.status_code, r.json()["error"]["message"]) == (503, "worker is starting")  # the route's own answer
    r = httpx.post(small_body.url + "/internal/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=10)
    assert (r.status_code, r.json()) == (401, UNAUTHORIZED)


def test_the_gateways_worker_client_sends_the_token_on_every_call(live: Live) -> None:
    async def run() -> None:
        good = WorkerClient(request_timeout_s=60, connect_timeout_s=2, token=live.token)
        bad = WorkerClient(request_timeout_s=60, connect_timeout_s=2, token="wrong")
        body = {"request_id": "gw", "input_ids": [5, 6, 7], "sampling": {"max_tokens": 2, "ignore_eos": True}}
        try:
            events = [e async for batch in good.generate(live.url, body) for e in batch]
            assert events[-1]["finish_reason"] == "length"
            assert await good.find_leases(live.url, conversation_key="nobody") == []
            assert await good.renew_lease(live.url, "nope", ttl_s=5) is None  # 404: reached the route
            assert await good.release_lease(live.url, "nope") is False
            with pytest.raises(UpstreamError) as refused:
                _ = [e async for batch in bad.generate(live.url, {**body, "request_id": "gw-bad"}) for e in batch]
            assert refused.value.status == 401
            with pytest.raises(aiohttp.ClientResponseError) as listed:
                await bad.find_leases(live.url, conversation_key="nobody")
            assert listed.value.status == 401
        finally:
            await good.aclose()
            await bad.aclose()

    asyncio.run(run())

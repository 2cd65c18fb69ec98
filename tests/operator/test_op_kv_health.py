"""KV health in the KVServing status: the pure summary and verdicts, the
status it produces (valid against the CRD), and the sampler against real HTTP
worker endpoints (a dead one, a frozen one) behind the in-memory API server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kvs_crd_tools import apply_defaults, load_sample, openapi_errors, root_schema, unknown_fields
from kvs_fake_api import FakeApiServer

from kvserving.operator.kube import KubeApi
from kvserving.operator.kv_health import kv_degraded, summarize
from kvserving.operator.kv_sampler import http_fetcher, pod_stats_url, refresh_kv
from kvserving.operator.reconcile import reconcile


def _stats(
    *,
    capacity: int = 1000,
    used: float = 0.25,
    leases: int = 1,
    leased: int = 64,
    local: int = 0,
    remote: int = 0,
    computed: int = 0,
    fallbacks: dict[str, int] | None = None,
) -> dict[str, Any]:
    return {
        "engine_id": "w",
        "role": "decode",
        "dtype": "nvfp4",
        "page_size": 16,
        "capacity_tokens": capacity,
        "used_ratio": used,
        "pages": {"total": 62, "free": 40, "cached": 6, "owned": 16},
        "pages_by_bits": {"4": 62, "2": 0},
        "leases": leases,
        "leased_tokens": leased,
        "prompt_tokens": {"local": local, "remote": remote, "computed": computed},
        "fallbacks": fallbacks or {},
        "running": 0,
        "waiting": 0,
        "preemptions": 0,
    }


def test_summary_sums_capacity_and_leases_and_takes_the_fullest_pod() -> None:
    kv = summarize(
        {
            "prefill": [_stats(capacity=500, used=0.1)],
            "decode": [_stats(capacity=1000, used=0.5, leases=2, leased=128), _stats(capacity=1000, used=0.75), None],
        },
        previous=None,
    )
    assert kv["prefill"] == {"pods": 1, "reporting": 1, "capacityTokens": 500, "usedRatio": 0.1}
    assert kv["decode"] == {"pods": 3, "reporting": 2, "capacityTokens": 2000, "usedRatio": 0.75}
    assert (kv["activeLeases"], kv["leasedTokens"]) == (4, 256)


def test_reuse_ratio_is_over_the_window_and_restarts_with_a_pod() -> None:
    first = summarize({"prefill": [_stats(local=100, remote=200, computed=700)], "decode": []}, previous=None)
    assert first["reuseRatio"] == 0.3  # first sample: since the pods started
    assert first["window"] == {"reused": 300, "prompt": 1000, "fallbacks": 0}
    second = summarize({"prefill": [_stats(local=100, remote=1100, computed=800)], "decode": []}, previous=first)
    assert second["reuseRatio"] == 0.9  # 900 reused of 1000 new prompt tokens
    restarted = summarize({"prefill": [_stats(local=0, remote=10, computed=90)], "decode": []}, previous=second)
    assert restarted["reuseRatio"] == 0.1  # totals went down: a new window from zero


def test_verdicts_pool_full_then_fallbacks_dominate() -> None:
    full = summarize({"prefill": [], "decode": [_stats(used=0.99)]}, previous=None)
    assert kv_degraded(full) is not None and kv_degraded(full)[0] == "KVPoolFull"  # type: ignore[index]
    failing = summarize(
        {"prefill": [_stats(computed=1000, fallbacks={"transfer_timeout": 2, "lease_expired": 1})], "decode": []}, previous=None
    )
    assert failing["fallbacks"] == {"lease_expired": 1, "transfer_timeout": 2}
    verdict = kv_degraded(failing)
    assert verdict is not None and verdict[0] == "ReuseFallbacksDominate"
    healthy = summarize({"prefill": [_stats(remote=900, computed=100, fallbacks={"hash_mismatch": 5})], "decode": []}, previous=None)
    assert kv_degraded(healthy) is None  # fallbacks, but most prompt tokens still reused


def _body() -> dict[str, Any]:
    body = apply_defaults(root_schema(), load_sample("nvfp4"))
    body["metadata"].update(uid="u1", generation=1, resourceVersion="1")
    return body


def _pod(name: str, role: str, port: int, *, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"app.kubernetes.io/instance": "qwen3-nvfp4", "app.kubernetes.io/component": role},
        },
        "spec": {"containers": [{"name": "worker", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_pod_stats_url_needs_ready_and_an_ip() -> None:
    assert pod_stats_url(_pod("a", "decode", 8123)) == "http://127.0.0.1:8123/internal/kv/stats"
    assert pod_stats_url(_pod("a", "decode", 8123, ready=False)) is None
    ipv6 = _pod("a", "decode", 8000)
    ipv6["status"]["podIP"] = "fd00::5"
    assert pod_stats_url(ipv6) == "http://[fd00::5]:8000/internal/kv/stats"


async def _serve(handler: Any, token: dict[str, str] | None = None) -> tuple[web.AppRunner, int]:
    """A worker's /internal/kv/stats; with ``token`` (filled in later), 401 unless its Bearer token is sent."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        if token is not None and request.headers.get("Authorization") != f"Bearer {token.get('value')}":
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    app = web.Application()
    app.router.add_get("/internal/kv/stats", guarded)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def test_sampler_writes_kv_status_from_real_endpoints_within_its_timeout() -> None:
    async def scenario() -> tuple[dict[str, Any] | None, float]:
        async def decode_stats(request: web.Request) -> web.Response:
            return web.json_response(_stats(capacity=4096, used=0.5, leases=3, leased=512, local=10, remote=80, computed=10))

        async def prefill_stats(request: web.Request) -> web.Response:
            return web.json_response(_stats(capacity=2048, used=0.2, leases=0, leased=0, computed=100))

        async def frozen(request: web.Request) -> web.Response:
            await asyncio.sleep(30)
            return web.json_response({})

        token: dict[str, str] = {}
        servers = [await _serve(h, token) for h in (decode_stats, prefill_stats, frozen)]
        (_, decode_port), (_, prefill_port), (_, frozen_port) = servers
        with socket_closed_port() as dead_port:
            fake = FakeApiServer()
            api = KubeApi(fake)
            body = _body()
            await reconcile(api, body, now="2026-11-30T10:00:00Z")
            # the workers require the KVServing's internal credential; the sampler reads it from the Secret
            token["value"] = fake.secret_value("default", body["metadata"]["name"] + "-internal", "token") or ""
            assert token["value"]
            fake.settle_deployments()
            stored = fake.put_kvserving(body)
            for pod in (
                _pod("d0", "decode", decode_port),
                _pod("d1", "decode", frozen_port),
                _pod("p0", "prefill", prefill_port),
                _pod("p1", "prefill", dead_port),
                _pod("p2", "prefill", prefill_port, ready=False),
            ):
                fake.objects[("", "pods", "default", pod["metadata"]["name"])] = pod
            async with aiohttp.ClientSession() as session:
                start = time.monotonic()
                # 2 s: the live pods answer within it on a stalled machine, the frozen one never does
                written = await refresh_kv(api, stored, http_fetcher(session, timeout_s=2.0))
                elapsed = time.monotonic() - start
        for runner, _ in servers:
            await runner.cleanup()
        return written, elapsed

    written, elapsed = asyncio.run(scenario())
    assert elapsed < 15.0  # the frozen pod (30 s) cost at most its 2 s timeout
    assert written is not None
    kv = written["kv"]
    assert kv["decode"] == {"pods": 2, "reporting": 1, "capacityTokens": 4096, "usedRatio": 0.5}
    assert kv["prefill"] == {"pods": 2, "reporting": 1, "capacityTokens": 2048, "usedRatio": 0.2}
    assert kv["reuseRatio"] == pytest.approx(90 / 200)
    assert (kv["activeLeases"], kv["leasedTokens"]) == (3, 512)
    status_schema = root_schema()["properties"]["status"]
    assert openapi_errors(status_schema, written) == []
    assert unknown_fields(status_schema, written) == []
    degraded = next(c for c in written["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"


class socket_closed_port:
    """A port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_full_decode_pool_degrades_the_kvserving_and_a_plain_refresh_keeps_kv() -> None:
    from kvserving.operator.reconcile import refresh_status

    async def scenario() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        fake = FakeApiServer()
        api = KubeApi(fake)
        body = _body()
        await reconcile(api, body, now="2026-11-30T10:00:00Z")
        fake.settle_deployments()
        stored = fake.put_kvserving(body)
        kv = summarize({"prefill": [], "decode": [_stats(used=0.99)]}, previous=None)
        written = await refresh_status(api, stored, now="2026-11-30T10:00:01Z", kv=kv)
        assert written is not None
        again = fake.put_kvserving({**stored, "status": written})
        # a Deployment event (no kv sample) must not drop the kv status
        kept = await refresh_status(api, again, now="2026-11-30T10:00:02Z")
        return written, kept

    written, kept = asyncio.run(scenario())
    assert written is not None and written["phase"] == "Degraded"
    degraded = next(c for c in written["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "KVPoolFull")
    assert kept is None  # nothing changed: the kv status was carried over, not cleared


def test_sampler_without_the_credential_gets_nothing() -> None:
    """Workers answer 401 to a wrong or missing token: the pod counts as not reporting."""

    async def scenario() -> list[Any]:
        async def stats(request: web.Request) -> web.Response:
            return web.json_response(_stats())

        runner, port = await _serve(stats, {"value": "right"})
        url = f"http://127.0.0.1:{port}/internal/kv/stats"
        async with aiohttp.ClientSession() as session:
            fetch = http_fetcher(session, timeout_s=2.0)
            answers = [await fetch(url, None), await fetch(url, "wrong"), await fetch(url, "right")]
        await runner.cleanup()
        return answers

    missing, wrong, right = asyncio.run(scenario())
    assert (missing, wrong) == (None, None)
    assert right is not None and right["capacity_tokens"] == 1000


def test_stored_bits_are_weighted_by_the_pages_each_pod_holds() -> None:
    def tri(owned: int, cached: int, bits: float | None) -> dict[str, Any]:
        s = _stats()
        s["pages"] = {"total": 100, "free": 100 - owned - cached, "cached": cached, "owned": owned}
        s["stored_bits"] = {"excluded": bits, "included": None if bits is None else bits + 1, "budget": 2.7, "cut": 12.5}
        return s

    # 30 pages at 2.5 and 10 at 3.3 -> (75 + 33) / 40 = 2.7; an empty pod adds nothing
    kv = summarize({"prefill": [tri(20, 10, 2.5)], "decode": [tri(10, 0, 3.3), tri(0, 0, None)]}, previous=None)
    assert (kv["storedBits"], kv["bitBudget"], kv["bits"]) == (2.7, 2.7, "2.70/2.70")
    # formats without the block (or no page held anywhere): no BITS value
    assert "bits" not in summarize({"prefill": [_stats()], "decode": [tri(0, 0, None)]}, previous=None)

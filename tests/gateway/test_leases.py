"""The lease table (pure, clock passed in) and its keeper against a recorded client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvserving.gateway.leases import LeaseKeeper, LeaseTable
from kvserving.gateway.metrics import GatewayMetrics

W1, W2 = "http://w1", "http://w2"


def params(lease_id: str, expires_at: float = 1000.0) -> dict[str, Any]:
    return {"lease_id": lease_id, "expires_at": expires_at, "page_hashes": [1, 2]}


def table(**kw: Any) -> LeaseTable:
    return LeaseTable(lease_ttl_s=kw.get("ttl", 10.0), heartbeat_s=kw.get("beat", 2.0), max_leases=kw.get("max", 100))


def test_sweep_renews_active_releases_idle_forgets_expired() -> None:
    t = table()
    t.put("active", worker_url=W1, params=params("a", expires_at=13.0), now=0.0)
    t.put("idle", worker_url=W1, params=params("i"), now=0.0)
    t.put("expired", worker_url=W2, params=params("e", expires_at=5.0), now=0.0)
    t.put("far", worker_url=W2, params=params("f", expires_at=500.0), now=9.0)
    t.begin_turn("active", now=9.0)  # a turn in flight: never released; its lease ends within 2 beats: renewed
    sweep = t.sweep(now=10.0)
    assert [le.conversation_key for le in sweep.renew] == ["active"]
    assert [le.conversation_key for le in sweep.release] == ["idle"]
    assert [le.conversation_key for le in sweep.expired] == ["expired"]
    assert t.keys() == ["far", "active"] and dict(t.per_worker) == {W1: 1, W2: 1}


def test_an_agent_waiting_on_a_tool_stays_active_for_the_lease_ttl() -> None:
    t = table(ttl=10.0, beat=2.0)
    t.put("c", worker_url=W1, params=params("x", expires_at=6.0), now=0.0)  # a worker with a short retention
    assert t.sweep(now=1.0).renew == []  # 5 s left: more than two beats
    assert [le.lease_id for le in t.sweep(now=2.5).renew] == ["x"]
    t.renewed("c", lease_id="x", expires_at=8.5, now=2.5)  # the worker grants its own (short) TTL
    assert t.sweep(now=3.0).renew == []  # 5.5 s left
    assert [le.lease_id for le in t.sweep(now=7.0).renew] == ["x"]  # idle 7 s < 10: still active, KV kept
    t.renewed("c", lease_id="x", expires_at=14.0, now=7.0)
    assert t.sweep(now=9.9).renew == []  # now outlives the conversation's activity by two beats (0 + 10 + 2 x 2)
    assert [le.lease_id for le in t.sweep(now=10.0).release] == ["x"]
    assert len(t) == 0


def test_a_lease_that_outlives_the_activity_window_is_never_renewed() -> None:
    t = table(ttl=10.0, beat=2.0)
    t.put("c", worker_url=W1, params=params("x", expires_at=14.0), now=0.0)  # retention 14 >= lease TTL 10 + 2 beats
    assert all(t.sweep(now=now).renew == [] for now in (1.0, 5.0, 9.0, 9.99))


def test_a_lease_that_would_end_within_two_beats_of_the_idle_mark_is_renewed_so_the_release_finds_it() -> None:
    t = table(ttl=10.0, beat=2.0)
    t.put("c", worker_url=W1, params=params("x", expires_at=12.0), now=0.0)  # outlives the TTL, not the margin
    assert t.sweep(now=7.9).renew == []  # 4.1 s left: more than two beats
    assert [le.lease_id for le in t.sweep(now=8.5).renew] == ["x"]
    t.renewed("c", lease_id="x", expires_at=20.0, now=8.5)
    sweep = t.sweep(now=10.5)  # a sweep half a beat late still finds the worker's lease: released, not expired
    assert sweep.expired == [] and [le.lease_id for le in sweep.release] == ["x"]


def test_put_returns_the_superseded_lease_and_capacity_evictions() -> None:
    t = table(max=2)
    assert t.put("a", worker_url=W1, params=params("a1"), now=0.0) == []
    replaced = t.put("a", worker_url=W2, params=params("a2"), now=1.0)
    assert [(le.lease_id, le.worker_url) for le in replaced] == [("a1", W1)]
    assert dict(t.per_worker) == {W2: 1}
    t.put("b", worker_url=W1, params=params("b1"), now=2.0)
    evicted = t.put("c", worker_url=W1, params=params("c1"), now=3.0)
    assert [le.conversation_key for le in evicted] == ["a"]  # least recently active first
    assert t.keys() == ["b", "c"]
    assert t.put("c", worker_url=W1, params=params("c1"), now=4.0) == []  # same lease id: nothing to free
    # A new lease on the same worker: the worker already dropped the conversation's older one.
    assert t.put("c", worker_url=W1, params=params("c2"), now=5.0) == []
    assert t.get("c") is not None and t.get("c").lease_id == "c2"  # type: ignore[union-attr]


def test_drop_only_when_the_lease_id_still_matches() -> None:
    t = table()
    t.put("a", worker_url=W1, params=params("new"), now=0.0)
    assert t.drop("a", lease_id="old") is None
    assert t.drop("a", lease_id="new") is not None and len(t) == 0


def test_bad_bounds_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="lease_ttl_s"):
        LeaseTable(lease_ttl_s=0, heartbeat_s=1, max_leases=1)
    with pytest.raises(ValueError, match="max_leases"):
        LeaseTable(lease_ttl_s=1, heartbeat_s=1, max_leases=0)


class RecordingClient:
    def __init__(self, leases: dict[str, list[dict[str, Any]]]) -> None:
        self.leases = leases  # url -> what GET /internal/kv/leases answers
        self.calls: list[tuple[str, ...]] = []
        self.known: set[str] = {"x", "y"}

    async def find_leases(self, url: str, *, conversation_key: str) -> list[dict[str, Any]]:
        self.calls.append(("find", url, conversation_key))
        if url == "http://down":
            raise OSError("unreachable")
        return [e for e in self.leases.get(url, []) if e["conversation_key"] == conversation_key]

    async def renew_lease(self, url: str, lease_id: str, *, ttl_s: float) -> float | None:
        self.calls.append(("renew", url, lease_id))
        return 777.0 if lease_id in self.known else None

    async def release_lease(self, url: str, lease_id: str) -> bool:
        self.calls.append(("release", url, lease_id))
        return lease_id in self.known  # False: the worker answered 404 (it had let the lease go)


def keeper(client: RecordingClient, now: list[float]) -> tuple[LeaseKeeper, GatewayMetrics]:
    metrics = GatewayMetrics(CollectorRegistry())
    k = LeaseKeeper(table(ttl=10.0, beat=2.0), client, retention_ttl_s=60.0, events=metrics, clock=lambda: now[0])
    return k, metrics


def sample(m: GatewayMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    return m.registry.get_sample_value(name, labels or {}) or 0.0


def test_a_miss_asks_the_decode_workers_and_takes_the_latest_unexpired_lease() -> None:
    def entry(lid: str, exp: float) -> dict[str, object]:
        return {"lease_id": lid, "conversation_key": "k", "expires_at": exp, "kv_transfer_params": params(lid, exp)}

    client = RecordingClient({W1: [entry("old", 50.0)], W2: [entry("new", 90.0), entry("gone", 5.0)]})
    now = [10.0]
    k, m = keeper(client, now)
    lease = asyncio.run(k.lookup("k", decode_urls=[W1, W2, "http://down"]))
    assert lease is not None and (lease.worker_url, lease.lease_id) == (W2, "new")
    assert asyncio.run(k.lookup("k", decode_urls=[W1, W2])) is lease  # now cached: no more calls
    assert [c for c in client.calls if c[0] == "find"] == [("find", W1, "k"), ("find", W2, "k"), ("find", "http://down", "k")]
    assert asyncio.run(k.lookup("other", decode_urls=[W1])) is None
    assert sample(m, "kvserving_gateway_lease_lookups_total", {"result": "hit"}) == 1
    assert sample(m, "kvserving_gateway_lease_lookups_total", {"result": "miss"}) == 1


def test_heartbeat_renews_releases_and_counts() -> None:
    client = RecordingClient({})
    now = [0.0]
    k, m = keeper(client, now)

    async def scenario() -> None:
        await k.record("a", worker_url=W1, params=params("x", expires_at=5.0))
        await k.record("b", worker_url=W1, params=params("y", expires_at=5.0))
        await k.record("c", worker_url=W2, params=params("z", expires_at=5.0))  # the worker will not know "z"
        now[0] = 3.0
        await k.run_once()  # all three within two beats of their expiry
        now[0] = 11.0
        await k.record("a", worker_url=W1, params=params("x", expires_at=14.0))  # "a" had a new turn: active
        now[0] = 13.5
        await k.run_once()

    asyncio.run(scenario())
    assert client.calls == [
        ("renew", W1, "x"),
        ("renew", W1, "y"),
        ("renew", W2, "z"),
        ("release", W1, "y"),
        ("renew", W1, "x"),
    ]
    assert k.table.keys() == ["a"] and k.table.get("a").expires_at == 777.0  # type: ignore[union-attr]
    assert sample(m, "kvserving_gateway_lease_renewals_total") == 3
    assert sample(m, "kvserving_gateway_lease_releases_total") == 1
    assert sample(m, "kvserving_gateway_lease_expiries_total") == 1
    assert sample(m, "kvserving_gateway_leases") == 1


def test_keeper_loop_stops_cleanly_and_its_last_sweep_frees_only_idle_leases() -> None:
    client = RecordingClient({})
    now = [0.0]
    k, _ = keeper(client, now)

    async def scenario() -> None:
        k.start()
        await k.record("idle", worker_url=W1, params=params("x"))
        now[0] = 10.0
        await k.record("active", worker_url=W1, params=params("y"))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(k.stop(final_sweep=True), timeout=2)
        assert k._task is None

    asyncio.run(scenario())
    # the active conversation's KV stays: another gateway replica may be serving it now
    assert [c for c in client.calls if c[0] == "release"] == [("release", W1, "x")]
    assert k.table.keys() == ["active"]


def test_the_keeper_releases_the_leases_of_evicted_records_and_the_gauge_counts_live_leases() -> None:
    client = RecordingClient({})
    now = [0.0]
    k, m = keeper(client, now)
    k.table.store.max_conversations = 3

    async def scenario() -> None:
        await k.record("a", worker_url=W1, params=params("x", expires_at=100.0))
        await k.record("b", worker_url=W1, params=params("y", expires_at=3.0))
        k.table.store.open("c", scope="")
        await k.record("d", worker_url=W2, params=params("z", expires_at=100.0))  # four records: "a"'s is evicted
        now[0] = 4.0
        await k.run_once()  # "b" expired on its worker at 3: forgotten, not counted

    asyncio.run(scenario())
    assert [c for c in client.calls if c[0] == "release"] == [("release", W1, "x")]
    assert sample(m, "kvserving_gateway_lease_releases_total") == 1
    assert sample(m, "kvserving_gateway_lease_expiries_total") == 1
    assert sample(m, "kvserving_gateway_leases") == 1 and k.table.keys() == ["d"]


def test_a_release_the_worker_no_longer_knows_counts_as_an_expiry() -> None:
    client = RecordingClient({})
    client.known = {"x"}
    now = [0.0]
    k, m = keeper(client, now)

    async def scenario() -> None:
        await k.record("a", worker_url=W1, params=params("x", expires_at=500.0))
        await k.record("b", worker_url=W2, params=params("gone", expires_at=500.0))  # the worker dropped it already
        now[0] = 11.0  # both idle past the 10 s TTL
        await k.run_once()

    asyncio.run(scenario())
    assert sorted(c for c in client.calls if c[0] == "release") == [("release", W1, "x"), ("release", W2, "gone")]
    assert k.table.keys() == []
    assert sample(m, "kvserving_gateway_lease_releases_total") == 1
    assert sample(m, "kvserving_gateway_lease_expiries_total") == 1

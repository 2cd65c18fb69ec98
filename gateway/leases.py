"""The lease table: which decode worker holds each conversation's KV, and its
last ``kv_transfer_params`` (DESIGN.md, Gateway).

The decode workers are the authority on what they retain; this table is a
cache of them (``GET /internal/kv/leases?conversation_key=K``):

- a miss asks the decode workers (``LeaseKeeper.lookup``), so a second gateway
  replica, or this one after a restart, routes a conversation to its KV;
- an entry is *active* while a turn is in flight or its last turn ended less
  than ``lease_ttl_s`` ago (an agent waiting on a tool stays active); an
  active entry whose worker lease would end before that (and within two
  heartbeats) is renewed on its worker. Each turn's new lease runs for the
  retention TTL > lease TTL, so renewals are rare: a turn still running long
  after the previous one, or a worker configured with a shorter retention;
- an entry idle past ``lease_ttl_s`` is released (DELETE on the worker) and
  dropped; an entry whose worker lease expired, or that the worker no longer
  knows (404 on renew), is dropped as an expiry;
- the table holds at most ``max_leases`` entries: beyond that the least
  recently active idle entry is released first; a conversation record the
  store evicts has its lease released too.

A lease is its conversation record's ``lease`` field (conversations.py): the
table is the lease policy over the store's records, active meaning a turn in
flight (``Conversation.active``). ``LeaseTable`` is pure (clock passed in);
``LeaseKeeper`` runs the heartbeat loop against a ``LeaseClient`` (the workers
module) and stops cleanly, and sets the leases gauge to the leases that are
live (not past their worker's expiry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .conversations import Conversation, Conversations, Lease

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Sweep:
    """What the heartbeat must do now: renew, release (idle) and forget (expired)."""

    renew: list[Lease] = field(default_factory=list)
    release: list[Lease] = field(default_factory=list)
    expired: list[Lease] = field(default_factory=list)


class LeaseTable:
    """The leases of a conversation store's records, ordered by last activity (oldest first)."""

    def __init__(self, store: Conversations | None = None, *, lease_ttl_s: float, heartbeat_s: float, max_leases: int) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        if max_leases < 1:
            raise ValueError(f"max_leases must be >= 1, got {max_leases}")
        self.store = store if store is not None else Conversations()
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_s = heartbeat_s
        self.max_leases = max_leases

    def __len__(self) -> int:
        return self.store.lease_count

    @property
    def per_worker(self) -> Counter[str]:
        """worker URL -> leases on it."""
        return self.store.per_worker

    def get(self, key: str) -> Lease | None:
        conv = self.store.get(key)
        return conv.lease if conv is not None else None

    def keys(self) -> list[str]:
        return [conv.key for conv in self.store.leased()]

    def live(self, *, now: float) -> int:
        """Leases not past their worker's expiry (unknown expiry counts as live)."""
        return sum(1 for conv in self.store.leased() if conv.lease is not None and not 0 < conv.lease.expires_at <= now)

    def begin_turn(self, key: str, *, now: float) -> None:
        """A turn of this conversation starts: it is active (never released mid-turn)."""
        self.store.begin_turn(self.store.open(key, scope=""), now=now)

    def end_turn(self, key: str, *, now: float) -> None:
        conv = self.store.get(key)
        if conv is not None:
            self.store.end_turn(conv, now=now)

    def put(self, key: str, *, worker_url: str, params: dict[str, Any], now: float) -> list[Lease]:
        """Record the decode's new params; returns entries evicted to stay within ``max_leases``
        (and the replaced entry if the conversation moved to another worker), which the caller releases."""
        conv = self.store.open(key, scope="")
        old = conv.lease
        replaced: list[Lease] = []
        # Superseded on another worker: free the old pins there. A worker itself keeps only a
        # conversation's newest lease, so one replaced on the same worker is already gone
        # (releasing it anyway cost an HTTP round trip per turn on both sides).
        if old is not None and old.lease_id and old.lease_id != str(params.get("lease_id", "")) and old.worker_url != worker_url:
            replaced.append(old)
        self.store.set_lease(conv, Lease(key, worker_url, _kept(params), now, now))
        return replaced + self._evict_over_capacity(keep=conv)

    def remember(self, key: str, *, worker_url: str, params: dict[str, Any], now: float) -> None:
        """Cache what a worker reported for ``key`` (a lookup after a miss); not activity."""
        conv = self.store.open(key, scope="")
        if conv.lease is None:
            self.store.set_lease(conv, Lease(key, worker_url, _kept(params), now, now))

    def drop(self, key: str, *, lease_id: str | None = None) -> Lease | None:
        """Forget ``key``'s lease (only if it still has ``lease_id``, when given)."""
        conv = self.store.get(key)
        lease = conv.lease if conv is not None else None
        if conv is None or lease is None or (lease_id is not None and lease.lease_id != lease_id):
            return None
        self.store.set_lease(conv, None)
        return lease

    def renewed(self, key: str, *, lease_id: str, expires_at: float, now: float) -> None:
        lease = self.get(key)
        if lease is not None and lease.lease_id == lease_id:
            lease.set_expiry(expires_at)
            lease.last_renewed = now

    def sweep(self, *, now: float) -> Sweep:
        """Classify every lease; removes the released and expired ones from their records."""
        out = Sweep()
        done: list[Conversation] = []
        for conv in self.store.leased():
            lease = conv.lease
            assert lease is not None
            if conv.active == 0 and lease.expires_at and lease.expires_at <= now:
                out.expired.append(lease)
                done.append(conv)
            elif conv.active == 0 and now - lease.last_active >= self.lease_ttl_s:
                out.release.append(lease)
                done.append(conv)
            elif self._needs_renewal(lease, now=now):
                out.renew.append(lease)
        for conv in done:
            self.store.set_lease(conv, None)
        return out

    def _needs_renewal(self, lease: Lease, *, now: float) -> bool:
        """The worker would drop the KV before the gateway's release reaches it, and that is
        within two heartbeats. The release goes out at the first sweep past the lease TTL, so
        the worker's lease must outlive the idle mark by two heartbeats: otherwise a late sweep
        finds it gone and the idle conversation counts as an expiry instead of a release."""
        if not lease.expires_at:
            return False
        outlives = lease.expires_at >= lease.last_active + self.lease_ttl_s + 2 * self.heartbeat_s
        return not outlives and lease.expires_at - now < 2 * self.heartbeat_s

    def _evict_over_capacity(self, *, keep: Conversation) -> list[Lease]:
        evicted: list[Lease] = []
        if self.store.lease_count <= self.max_leases:
            return evicted
        for conv in self.store.leased():  # oldest activity first
            if self.store.lease_count <= self.max_leases:
                break
            if conv is not keep and conv.active == 0 and conv.lease is not None:
                evicted.append(conv.lease)
                self.store.set_lease(conv, None)
        return evicted


class LeaseClient(Protocol):
    """The worker calls the keeper needs (implemented by workers.WorkerClient)."""

    async def find_leases(self, url: str, *, conversation_key: str) -> list[dict[str, Any]]: ...

    async def renew_lease(self, url: str, lease_id: str, *, ttl_s: float) -> float | None: ...

    async def release_lease(self, url: str, lease_id: str) -> bool: ...


class LeaseEvents(Protocol):
    """What the keeper counts (implemented by metrics.GatewayMetrics)."""

    def lease_event(self, kind: str, n: int = 1) -> None: ...

    def set_leases(self, n: int) -> None: ...


class LeaseKeeper:
    """Owns a LeaseTable: miss lookups, heartbeat renewals, idle releases."""

    def __init__(
        self,
        table: LeaseTable,
        client: LeaseClient,
        *,
        retention_ttl_s: float,
        events: LeaseEvents,
        clock: Callable[[], float],
    ) -> None:
        self.table = table
        self.client = client
        self.retention_ttl_s = retention_ttl_s
        self.events = events
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._releasing: set[asyncio.Task[None]] = set()  # releases sent off the turn's path

    async def lookup(self, key: str, *, decode_urls: Sequence[str]) -> Lease | None:
        """The cached lease, or (on a miss) the one a decode worker reports for ``key``."""
        lease = self.table.get(key)
        if lease is not None or not decode_urls:
            return lease
        answers = await asyncio.gather(*(self.client.find_leases(url, conversation_key=key) for url in decode_urls), return_exceptions=True)
        best: tuple[float, str, dict[str, Any]] | None = None
        for url, answer in zip(decode_urls, answers):
            if isinstance(answer, BaseException):
                continue
            for entry in answer:
                params = entry.get("kv_transfer_params") or {}
                expires = float(entry.get("expires_at") or params.get("expires_at") or 0.0)
                if expires > self.clock() and (best is None or expires > best[0]):
                    best = (expires, url, dict(params, lease_id=entry.get("lease_id", params.get("lease_id"))))
        if best is None:
            self.events.lease_event("lookup_miss")
            return None
        self.events.lease_event("lookup_hit")
        self.table.remember(key, worker_url=best[1], params=best[2], now=self.clock())
        return self.table.get(key)

    async def record(self, key: str, *, worker_url: str, params: dict[str, Any] | None) -> None:
        """After a turn: store the decode's returned params (None: the worker kept nothing); the
        superseded lease, and those of records the store evicted, are released off the turn's path."""
        now = self.clock()
        stale = self.table.store.take_evicted_leases()
        if params and params.get("lease_id"):
            stale += self.table.put(key, worker_url=worker_url, params=params, now=now)
        if stale:
            # off the turn's path: a superseded lease's worker may be the frozen one the turn left
            task = asyncio.get_running_loop().create_task(self._release_all(stale))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def run_once(self) -> None:
        """One heartbeat: release idle (and evicted records'), forget expired, renew active leases."""
        sweep = self.table.sweep(now=self.clock())
        if sweep.expired:
            self.events.lease_event("expired", len(sweep.expired))
        await self._release_all(sweep.release + self.table.store.take_evicted_leases())
        results = await asyncio.gather(
            *(self.client.renew_lease(lease.worker_url, lease.lease_id, ttl_s=self.retention_ttl_s) for lease in sweep.renew),
            return_exceptions=True,
        )
        for lease, result in zip(sweep.renew, results):
            if isinstance(result, BaseException):
                continue  # worker unreachable: keep the entry, the next beat retries
            if result is None:  # the worker no longer knows it: expired there
                if self.table.drop(lease.conversation_key, lease_id=lease.lease_id) is not None:
                    self.events.lease_event("expired")
                continue
            self.table.renewed(lease.conversation_key, lease_id=lease.lease_id, expires_at=result, now=self.clock())
            self.events.lease_event("renewed")
        self.events.set_leases(self.table.live(now=self.clock()))

    async def _release_all(self, leases: Sequence[Lease]) -> None:
        if not leases:
            return
        results = await asyncio.gather(
            *(self.client.release_lease(lease.worker_url, lease.lease_id) for lease in leases), return_exceptions=True
        )
        released = sum(result is True for result in results)
        forgotten = sum(result is False for result in results)  # 404: the worker had already let it go (expired there)
        if released:
            self.events.lease_event("released", released)
        if forgotten:
            self.events.lease_event("expired", forgotten)

    def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.create_task(self._loop(), name="lease-heartbeat")

    async def stop(self, *, final_sweep: bool = False) -> None:
        """Stop the heartbeat (bounded). ``final_sweep`` runs one last beat: leases idle past
        the TTL are released; active ones stay with their workers, whose retention ends them
        unless another gateway replica, serving the conversation now, renews them."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._releasing:  # each release call is bounded by the client's timeout
            await asyncio.gather(*self._releasing, return_exceptions=True)
        if final_sweep:
            await self.run_once()

    async def _loop(self) -> None:
        # Beat at a fraction of the heartbeat so idle releases are prompt.
        period = min(self.table.heartbeat_s, self.table.lease_ttl_s) / 4
        while not self._stop.is_set():
            try:
                await self.run_once()
            except Exception:  # one bad beat must not end the loop
                log.exception("lease heartbeat failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=period)


def _kept(params: dict[str, Any]) -> dict[str, Any]:
    """A private copy of ``params`` to keep in a lease, its lists (page ids and hashes) as
    tuples: the same JSON when sent back, and a tuple of ints leaves the cyclic GC's lists
    after its first collection, where a list is traversed element by element in every
    collection for as long as the lease lives (docs/performance-log/gateway.md)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}

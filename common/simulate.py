"""Cluster simulator: N prefill and M decode workers, the gateway's real router
and lease table, and an agent population from ``kvserving.agent_load``; a
discrete-event simulation (one heap of timed callbacks, pure Python) whose
every cost comes from a measured ``sim_costs.CostModel``.

One turn, as the real stack runs it (gateway/turn.py, worker/kv_transfer.py)::

    agent sends ──> gateway: lease-table lookup, choose_decode / choose_prefill
      (kvserving.gateway.router, called as the gateway calls them)
    ──> prefill worker: pull the decode's retained KV (D->P) past its own prefix
        cache, queue, compute the rest, pin the prompt's pages for the decode
    ──> decode worker: pull what it lacks (P->D), compute the partial page,
        decode; retain prompt + reply under a lease; the gateway records it
    ──> the agent thinks, then sends the next turn (the whole history)

The gateway's ``LeaseTable`` (kvserving.gateway.leases) is the real one: its
sweep releases idle conversations, renews, and bounds the table; the workers
expire leases at ``retention_ttl_s``. Metrics are the benchmark's
(bench/agents.py): prefix hit rate (cached / prompt tokens), reuse by source,
evicted pages, requests/s, output tokens/s, TTFT p50/p99.

``kvserving simulate`` runs it from the command line and answers the capacity
question: the fewest GPUs that serve a population at a TTFT p99.
"""

from __future__ import annotations

import heapq
import math
import random
from operator import attrgetter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserving.agent_load import AgentSpec, LoadSpec, agent
from kvserving.config import DEFAULT_PAGE_SIZE, GatewayConfig, ReuseConfig, SchedulerConfig
from kvserving.gateway.leases import LeaseTable
from kvserving.gateway.router import WorkerView, choose_decode, choose_prefill, prefix_key
from kvserving.sim_costs import CostModel
from kvserving.sim_workers import DecodeWorker, PrefillWorker, Req, Sim, WLease, Worker

_BIG = 1 << 40  # pages of a conversation chain: bounded by the prompt, never by this


@dataclass(slots=True, frozen=True)
class ClusterSpec:
    """The simulated cluster: formats, worker counts, engine and reuse settings."""

    dtype: str
    prefill_workers: int
    decode_workers: int
    costs: CostModel
    page_size: int | None = None
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    kv_bytes_per_worker: int | None = None  # None: the cost model's

    def __post_init__(self) -> None:
        if self.dtype not in DEFAULT_PAGE_SIZE:
            raise ValueError(f"dtype must be one of {tuple(DEFAULT_PAGE_SIZE)}, got {self.dtype!r}")
        if not self.costs.supports(self.dtype):
            raise ValueError(f"cost model {self.costs.name!r} has no decode cost for {self.dtype}")
        for name in ("prefill_workers", "decode_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.page_size is not None and (self.page_size < 1 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_bytes_per_worker is not None and self.kv_bytes_per_worker < 1:
            raise ValueError(f"kv_bytes_per_worker must be >= 1, got {self.kv_bytes_per_worker}")

    @property
    def effective_page_size(self) -> int:
        return self.page_size or DEFAULT_PAGE_SIZE[self.dtype]

    @property
    def pages_per_worker(self) -> int:
        return self.costs.pool_pages(self.dtype, self.effective_page_size, kv_bytes=self.kv_bytes_per_worker)


@dataclass(slots=True)
class TurnRecord:
    """One request as the agent saw it (the benchmark's ``Record``)."""

    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    local_tokens: int
    pulled_tokens: int
    output_tokens: int
    sent_at: float
    ttft_s: float
    latency_s: float
    fallback: str | None


@dataclass(slots=True)
class _Agent:
    """An agent in flight: its spec (lengths), a unique conversation and its turn index."""

    uid: int
    spec: AgentSpec
    conv: str
    segs_head: list[tuple[Any, int]]
    key: bytes
    next_turn: int = 0
    done_cb: Callable[[float], None] | None = None


class Simulator(Sim):
    """The event loop, the gateway and the agents over a ``ClusterSpec``."""

    def __init__(
        self, cluster: ClusterSpec, load: LoadSpec, *, bidirectional: bool | None = None, sweep_s: float | None = None
    ) -> None:
        """``sweep_s``: the gateway's lease heartbeat period (default the real one, a quarter of
        min(heartbeat, lease TTL)); each beat walks the whole lease table, so a population of
        thousands of agents runs with a coarser beat (idle releases up to ``sweep_s`` late)."""
        self.cluster = cluster
        self.load = load
        self.now = 0.0
        self.bidirectional = cluster.reuse.bidirectional if bidirectional is None else bidirectional
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        costs, p = cluster.costs, cluster.effective_page_size
        self.page_size = p
        pages = cluster.pages_per_worker
        if pages < 1:
            raise ValueError(f"the KV budget holds no {cluster.dtype} page")
        kw: dict[str, Any] = dict(sim=self, pages=pages, page_size=p, dtype=cluster.dtype, costs=costs,
                                  reuse=cluster.reuse, sched=cluster.scheduler)
        self.prefill = [PrefillWorker(f"http://prefill-{i:05d}", **kw) for i in range(cluster.prefill_workers)]
        self.decode = [DecodeWorker(f"http://decode-{i:05d}", **kw) for i in range(cluster.decode_workers)]
        self._by_url: dict[str, Worker] = {w.url: w for w in [*self.prefill, *self.decode]}
        for w in self.prefill:
            w.on_done = self._prefill_done
        for d in self.decode:
            d.on_done = self._decode_done
        g = cluster.gateway
        self.table = LeaseTable(lease_ttl_s=cluster.reuse.lease_ttl_s, heartbeat_s=g.lease_heartbeat_s, max_leases=g.max_leases)
        self._sweep_period = sweep_s if sweep_s is not None else min(g.lease_heartbeat_s, cluster.reuse.lease_ttl_s) / 4
        if not self._sweep_period > 0:
            raise ValueError(f"sweep_s must be > 0, got {sweep_s}")
        self._sweeping = False
        self.records: list[TurnRecord] = []
        self.rejected = 0
        self._turn_seq = 0
        self._keys: dict[str, bytes] = {}
        self._shared_prefix_key: bytes | None = None
        self._preferred_url: dict[bytes, str] = {}
        self._length_cache: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._active = 0
        self._ctx: dict[int, tuple[_Agent, DecodeWorker, Req]] = {}  # turns in flight
        self.max_turn_tokens = (cluster.pages_per_worker * p)  # a request longer than the pool is refused

    # ------------------------------------------------------------------ event core
    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def run(
        self, *, until: float = math.inf, progress: Callable[[float], None] | None = None, agents_done: bool = False
    ) -> None:
        """Process events in time order (ties in the order they were scheduled) up to ``until``,
        or (``agents_done``) until no agent is left; later events (sweeps, expiries) stay queued."""
        events = self._events
        next_report = 0.0
        while events and events[0][0] <= until and not (agents_done and self._active == 0):
            t, _, fn = heapq.heappop(events)
            self.now = t
            fn(t)
            if progress is not None and t >= next_report:
                progress(t)
                next_report = t + 10.0
        self.now = max(self.now, until) if until != math.inf else self.now

    def _ensure_sweep(self) -> None:
        if not self._sweeping:
            self._sweeping = True
            self.at(self.now + self._sweep_period, self._sweep)

    def _sweep(self, now: float) -> None:
        """One gateway heartbeat (LeaseKeeper.run_once without the HTTP)."""
        sweep = self.table.sweep(now=now)
        for lease in sweep.release:
            w = self._by_url.get(lease.worker_url)
            if w is not None:
                w.release(lease.lease_id, now)
        for lease in sweep.renew:
            w = self._by_url[lease.worker_url]
            expires = w.renew(lease.lease_id, ttl_s=self.cluster.reuse.retention_ttl_s, now=now)
            if expires is None:
                self.table.drop(lease.conversation_key, lease_id=lease.lease_id)
            else:
                self.table.renewed(lease.conversation_key, lease_id=lease.lease_id, expires_at=expires, now=now)
        if len(self.table) or self._active:
            self.at(now + self._sweep_period, self._sweep)
        else:
            self._sweeping = False

    # ------------------------------------------------------------------ agents
    def start_agent(self, uid: int, spec: AgentSpec, at: float, *, on_done: Callable[[float], None] | None = None) -> None:
        """Agent ``spec`` (a fresh conversation ``uid``) sends its first turn at ``at``."""
        p = self.page_size
        if self.load.shared_system_prompt:
            shared = self.cluster.costs.server_tokens(spec.prefix_tokens) // p
            segs_head: list[tuple[Any, int]] = [(("s", 0), shared)]
            if self._shared_prefix_key is None:
                self._shared_prefix_key = _synthetic_key("shared")
            key = self._shared_prefix_key
        else:
            segs_head = []
            key = _synthetic_key(f"agent-{uid}")
        ag = _Agent(uid, spec, f"conv-{uid}", segs_head + [(("c", uid), _BIG)], key, done_cb=on_done)
        self._active += 1
        if not spec.turns:
            self._agent_done(ag, at)
            return
        self.at(at + spec.turns[0].think_time_s, lambda t: self._send(ag, t))
        self._ensure_sweep()

    def _agent_done(self, ag: _Agent, now: float) -> None:
        self._active -= 1
        if ag.done_cb is not None:
            ag.done_cb(now)

    def _lengths(self, ag: _Agent, k: int) -> tuple[int, int, int, int]:
        """Server tokens of turn ``k``: prompt, output, and the stable page counts (computed once
        per agent spec: a population reuses its shapes)."""
        key = (id(ag.spec), k)
        hit = self._length_cache.get(key)
        if hit is None:
            hit = self._length_cache[key] = self._compute_lengths(ag, k)
        return hit

    def _compute_lengths(self, ag: _Agent, k: int) -> tuple[int, int, int, int]:
        costs, p = self.cluster.costs, self.page_size
        turn = ag.spec.turns[k]
        prompt = costs.server_tokens(turn.history_tokens)
        out = turn.output_tokens
        stable_prompt = prompt // p
        stable_stream = max(0, prompt + out - costs.reply_lost_tokens) // p
        if k + 1 < len(ag.spec.turns):  # never beyond what the next prompt repeats
            nxt = costs.server_tokens(ag.spec.turns[k + 1].history_tokens)
            stable_prompt = min(stable_prompt, nxt // p)
            stable_stream = min(stable_stream, nxt // p)
        return prompt, out, stable_prompt, stable_stream

    def _send(self, ag: _Agent, now: float) -> None:
        k = ag.next_turn
        prompt, out, sp, ss = self._lengths(ag, k)
        self._turn_seq += 1
        req = Req(self._turn_seq, ag.conv, ag.segs_head, prompt, out, sp, ss, now)
        if prompt + out > self.max_turn_tokens:
            self.rejected += 1  # the engine refuses a request its pool cannot hold (400)
            self._after_turn(ag, req, now, failed=True)
            return
        # gateway: lease lookup (a miss asks the decode workers), route, begin the turn
        key = ag.conv
        lease = self.table.get(key)
        if lease is None and k > 0:
            lease = self._lookup(key, now)
        dec, pre = self.route(ag.key, lease.worker_url if lease else None)
        assert isinstance(pre, PrefillWorker) and isinstance(dec, DecodeWorker)
        req.prefill_url, req.decode_url = pre.url, dec.url
        if lease is not None and self.bidirectional:
            holder = self._by_url[lease.worker_url]
            req.lease_offer = holder.leases.get(lease.lease_id) or _expired_offer(holder, lease.expires_at)
        self.table.begin_turn(key, now=now)
        pre.inflight += 1
        dec.inflight += 1
        t = now + self.cluster.costs.gateway_s
        self.at(t, lambda when: self._at_prefill(ag, req, pre, dec, when))

    def route(self, key: bytes, lease_url: str | None) -> tuple[DecodeWorker, PrefillWorker]:
        """``choose_decode`` and ``choose_prefill`` of kvserving.gateway.router, called on the two
        candidates that can win: the lease holder (or the prefix-hash worker) and the least
        loaded one. Both functions pick one of exactly those two, so the answer is the one
        they give on every worker (tests/test_simulate.py holds them equal) at O(1) hashing."""
        held = self.table.per_worker
        low_d = min(map(_inflight, self.decode))
        least = min((w for w in self.decode if w.inflight == low_d), key=lambda w: (held.get(w.url, 0), w.url))
        views = [WorkerView(least.url, True, least.inflight, held.get(least.url, 0))]
        if lease_url is not None and lease_url != least.url and lease_url in self._by_url:
            h = self._by_url[lease_url]
            views.append(WorkerView(h.url, True, h.inflight, held.get(h.url, 0)))
        decision = choose_decode(views, lease_url=lease_url, max_inflight=self.cluster.gateway.max_inflight_per_worker)
        assert decision is not None
        preferred = self._preferred(key)
        low_p = min(map(_inflight, self.prefill))
        low = next(w for w in self.prefill if w.inflight == low_p)  # workers are in URL order
        pviews = [WorkerView(preferred.url, True, preferred.inflight)]
        if low is not preferred:
            pviews.append(WorkerView(low.url, True, low.inflight))
        choice = choose_prefill(pviews, key=key)
        assert choice is not None
        dec, pre = self._by_url[decision.url], self._by_url[choice.url]
        assert isinstance(dec, DecodeWorker) and isinstance(pre, PrefillWorker)
        return dec, pre

    def _preferred(self, key: bytes) -> PrefillWorker:
        """The rendezvous-hash prefill worker of ``key``: the router's choice when all are idle."""
        url = self._preferred_url.get(key)
        if url is None:
            choice = choose_prefill([WorkerView(w.url, True, 0) for w in self.prefill], key=key)
            assert choice is not None
            url = self._preferred_url[key] = choice.url
        w = self._by_url[url]
        assert isinstance(w, PrefillWorker)
        return w

    def _lookup(self, key: str, now: float) -> Any:
        """LeaseKeeper.lookup on a miss: the decode worker still retaining ``key``, if any."""
        best = None
        for w in self.decode:
            w.expire(now)
            lease_id = w.conv_lease.get(key)
            if lease_id is not None:
                rec = w.leases[lease_id]
                if best is None or rec.expires_at > best.expires_at:
                    best = rec
        if best is None:
            return None
        self.table.remember(key, worker_url=best.worker.url, params=_params(best), now=now)
        return self.table.get(key)

    def _at_prefill(self, ag: _Agent, req: Req, pre: PrefillWorker, dec: DecodeWorker, now: float) -> None:
        pre.expire(now)
        if req.lease_offer is not None:
            req.lease_offer.worker.expire(now)
        out = pre.pull(req, req.lease_offer, now)
        req.fallback = out.fallback
        req_s = self.cluster.costs.prefill_request_s
        self.at(now + out.seconds + req_s, lambda t: pre.arrive(req, t))
        self._ctx[req.turn_id] = (ag, dec, req)

    def _prefill_done(self, req: Req, now: float) -> None:
        ag, dec, _ = self._ctx[req.turn_id]
        pre = self._by_url[req.prefill_url]
        pre.inflight -= 1
        p = self.page_size
        req.cached_tokens = req.hit_pages * p
        req.remote_tokens = req.remote_pages * p
        req.local_tokens = req.cached_tokens - req.remote_tokens
        req.hold = None
        req.pin = None
        req.pulled = (0, 0)
        req.first_token_at = now  # streamed before the decode request starts
        if req.output <= 1:  # the reply ended with its first token: no decode request
            self._ctx.pop(req.turn_id)
            dec.inflight -= 1
            self.table.end_turn(ag.conv, now=now)
            self._after_turn(ag, req, now, failed=False)
            return
        self.at(now, lambda t: self._at_decode(req, dec, t))

    def _at_decode(self, req: Req, dec: DecodeWorker, now: float) -> None:
        dec.expire(now)
        offer = req.transfer_offer
        out = dec.pull(req, offer, now)
        if offer is not None and offer.alive(now):
            offer.worker.release(offer.lease_id, now)  # the pull is over, read or not: the hold goes
        req.transfer_offer = None
        self.at(now + out.seconds + self.cluster.costs.decode_request_s, lambda t: dec.arrive(req, t))

    def _decode_done(self, req: Req, now: float) -> None:
        ag, dec, _ = self._ctx.pop(req.turn_id)
        dec.inflight -= 1
        lease = req.transfer_offer
        if lease is not None:
            for old in self.table.put(ag.conv, worker_url=dec.url, params=_params(lease), now=now):
                w = self._by_url.get(old.worker_url)
                if w is not None:
                    w.release(old.lease_id, now)
        self.table.end_turn(ag.conv, now=now)
        self._after_turn(ag, req, now, failed=False)

    def _after_turn(self, ag: _Agent, req: Req, now: float, *, failed: bool) -> None:
        turn = ag.spec.turns[ag.next_turn]
        if not failed:
            first = req.first_token_at or now
            self.records.append(TurnRecord(
                ag.uid, turn.index, req.prompt, req.cached_tokens, req.local_tokens, req.remote_tokens,
                req.output, req.sent_at, first - req.sent_at, now - req.sent_at, req.fallback,
            ))
        ag.next_turn += 1
        if failed or ag.next_turn >= len(ag.spec.turns):
            self._agent_done(ag, now)
            return
        think = ag.spec.turns[ag.next_turn].think_time_s
        self.at(now + think, lambda t: self._send(ag, t))

    # ------------------------------------------------------------------ whole-cluster controls
    def release_all_leases(self) -> None:
        """What the benchmark does between points: every worker lets go of every lease."""
        for w in [*self.prefill, *self.decode]:
            for lease_id in list(w.leases):
                w.release(lease_id, self.now)
        for key in self.table.keys():
            self.table.drop(key)

    def in_flight(self) -> list[Req]:
        return [req for _, _, req in self._ctx.values()]

    def reclaimed_leases(self) -> int:
        return sum(w.stats.leases_reclaimed for w in self.decode)

    def evicted_pages(self) -> dict[str, int]:
        return {
            "prefill": sum(w.cache.evicted for w in self.prefill),
            "decode": sum(w.cache.evicted for w in self.decode),
        }


_inflight = attrgetter("inflight")


def _params(lease: WLease) -> dict[str, Any]:
    return {"lease_id": lease.lease_id, "expires_at": lease.expires_at}


def _expired_offer(worker: Worker, expires_at: float) -> WLease | None:
    """A lease the gateway still lists but its worker no longer holds: pulls of it fail."""
    return WLease("gone", worker, worker.cache.new_hold(), expires_at, None, 0, 0) if expires_at else None


def _synthetic_key(name: str) -> bytes:
    """``prefix_key`` of a prompt's first tokens: distinct prompts, distinct token ids."""
    rng = random.Random(name)
    return prefix_key([rng.randrange(32000) for _ in range(64)])


# ---------------------------------------------------------------------------------- metrics
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, as bench/agents.py computes it."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(records: list[TurnRecord], wall_s: float, *, waiting_ttfts: list[float] | None = None) -> dict[str, Any]:
    """The benchmark's per-point metrics over ``records``; ``waiting_ttfts``: turns without a
    reply by the end (their TTFT so far counts in the percentiles, not in the throughput)."""
    prompt = sum(r.prompt_tokens for r in records)
    later = [r for r in records if r.turn > 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    ttfts = [r.ttft_s for r in records] + list(waiting_ttfts or [])
    fallbacks: dict[str, int] = {}
    for r in records:
        if r.fallback:
            fallbacks[r.fallback] = fallbacks.get(r.fallback, 0) + 1
    cached = sum(r.cached_tokens for r in records)
    out = sum(r.output_tokens for r in records)
    nan = math.nan
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else nan,
        "hit_rate_later_turns": sum(r.cached_tokens for r in later) / later_prompt if later_prompt else nan,
        "local_share": sum(r.local_tokens for r in records) / prompt if prompt else nan,
        "pulled_share": sum(r.pulled_tokens for r in records) / prompt if prompt else nan,
        "output_tokens": out,
        "wall_s": wall_s,
        "req_per_s": len(records) / wall_s if wall_s > 0 else nan,
        "output_tok_per_s": out / wall_s if wall_s > 0 else nan,
        "ttft_p50_ms": percentile(ttfts, 0.50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
        "fallbacks": fallbacks,
    }


# ---------------------------------------------------------------------------------- scenarios
def run_bench_point(sim: Simulator, agent_ids: range) -> dict[str, Any]:
    """One point of bench/agents.py: every agent in ``agent_ids`` runs all its turns, starts
    spread over one mean think time; returns the point's metrics (evictions included)."""
    sim.release_all_leases()
    before = sim.evicted_pages()
    start = sim.now
    first_record = len(sim.records)
    n = len(agent_ids)
    spread = sim.load.think_time_s.mean
    for k, i in enumerate(agent_ids):
        sim.start_agent(i, agent(sim.load, i), start + spread * k / max(n, 1))
    sim.run(agents_done=True)
    records = sim.records[first_record:]
    end = max((r.sent_at + r.latency_s for r in records), default=start)
    point = summarize(records, end - start)
    after = sim.evicted_pages()
    point["prefill_evicted_pages"] = after["prefill"] - before["prefill"]
    point["decode_evicted_pages"] = after["decode"] - before["decode"]
    point["concurrency"] = n
    return point


@dataclass(slots=True, frozen=True)
class Population:
    """A steady population: ``agents`` slots, each running agents back to back for ``duration_s``.

    Slot j runs agents j, j + agents, j + 2 agents, ...; they start spread over ``ramp_s``.
    ``shapes``: draw only the first ``shapes`` agents of the spec and give slot agents their
    lengths and think times in turn (each a new conversation): drawing an agent's text costs
    ~1-15 ms, too much for 10K agents an hour."""

    agents: int
    duration_s: float
    warmup_s: float = 0.0
    ramp_s: float = 60.0
    shapes: int = 256

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError(f"agents must be >= 1, got {self.agents}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}")
        if self.ramp_s < 0:
            raise ValueError(f"ramp_s must be >= 0, got {self.ramp_s}")
        if self.shapes < 1:
            raise ValueError(f"shapes must be >= 1, got {self.shapes}")


def run_population(sim: Simulator, pop: Population, *, progress: Callable[[float], None] | None = None,
                   shapes: dict[int, AgentSpec] | None = None) -> dict[str, Any]:
    """Run ``pop`` on ``sim``; metrics over turns sent in [warmup_s, duration_s). ``shapes``:
    agents already drawn from ``sim.load`` (by index), reused across runs of the same load."""
    shapes = {} if shapes is None else shapes

    def spec_for(i: int) -> AgentSpec:
        j = i % pop.shapes
        if j not in shapes:
            shapes[j] = agent(sim.load, j)
        return shapes[j]

    def launch(slot: int, k: int, at: float) -> None:
        if at >= pop.duration_s:
            return
        uid = slot + k * pop.agents
        sim.start_agent(uid, spec_for(uid), at, on_done=lambda t: launch(slot, k + 1, t))

    for slot in range(pop.agents):
        launch(slot, 0, pop.ramp_s * slot / pop.agents)
    sim.run(until=pop.duration_s, progress=progress)
    window = pop.duration_s - pop.warmup_s
    end = pop.duration_s
    records = [r for r in sim.records if pop.warmup_s <= r.sent_at and r.sent_at + r.latency_s <= end]
    # turns still waiting at the end count in the TTFT: a saturated cluster must not look fast
    waiting = [min(req.first_token_at or end, end) - req.sent_at for req in sim.in_flight() if req.sent_at >= pop.warmup_s]
    point = summarize(records, window, waiting_ttfts=waiting)
    point.update({f"{k}_evicted_pages": v for k, v in sim.evicted_pages().items()})
    point["unfinished"] = len(waiting)
    return point


# ---------------------------------------------------------------------------------- capacity planning
def gpu_load(seed: int = 0, *, think_s: float = 30.0, output_tokens: int = 250, max_context: int = 32768,
             shared_system_prompt: bool = True) -> LoadSpec:
    """Coding-agent traffic at GPU scale: a 2K-token shared system prompt with 8 tools, turns of
    tool results ~1.5K tokens, replies ~``output_tokens``, ``think_s`` mean think time (tool runs)."""
    from kvserving.agent_load import Dist

    return LoadSpec(
        seed=seed,
        system_tokens=Dist("uniform", 2000, 500, 1),
        num_tools=Dist("uniform", 8, 2, 1, 12),
        tool_description_tokens=Dist("uniform", 80, 40, 1),
        turns=Dist("uniform", 20, 10, 1),
        user_tokens=Dist("lognormal", 200, 0.6, 4, 2000),
        output_tokens=Dist("uniform", output_tokens, output_tokens // 2, 1),
        tool_call_prob=0.8,
        tool_args_tokens=Dist("uniform", 30, 15, 1),
        tool_result_tokens=Dist("lognormal", 1500, 0.8, 4, 8000),
        think_time_s=Dist("exponential", think_s, 0.0, 0.0, 10 * think_s),
        shared_system_prompt=shared_system_prompt,
        max_context_tokens=max_context,
    )


def split_gpus(gpus: int, prefill_share: float) -> tuple[int, int]:
    """(prefill, decode) workers, one GPU each, at least one of each."""
    if gpus < 2:
        raise ValueError(f"gpus must be >= 2 (one prefill and one decode worker), got {gpus}")
    prefill = min(gpus - 1, max(1, round(gpus * prefill_share)))
    return prefill, gpus - prefill


def simulate_point(dtype: str, gpus: int, *, costs: CostModel, load: LoadSpec, pop: Population,
                   prefill_share: float, reuse: ReuseConfig | None = None,
                   progress: Callable[[float], None] | None = None,
                   shapes: dict[int, AgentSpec] | None = None) -> dict[str, Any]:
    prefill, decode = split_gpus(gpus, prefill_share)
    cluster = ClusterSpec(dtype, prefill, decode, costs, reuse=reuse or ReuseConfig(),
                          scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, chunk_size=2048))
    sim = Simulator(cluster, load, sweep_s=max(30.0, min(cluster.gateway.lease_heartbeat_s, cluster.reuse.lease_ttl_s) / 4))
    point = run_population(sim, pop, progress=progress, shapes=shapes)
    point.update({"dtype": dtype, "gpus": gpus, "prefill_workers": prefill, "decode_workers": decode,
                  "pool_tokens": cluster.pages_per_worker * cluster.effective_page_size,
                  "turns_simulated": len(sim.records)})
    return point


def fewest_gpus(
    dtype: str, max_gpus: int, ttft_p99_ms: float, *, probe: Population | None = None, **kw: Any
) -> tuple[int | None, dict[str, Any]]:
    """Binary search of the fewest GPUs (2..max_gpus) whose TTFT p99 is within ``ttft_p99_ms``
    (more GPUs never make it worse, the search assumes); (None, the max_gpus point) if none.

    ``probe``: a shorter population run for the search steps; the answer is then confirmed
    with the full one (``kw['pop']``), searching upward with it if the confirmation fails."""
    full = kw.pop("pop")

    def meets(gpus: int, pop: Population) -> tuple[bool, dict[str, Any]]:
        point = simulate_point(dtype, gpus, pop=pop, **kw)
        return point["ttft_p99_ms"] <= ttft_p99_ms, point

    def search(lo: int, hi: int, pop: Population, best: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        while lo < hi:  # hi meets the target
            mid = (lo + hi) // 2
            ok, point = meets(mid, pop)
            if ok:
                hi, best = mid, point
            else:
                lo = mid + 1
        return hi, best

    step = probe or full
    ok, top = meets(max_gpus, step)
    if not ok:
        return None, simulate_point(dtype, max_gpus, pop=full, **kw) if step is not full else top
    need, best = search(2, max_gpus, step, top)
    if step is full:
        return need, best
    ok, point = meets(need, full)
    if ok:
        return need, point
    if need == max_gpus:
        return None, point
    ok, top = meets(max_gpus, full)
    if not ok:
        return None, top
    return search(need + 1, max_gpus, full, top)


def plan(dtype: str, args: dict[str, Any], *, show_progress: bool) -> dict[str, Any]:
    """One format's answer for ``kvserving simulate`` (a process-pool job: plain arguments)."""
    import sys

    from kvserving.sim_costs import CostModel

    costs = CostModel.from_dict(args["costs"])
    load = gpu_load(args["seed"], think_s=args["think_s"], output_tokens=args["output_tokens"],
                    max_context=args["max_context"], shared_system_prompt=args["shared"])
    pop = Population(args["agents"], args["duration_s"], warmup_s=args["warmup_s"], ramp_s=args["ramp_s"], shapes=args["shapes"])
    duration = args["duration_s"]

    def progress(t: float) -> None:
        if show_progress:
            done = int(30 * min(1.0, t / duration))
            sys.stderr.write(f"\r{dtype:>9} [{'#' * done}{'.' * (30 - done)}] {t:6.0f} s simulated")
            sys.stderr.flush()

    kw: dict[str, Any] = dict(costs=costs, load=load, pop=pop, prefill_share=args["prefill_share"],
                              reuse=ReuseConfig(bidirectional=args["reuse"]), progress=progress, shapes={})
    if args["ttft_p99_ms"] is None:
        point = simulate_point(dtype, args["gpus"], **kw)
    else:
        probe = None
        if args["probe_s"] < duration:
            probe = Population(args["agents"], args["probe_s"], warmup_s=min(args["warmup_s"], args["probe_s"] / 2),
                               ramp_s=args["ramp_s"], shapes=args["shapes"])
        need, point = fewest_gpus(dtype, args["gpus"], args["ttft_p99_ms"], probe=probe, **kw)
        point["gpus"] = need
        point["max_gpus"] = args["gpus"]
    if show_progress:
        sys.stderr.write("\r" + " " * 60 + "\r")
    return point


_COLUMNS = (
    ("dtype", "dtype", "{}"), ("GPUs", "gpus", "{}"), ("P/D", "pd", "{}"), ("pool tok/GPU", "pool_tokens", "{:,}"),
    ("hit", "hit_rate", "{:.3f}"), ("local", "local_share", "{:.3f}"), ("pulled", "pulled_share", "{:.3f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("p99 ms", "ttft_p99_ms", "{:.0f}"), ("req/s", "req_per_s", "{:.1f}"),
    ("out tok/s", "output_tok_per_s", "{:,.0f}"), ("evicted P/D", "evicted", "{}"), ("turns", "turns_simulated", "{:,}"),
)


def format_table(points: list[dict[str, Any]]) -> str:
    rows = [[title for title, _, _ in _COLUMNS]]
    for p in points:
        q = dict(p, pd=f"{p['prefill_workers']}/{p['decode_workers']}",
                 evicted=f"{p['prefill_evicted_pages']:,}/{p['decode_evicted_pages']:,}")
        if q.get("gpus") is None:
            q["gpus"] = f">{p['max_gpus']}"
        rows.append([fmt.format(q[key]) if not isinstance(q[key], str) else q[key] for _, key, fmt in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    from kvserving.argtypes import float_in, int_in

    parser.add_argument("--agents", type=int_in(1, 10_000_000), default=10_000, help="concurrent agents (slots running agents back to back)")
    parser.add_argument("--gpus", type=int_in(2, 100_000), default=64, help="GPUs (one worker each); with --ttft-p99-ms the most to try")
    parser.add_argument("--dtype", default="nvfp4,fp8", help="KV formats, comma-separated (bf16, fp8, nvfp4, triaxial)")
    parser.add_argument("--ttft-p99-ms", type=float_in(0, 1e9, low_open=True), default=None,
                        help="find the fewest GPUs whose TTFT p99 is within this")
    parser.add_argument("--costs", default="h200-8b", help="cost profile: h200-8b, cpu-tiny, or a JSON file (kvserving.sim_costs)")
    parser.add_argument("--kv-gib", type=float_in(0, 1e6, low_open=True), default=None, help="KV memory per GPU, GiB (default: the profile's)")
    parser.add_argument("--prefill-share", type=float_in(0, 1, low_open=True), default=0.25, help="share of the GPUs that prefill")
    parser.add_argument("--duration-s", type=float_in(0, 1e7, low_open=True), default=3600.0, help="simulated seconds")
    parser.add_argument("--warmup-s", type=float_in(0, 1e7), default=300.0, help="metrics ignore turns sent before this")
    parser.add_argument("--ramp-s", type=float_in(0, 1e7), default=60.0, help="agents start spread over this")
    parser.add_argument("--think-s", type=float_in(0, 1e6, low_open=True), default=30.0, help="mean think time between turns")
    parser.add_argument("--output-tokens", type=int_in(1, 1_000_000), default=250, help="mean reply tokens")
    parser.add_argument("--max-context", type=int_in(64, 10_000_000), default=32768, help="tokens an agent's history may reach")
    parser.add_argument("--per-agent-system-prompt", action="store_true", help="every agent its own system prompt (default: shared)")
    parser.add_argument("--no-reuse", action="store_true", help="bidirectional reuse off (the prefill's own prefix cache only)")
    parser.add_argument("--shapes", type=int_in(1, 1_000_000), default=128, help="distinct agent shapes drawn (see Population)")
    parser.add_argument("--probe-s", type=float_in(0, 1e7, low_open=True), default=900.0,
                        help="with --ttft-p99-ms: simulated seconds of each search step; the answer is confirmed over --duration-s")
    parser.add_argument("--jobs", type=int_in(1, 256), default=2, help="formats simulated at once, one process each")
    parser.add_argument("--seed", type=int, default=0, help="agent population seed")
    parser.add_argument("--json", default=None, help="write the points as JSON here")
    parser.add_argument("--validate", default=None, metavar="BENCH_JSON",
                        help="instead: re-run bench/agents.py's points (its JSON) and print simulated vs measured")


def run(args: Any) -> int:
    import json
    import sys
    import time

    from kvserving.sim_costs import canonical_dtype, load_costs

    if args.validate is not None:
        with open(args.validate) as fh:
            measured = json.load(fh)
        costs_name = args.costs if args.costs != "h200-8b" else "cpu-tiny"
        print(format_validation(validate_points(measured, load_costs(costs_name))))
        return 0
    dtypes = [canonical_dtype(d.strip()) for d in str(args.dtype).split(",") if d.strip()]
    if not dtypes:
        raise ValueError("--dtype names no format")
    if args.warmup_s >= args.duration_s:
        raise ValueError(f"--warmup-s ({args.warmup_s}) must be < --duration-s ({args.duration_s})")
    costs = load_costs(args.costs)
    if args.kv_gib is not None:
        from dataclasses import replace

        costs = replace(costs, kv_bytes_per_worker=int(args.kv_gib * 2**30))
    for dtype in dtypes:
        if not costs.supports(dtype):
            raise ValueError(f"cost profile {costs.name!r} has no decode cost for {dtype}")
    Population(args.agents, args.duration_s, warmup_s=args.warmup_s, ramp_s=args.ramp_s, shapes=args.shapes)
    job = {"costs": costs.to_dict(), "seed": args.seed, "think_s": args.think_s, "output_tokens": args.output_tokens,
           "max_context": args.max_context, "shared": not args.per_agent_system_prompt, "agents": args.agents,
           "duration_s": args.duration_s, "warmup_s": args.warmup_s, "ramp_s": args.ramp_s, "shapes": args.shapes,
           "prefill_share": args.prefill_share, "reuse": not args.no_reuse, "gpus": args.gpus,
           "ttft_p99_ms": args.ttft_p99_ms, "probe_s": args.probe_s}
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, len(dtypes)))
    if jobs == 1:
        points = [plan(d, job, show_progress=tty) for d in dtypes]
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs) as pool:  # one format per core
            futures = [pool.submit(plan, d, job, show_progress=tty and i == 0) for i, d in enumerate(dtypes)]
            points = [f.result() for f in futures]
    target = f", TTFT p99 <= {args.ttft_p99_ms:g} ms" if args.ttft_p99_ms is not None else ""
    print(f"{args.agents:,} agents, {args.duration_s:g} s simulated (metrics after {args.warmup_s:g} s), costs {costs.name}{target}")
    print(format_table(points))
    print(f"simulated in {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "costs": costs.to_dict(),
                       "points": points}, fh, indent=1, default=str)
    return 0


# ---------------------------------------------------------------------------------- validation
BENCH_FORMATS = {"bf16": "bf16", "fp8": "fp8_e4m3", "nvfp4": "nvfp4", "triaxial": "triaxial"}
VALIDATED = ("hit_rate", "hit_rate_later_turns", "local_share", "pulled_share", "req_per_s", "output_tok_per_s",
             "ttft_p50_ms", "ttft_p99_ms", "prefill_evicted_pages", "decode_evicted_pages")


def load_spec_from_dict(data: dict[str, Any]) -> LoadSpec:
    """The ``LoadSpec`` bench/agents.py wrote with ``dataclasses.asdict``."""
    from kvserving.agent_load import Dist

    if not isinstance(data, dict):
        raise ValueError("the benchmark JSON has no 'load' object")
    fields: dict[str, Any] = {k: Dist(**v) if isinstance(v, dict) else v for k, v in data.items()}
    try:
        return LoadSpec(**fields)
    except TypeError as exc:
        raise ValueError(f"bad 'load' in the benchmark JSON: {exc}") from exc


def bench_reuse(mode: str, ttl_s: float) -> ReuseConfig:
    """bench/agents.py's reuse modes."""
    if mode == "lease":
        return ReuseConfig()
    if mode == "ttl":
        return ReuseConfig(retention_ttl_s=ttl_s, lease_ttl_s=ttl_s / 2)
    if mode == "off":
        return ReuseConfig(bidirectional=False)
    raise ValueError(f"unknown benchmark mode {mode!r}")


def validate_points(measured: dict[str, Any], costs: CostModel) -> list[dict[str, Any]]:
    """Re-run bench/agents.py's points (same agents, KV budget, scheduler, reuse mode, one
    stack per format and mode, points in the order they ran) in the simulator; one row per
    point with the simulated and the measured metrics."""
    from dataclasses import replace

    try:
        load = load_spec_from_dict(measured["load"])
        points = list(measured["points"])
        kv_bytes = int(measured["kv_kib_per_worker"]) * 1024
        ttl_s = float(measured.get("ttl_s", 3.0))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a bench/agents.py result: {exc}") from exc
    sched = SchedulerConfig(**measured.get("scheduler", {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "chunk_size": 512}))
    costs = replace(costs, kv_bytes_per_worker=kv_bytes)
    sims: dict[tuple[str, str], Simulator] = {}
    rows: list[dict[str, Any]] = []
    first = 0
    for p in points:
        fmt, mode, n = p["format"], p["mode"], int(p["concurrency"])
        key = (fmt, mode)
        if key not in sims:
            cluster = ClusterSpec(BENCH_FORMATS[fmt], 1, 1, costs, reuse=bench_reuse(mode, ttl_s), scheduler=sched)
            sims[key] = Simulator(cluster, load)
        sim_point = run_bench_point(sims[key], range(first, first + n))
        first += n
        rows.append({"format": fmt, "mode": mode, "concurrency": n,
                     "sim": {k: sim_point.get(k) for k in VALIDATED},
                     "measured": {k: p.get(k) for k in VALIDATED}})
    return rows


def format_validation(rows: list[dict[str, Any]]) -> str:
    cols = (("hit", "hit_rate", "{:.2f}"), ("hit2+", "hit_rate_later_turns", "{:.2f}"), ("pulled", "pulled_share", "{:.2f}"),
            ("req/s", "req_per_s", "{:.2f}"), ("TTFT p50", "ttft_p50_ms", "{:.0f}"), ("p99", "ttft_p99_ms", "{:.0f}"),
            ("evict P", "prefill_evicted_pages", "{}"), ("evict D", "decode_evicted_pages", "{}"))
    head = ["format", "mode", "N"] + [f"{t} sim/meas" for t, _, _ in cols]
    table = [head]
    for r in rows:
        cells = [r["format"], r["mode"], str(r["concurrency"])]
        for _, key, fmt in cols:
            s, m = r["sim"].get(key), r["measured"].get(key)
            cells.append(f"{fmt.format(s) if s is not None else '-'} / {fmt.format(m) if m is not None else '-'}")
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

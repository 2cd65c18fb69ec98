"""Cluster simulator: N prefill and M decode workers, the gateway's real router
and lease table, and an agent population from ``kvserving.agents.load``; a
discrete-event simulation (one heap of timed callbacks, pure Python) whose
every cost comes from a measured ``sim_costs.CostModel``.

One turn, as the real stack runs it (gateway/turn.py, worker/kv/transfer.py)::

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

``kvserving simulate`` (kvserving.sim.plan) runs it from the command line: the fewest
GPUs that serve a population at a TTFT p99, and the replay of the benchmark's points.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserving.agents.load import AgentSpec, LoadSpec, agent
from kvserving.config import DEFAULT_PAGE_SIZE, GatewayConfig, ReuseConfig, SchedulerConfig
from kvserving.gateway.leases import LeaseTable
from kvserving.gateway.router import WorkerView, choose_decode, choose_prefill, prefix_key
from kvserving.sim.costs import CostModel
from kvserving.sim.shapes import agent_shape
from kvserving.sim.workers import SKIP_REASONS, DecodeWorker, PrefillWorker, PullOutcome, PullRules, Req, Sim, WLease, Worker

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
    rules: PullRules = PullRules()  # the workers' KV pull and admission-pin rules (the worker before each, to replay it)

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
        self,
        cluster: ClusterSpec,
        load: LoadSpec,
        *,
        bidirectional: bool | None = None,
        sweep_s: float | None = None,
        merge_steps: bool = True,
    ) -> None:
        """``sweep_s``: the gateway's lease heartbeat period (default the real one, a quarter of
        min(heartbeat, lease TTL)); each beat walks the whole lease table, so a population of
        thousands of agents runs with a coarser beat (idle releases up to ``sweep_s`` late).
        ``merge_steps``: a run of identical decode steps advances in one event (same results,
        fewer events; ``workers._Run``); False steps every one."""
        self.cluster = cluster
        self.load = load
        self.now = 0.0
        self.bidirectional = cluster.reuse.bidirectional if bidirectional is None else bidirectional
        # the event queue: a heap of the distinct times that have events (floats compare far
        # cheaper than (time, seq) tuples) and each time's events in the order they were scheduled
        self._times: list[float] = []
        self._due: dict[float, list[tuple[Callable[[Any, float], None], Any]]] = {}
        costs, p = cluster.costs, cluster.effective_page_size
        self.page_size = p
        pages = cluster.pages_per_worker
        if pages < 1:
            raise ValueError(f"the KV budget holds no {cluster.dtype} page")
        kw: dict[str, Any] = dict(
            sim=self,
            pages=pages,
            page_size=p,
            dtype=cluster.dtype,
            costs=costs,
            reuse=cluster.reuse,
            sched=cluster.scheduler,
            rules=cluster.rules,
        )
        self.prefill = [PrefillWorker(f"http://prefill-{i:05d}", **kw) for i in range(cluster.prefill_workers)]
        self.decode = [DecodeWorker(f"http://decode-{i:05d}", **kw) for i in range(cluster.decode_workers)]
        self._by_url: dict[str, Worker] = {w.url: w for w in [*self.prefill, *self.decode]}
        self._prefill_by_url = {w.url: w for w in self.prefill}
        self._decode_by_url = {w.url: w for w in self.decode}
        # the router's inputs, kept current by the workers' ``inflight`` setters (not rebuilt per turn)
        self._pviews: list[WorkerView] = [WorkerView(w.url, True, 0) for w in self.prefill]
        self._dloads: list[int] = [0] * len(self.decode)
        self._durls = [d.url for d in self.decode]
        for i, w in enumerate(self.prefill):
            w.on_done = self._prefill_done
            w.bind_board(self._pviews, i)
        for i, d in enumerate(self.decode):
            d.on_done = self._decode_done
            d.bind_board(self._dloads, i)
            d.merge_steps = merge_steps
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
        self._length_cache: dict[int, tuple[AgentSpec, list[tuple[int, int, int, int]]]] = {}
        self._active = 0
        self._ctx: dict[int, tuple[_Agent, DecodeWorker, Req]] = {}  # turns in flight
        self.max_turn_tokens = cluster.pages_per_worker * p  # a request longer than the pool is refused
        self.stop_at = math.inf  # no turn starts after this (the benchmark's point window)

    # ------------------------------------------------------------------ event core
    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self.call_at(t, _call, fn)

    def call_at(self, t: float, fn: Callable[[Any, float], None], arg: Any) -> None:
        """``fn(arg, t)`` at ``t`` (no closure to build: the hot events)."""
        if t < self.now:
            raise ValueError(f"event at {t} before the clock ({self.now})")
        bucket = self._due.get(t)
        if bucket is None:
            self._due[t] = [(fn, arg)]
            _heappush(self._times, t)
        else:
            bucket.append((fn, arg))

    def run(self, *, until: float = math.inf, progress: Callable[[float], None] | None = None, agents_done: bool = False) -> None:
        """Process events in time order (ties in the order they were scheduled) up to ``until``,
        or (``agents_done``) until no agent is left; later events (sweeps, expiries) stay queued."""
        times, due = self._times, self._due
        pop = heapq.heappop
        next_report = 0.0 if progress is not None else math.inf
        # the loop makes millions of objects and (almost) no reference cycles: the cyclic
        # collector only costs time here (~6 % at 10K agents), so it waits until the run is over
        collect = gc.isenabled()
        gc.disable()
        try:
            stopped = False
            while times and times[0] <= until and not stopped:
                t = times[0]
                bucket = due[t]  # grows while it runs: events scheduled for the same instant
                i = 0
                while i < len(bucket):
                    if agents_done and self._active == 0:
                        stopped = True
                        break
                    fn, arg = bucket[i]
                    i += 1
                    self.now = t
                    fn(arg, t)
                    if t >= next_report:
                        assert progress is not None
                        progress(t)
                        next_report = t + 10.0
                if stopped:
                    del bucket[:i]  # the rest stays queued for the next run
                else:
                    del due[t]
                    pop(times)
        finally:
            if collect:
                gc.enable()
        self.now = max(self.now, until) if until != math.inf else self.now
        for d in self.decode:  # pools as stepping leaves them at the stop (their pages, evictions)
            d.catch_up(self.now)

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
            segs_head: list[tuple[Any, int]] = [(-1, shared)]  # chain keys: -1 the shared prompt, uid a conversation
            if self._shared_prefix_key is None:
                self._shared_prefix_key = _synthetic_key("shared")
            key = self._shared_prefix_key
        else:
            segs_head = []
            key = _synthetic_key(f"agent-{uid}")
        ag = _Agent(uid, spec, f"conv-{uid}", segs_head + [(uid, _BIG)], key, done_cb=on_done)
        self._active += 1
        if not spec.turns:
            self._agent_done(ag, at)
            return
        self.call_at(at + spec.turns[0].think_time_s, self._send, ag)
        self._ensure_sweep()

    def _agent_done(self, ag: _Agent, now: float) -> None:
        self._active -= 1
        if ag.done_cb is not None:
            ag.done_cb(now)

    def _lengths(self, ag: _Agent, k: int) -> tuple[int, int, int, int]:
        """Server tokens of turn ``k``: prompt, output, and the stable page counts (computed once
        per agent spec: a population reuses its shapes)."""
        entry = self._length_cache.get(id(ag.spec))
        if entry is None or entry[0] is not ag.spec:
            # the entry keeps its spec alive, so no other spec can take its id
            entry = self._length_cache[id(ag.spec)] = (ag.spec, [self._compute_lengths(ag, j) for j in range(len(ag.spec.turns))])
        return entry[1][k]

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
        if now > self.stop_at:  # the window closed while the agent thought: it stops here
            self._agent_done(ag, now)
            return
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
        req.prefill_url, req.decode_url = pre.url, dec.url
        if lease is not None and self.bidirectional:
            holder = self._by_url[lease.worker_url]
            req.lease_offer = holder.leases.get(lease.lease_id) or _expired_offer(holder, lease.params)
        self.table.begin_turn(key, now=now)
        pre.inflight += 1
        dec.inflight += 1
        # the gateway's work, then the prefill request's HTTP and lease round trips: they come
        # before its pull, which goes straight on to the engine queue (KVTransfer.pull in admit)
        costs = self.cluster.costs
        self.call_at(now + costs.gateway_s + costs.prefill_request_s, self._at_prefill, (ag, req, pre, dec))

    def route(self, key: bytes, lease_url: str | None) -> tuple[DecodeWorker, PrefillWorker]:
        """``choose_decode`` and ``choose_prefill`` of kvserving.gateway.router. Decode is called on
        the two candidates that can win (the lease holder and the least loaded: it picks one of
        exactly those); prefill on every prefill worker (its load bound needs them all).
        tests/test_simulate.py holds both equal to the router called on every worker."""
        held = self.table.per_worker
        loads, urls = self._dloads, self._durls  # decode workers' in-flight counts, in URL order
        low = min(loads)
        i = loads.index(low)
        best = held.get(urls[i], 0)
        j = i
        for _ in range(loads.count(low) - 1):  # ties: the first of the fewest held
            if not best:
                break
            j = loads.index(low, j + 1)
            n = held.get(urls[j], 0)
            if n < best:
                i, best = j, n
        least = self.decode[i]
        views = [WorkerView(least.url, True, low, best)]
        if lease_url is not None and lease_url != least.url and lease_url in self._by_url:
            h = self._by_url[lease_url]
            views.append(WorkerView(h.url, True, h.inflight, held.get(h.url, 0)))
        decision = choose_decode(views, lease_url=lease_url, max_inflight=self.cluster.gateway.max_inflight_per_worker)
        assert decision is not None
        # Prefill: bounded-load consistent hashing reads every worker's load and the whole
        # rendezvous order, so the router sees every prefill worker.
        choice = choose_prefill(self._pviews, key=key)
        assert choice is not None
        return self._decode_by_url[decision.url], self._prefill_by_url[choice.url]

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

    def _at_prefill(self, turn: tuple[_Agent, Req, PrefillWorker, DecodeWorker], now: float) -> None:
        """The request reaches the prefill's server. A pull plans on the engine thread
        (``Puller._plan``: match, pin the local prefix, allocate the pages to READ into), so on a
        busy prefill it plans when the step in progress ends, after the releases of transfer
        holds queued during that step."""
        ag, req, pre, dec = turn
        self._ctx[req.turn_id] = (ag, dec, req)
        offer = req.lease_offer
        if offer is None or offer.expires_at <= now:  # decided on the server thread: nothing planned
            pre.pull(req, offer, now, self._prefill_unplanned)
        else:
            pre.engine_call(self._prefill_plan, req, now)

    def _prefill_plan(self, req: Req, now: float) -> None:
        pre = self._prefill_by_url[req.prefill_url]
        if pre._expiry and pre._expiry[0][0] <= now:
            pre.expire(now)
        offer = req.lease_offer
        if offer is not None:
            holder = offer.worker
            if holder._expiry and holder._expiry[0][0] <= now:
                holder.expire(now)
        pre.pull(req, offer, now, self._prefill_pulled)

    def _prefill_pulled(self, req: Req, out: PullOutcome, now: float) -> None:
        """The prefill's pull is planned. The engine call after the plan (the adopt that pins
        the READ's pages or the local prefix and adds the request, or the add alone when there
        is nothing to adopt) is asked from the pull's thread once the plan returned, by when a
        busy engine has queued its next step: it waits for that step. ``adopt_adds=False``: the
        add is a call of its own after the adopt's, asked the same way (one step later again)."""
        req.fallback = out.fallback
        pre = self._prefill_by_url[req.prefill_url]
        if out.seconds > 0:  # the adopt is asked once the READ is over
            pre.read(out, self._prefill_adopt, req, now)
        elif req.pin is not None:  # the local prefix it matched is pinned for the request: an adopt
            self.call_at(now, self._prefill_adopt, req)
        else:
            self.call_at(now, self._prefill_add, req)

    def _prefill_unplanned(self, req: Req, out: PullOutcome, now: float) -> None:
        """No offer, or an expired one: nothing planned, the add waits only for the step in progress."""
        req.fallback = out.fallback
        self._prefill_by_url[req.prefill_url].arrive(req, now)

    def _prefill_adopt(self, req: Req, now: float) -> None:
        pre = self._prefill_by_url[req.prefill_url]
        pre.engine_call(pre.arrive if self.cluster.rules.adopt_adds else self._prefill_adopted, req, now)

    def _prefill_adopted(self, req: Req, now: float) -> None:
        self.call_at(now, self._prefill_add, req)

    def _prefill_add(self, req: Req, now: float) -> None:
        pre = self._prefill_by_url[req.prefill_url]
        pre.engine_call(pre.arrive, req, now)

    def _prefill_done(self, req: Req, now: float) -> None:
        ag, dec, _ = self._ctx[req.turn_id]
        self._prefill_by_url[req.prefill_url].inflight -= 1
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
        self.call_at(now + self.cluster.costs.decode_request_s, self._at_decode, (req, dec))

    def _at_decode(self, turn: tuple[Req, DecodeWorker], now: float) -> None:
        """The decode request arrives: its pull starts once the prefill has answered the hold of
        its transfer lease, an engine call there (between the prefill's steps)."""
        offer = turn[0].transfer_offer
        if offer is not None and offer.alive(now) and offer.worker is not turn[1]:
            offer.worker.engine_call(self._decode_pull, turn, now)
        else:
            self._decode_pull(turn, now)

    def _decode_pull(self, turn: tuple[Req, DecodeWorker], now: float) -> None:
        req, dec = turn
        if dec._expiry and dec._expiry[0][0] <= now:
            dec.expire(now)
        dec.pull(req, req.transfer_offer, now, self._decode_pulled)

    def _decode_pulled(self, req: Req, out: PullOutcome, now: float) -> None:
        """The decode's pull is over, read or not (at once, or after waiting for pages): the
        prefill's hold goes once the READ is over, the request joins the decode's engine queue."""
        offer = req.transfer_offer
        req.transfer_offer = None
        dec = self._decode_by_url[req.decode_url]
        if out.seconds > 0 and dec.gpu is not None:
            dec.read(out, self._decode_read, (req, offer), now)
            return
        if offer is not None:
            self.call_at(now + out.seconds, self._let_go_offer, offer)
        self.call_at(now + out.seconds, dec.arrive, req)

    def _decode_read(self, pulled: tuple[Req, WLease | None], now: float) -> None:
        """The decode's READ on a shared GPU is over (``Worker.read``): the prefill's hold goes, the
        request joins the decode's engine queue."""
        req, offer = pulled
        if offer is not None:
            self._let_go_offer(offer, now)
        self._decode_by_url[req.decode_url].arrive(req, now)

    def _let_go_offer(self, offer: WLease, now: float) -> None:
        """The decode lets go of the prefill's transfer hold once its pull is over: the release is an
        engine call on the prefill (``KVTransfer.release``), so a busy prefill keeps the prompt's pages
        until its step in progress ends."""
        offer.worker.engine_call(self._release_offer, offer, now)

    def _release_offer(self, offer: WLease, now: float) -> None:
        if offer.alive(now):
            offer.worker.release(offer.lease_id, now)

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
            self.records.append(
                TurnRecord(
                    ag.uid,
                    turn.index,
                    req.prompt,
                    req.cached_tokens,
                    req.local_tokens,
                    req.remote_tokens,
                    req.output,
                    req.sent_at,
                    first - req.sent_at,
                    now - req.sent_at,
                    req.fallback,
                )
            )
        ag.next_turn += 1
        if failed or ag.next_turn >= len(ag.spec.turns):
            self._agent_done(ag, now)
            return
        think = ag.spec.turns[ag.next_turn].think_time_s
        self.call_at(now + think, self._send, ag)

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

    def preemptions(self) -> dict[str, int]:
        return {
            "prefill": sum(w.stats.preemptions for w in self.prefill),
            "decode": sum(w.stats.preemptions for w in self.decode),
        }

    def pull_counters(self) -> dict[str, dict[str, Any]]:
        """Per role, summed over its workers: prompt tokens computed, its own pulls' fallbacks by reason,
        pulls skipped by reason and the prompt tokens each left to compute, pulls that waited for pages
        and their wait (``WorkerStats``)."""
        out: dict[str, dict[str, Any]] = {}
        for role, workers in (("prefill", self.prefill), ("decode", self.decode)):
            skipped = dict.fromkeys(SKIP_REASONS, 0)
            skipped_tokens = dict.fromkeys(SKIP_REASONS, 0)
            for w in workers:
                for reason in SKIP_REASONS:
                    skipped[reason] += w.stats.skipped[reason]
                    skipped_tokens[reason] += w.stats.skipped_tokens[reason]
            fallbacks: dict[str, int] = {}
            for w in workers:
                for reason, n in w.stats.fallbacks.items():
                    fallbacks[reason] = fallbacks.get(reason, 0) + n
            out[role] = {
                "computed_tokens": sum(w.stats.computed_tokens for w in workers),
                "pulls": sum(w.stats.pulls for w in workers),
                "read_s": sum(w.stats.read_s for w in workers),
                "read_wait_s": sum(w.stats.read_wait_s for w in workers),
                "pulled_tokens": sum(w.stats.pulled_pages for w in workers) * self.page_size,
                "pull_fallbacks": fallbacks,
                "pull_skipped": skipped,
                "pull_skipped_tokens": skipped_tokens,
                "missed_tokens": _sum_counts(w.stats.missed_tokens for w in workers),
                "lost_tokens": sum(w.stats.lost_tokens for w in workers),
                "pages_trimmed": sum(w.stats.pages_trimmed for w in workers),
                "mixed_steps": sum(w.stats.prompt_steps for w in workers),
                "mixed_step_s": sum(w.stats.prompt_step_s for w in workers),
                "page_waits": sum(w.stats.page_waits for w in workers),
                "page_wait_s": sum(w.stats.page_wait_s for w in workers),
                "no_room": sum(w.stats.no_room for w in workers),
                "no_room_held": _sum_counts(w.stats.no_room_held for w in workers),  # summed over those pulls
                "transfer_leases": _sum_counts(w.stats.transfer_leases_ended for w in workers),
                "transfer_lease_seconds": _sum_counts(w.stats.transfer_lease_seconds for w in workers),
            }
        return out

    def evicted_pages(self) -> dict[str, int]:
        return {
            "prefill": sum(w.cache.evicted for w in self.prefill),
            "decode": sum(w.cache.evicted for w in self.decode),
        }


_heappush = heapq.heappush


def _call(fn: Callable[[float], None], t: float) -> None:
    fn(t)


def _sum_counts(counts: Iterable[Mapping[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def _params(lease: WLease) -> dict[str, Any]:
    """The lease's kv_transfer_params as the gateway keeps them: its id, expiry and pages (the
    worker's page_ids and page_hashes, as counts)."""
    return {"lease_id": lease.lease_id, "expires_at": lease.expires_at, "pages": lease.pages, "stable": lease.stable}


def _expired_offer(worker: Worker, params: dict[str, Any]) -> WLease | None:
    """A lease the gateway still lists but its worker no longer holds: pulls of it fail, after the
    receiver planned them against the pages the params name (``Worker.pull``)."""
    expires_at = float(params.get("expires_at") or 0.0)
    if not expires_at:
        return None
    pages, stable = int(params.get("pages", 0)), int(params.get("stable", 0))
    return WLease("gone", worker, worker.cache.new_hold(), expires_at, None, pages, stable, gone=True)


def _synthetic_key(name: str) -> bytes:
    """``prefix_key`` of a prompt's first tokens: distinct prompts, distinct token ids."""
    rng = random.Random(name)
    return prefix_key([rng.randrange(32000) for _ in range(64)])


# ---------------------------------------------------------------------------------- metrics
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, as bench/agents.py computes it."""
    return _nearest_rank(sorted(values), q)


def _nearest_rank(s: list[float], q: float) -> float:
    if not s:
        return math.nan
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(records: list[TurnRecord], wall_s: float, *, waiting_ttfts: list[float] | None = None) -> dict[str, Any]:
    """The benchmark's per-point metrics over ``records``; ``waiting_ttfts``: turns without a
    reply by the end (their TTFT so far counts in the percentiles, not in the throughput)."""
    prompt = sum(r.prompt_tokens for r in records)
    later = [r for r in records if r.turn > 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    ttfts = sorted([r.ttft_s for r in records] + list(waiting_ttfts or []))  # sorted once for both percentiles
    latencies = sorted([r.latency_s for r in records])
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
        "ttft_p50_ms": _nearest_rank(ttfts, 0.50) * 1e3,
        "ttft_p99_ms": _nearest_rank(ttfts, 0.99) * 1e3,
        "latency_p50_ms": _nearest_rank(latencies, 0.50) * 1e3,  # whole turn, finished ones
        "latency_p99_ms": _nearest_rank(latencies, 0.99) * 1e3,
        "fallbacks": fallbacks,
    }


# ---------------------------------------------------------------------------------- scenarios
def run_bench_point(sim: Simulator, agent_ids: range, *, window_s: float | None = None) -> dict[str, Any]:
    """One point of bench/agents.py: every agent in ``agent_ids`` runs all its turns, starts
    spread over one mean think time; returns the point's metrics (evictions and preemptions
    included). ``window_s``: no turn starts that long after the point's start (those in flight
    finish and count), as the benchmark's ``--point-s``."""
    sim.release_all_leases()
    before = sim.evicted_pages()
    reclaimed = sim.reclaimed_leases()
    preempted = sim.preemptions()
    pulls = sim.pull_counters()
    start = sim.now
    sim.stop_at = math.inf if window_s is None else start + window_s
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
    point["decode_reclaimed_leases"] = sim.reclaimed_leases() - reclaimed
    for role, count in sim.preemptions().items():
        point[f"{role}_preemptions"] = count - preempted[role]
    for role, counts in sim.pull_counters().items():
        point.update({f"{role}_{k}": _minus(v, pulls[role][k]) for k, v in counts.items()})
    means_per_event(point)
    point["concurrency"] = n
    sim.stop_at = math.inf
    return point


@dataclass(slots=True, frozen=True)
class Population:
    """A steady population: ``agents`` slots, each running agents back to back for ``duration_s``.

    Slot j runs agents j, j + agents, j + 2 agents, ...; they start spread over ``ramp_s``.
    ``shapes``: draw only the first ``shapes`` agents of the spec and give slot agents their
    lengths and think times in turn (each a new conversation); drawn by ``sim_shapes.agent_shape``
    (``agent_load.agent`` without the text, which the simulator never reads)."""

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


def run_population(
    sim: Simulator, pop: Population, *, progress: Callable[[float], None] | None = None, shapes: dict[int, AgentSpec] | None = None
) -> dict[str, Any]:
    """Run ``pop`` on ``sim``; metrics over turns sent in [warmup_s, duration_s). ``shapes``:
    agents already drawn from ``sim.load`` (by index), reused across runs of the same load."""
    shapes = {} if shapes is None else shapes

    def spec_for(i: int) -> AgentSpec:
        j = i % pop.shapes
        if j not in shapes:
            shapes[j] = agent_shape(sim.load, j)  # agent(sim.load, j) without its text
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
    point["decode_reclaimed_leases"] = sim.reclaimed_leases()
    for role, counts in sim.pull_counters().items():
        point.update({f"{role}_{k}": v for k, v in counts.items()})
    means_per_event(point)
    point["unfinished"] = len(waiting)
    return point


def means_per_event(point: dict[str, Any]) -> None:
    """The per-event means of a point, from its summed counters (bench/agents.py's points and the replay's
    alike): ``{role}_no_room_held_pages``, the pool's pages by holder per pull that found no room
    (``{role}_no_room``, ``{role}_no_room_held``); ``{role}_transfer_lease_s``, the seconds a transfer
    lease held its pages, by how it ended (``{role}_transfer_leases``, ``{role}_transfer_lease_seconds``)."""
    for role in ("prefill", "decode"):
        n, held = point[f"{role}_no_room"], point[f"{role}_no_room_held"]
        point[f"{role}_no_room_held_pages"] = {k: round(v / n) if n else 0 for k, v in held.items()}
        ended, seconds = point[f"{role}_transfer_leases"], point[f"{role}_transfer_lease_seconds"]
        point[f"{role}_transfer_lease_s"] = {k: round(seconds[k] / c, 3) if c else 0.0 for k, c in ended.items()}


def _minus(after: Any, before: Any) -> Any:
    """A counter's growth: a number, or a dict of numbers by key."""
    if isinstance(after, dict):
        return {k: after[k] - before.get(k, 0) for k in after}
    return after - before

"""Simulated prefill and decode workers (``kvserving simulate``): the engine
loop's timing, the KV pool (``sim_cache.PageCache``), leases and NIXL pulls,
with the policies of ``worker/engine.py``, ``worker/scheduler.py`` and
``worker/kv/transfer.py``.

Both roles run the worker's scheduler step by step (``Worker._plan`` is
``Scheduler.schedule``): running sequences first, oldest first, each one
token (decode) or one chunk (prompt) within ``max_num_batched_tokens``; then
waiting requests FIFO while the budget, ``max_num_seqs`` and pages for all
their known tokens allow (the head of the queue waits: nothing overtakes it,
except in a step begun with nothing running, below: admission pins). Pages
come as a sequence grows, with retained conversations reclaimed first
(``KVCacheManager.allocate_until``); when a running sequence still finds none,
the most recently admitted one is **preempted**: its computed full pages join
the prefix cache (evictable), the rest are freed, and it goes back to the
front of the queue with the tokens it sampled (a step that preempted admits
nothing); readmitted, it recomputes whatever the cache no longer holds. A step costs ``CostModel.decode_step`` for
its one-token decodes plus ``CostModel.prefill_step`` for its prompt chunks. A run of identical decode steps
advances in one event (``_Run``) with the results of stepping each.

- A **prefill worker** computes the prompt and samples the reply's first
  token (gateway/turn.py: TTFT is the prefill's); the prompt's full pages stay
  pinned under a transfer lease until the decode worker pulls them (then
  released) or ``transfer_timeout_s`` passes.
- A **decode worker** computes what it neither holds nor pulled of the prompt
  and the prefill's token, then decodes one token per step until the reply
  ends; a one-token reply skips it. The full pages of prompt + reply are
  retained under a lease for ``retention_ttl_s`` (the conversation's older
  lease on the worker is released).
- **Pulls** follow ``KVTransfer.pull``: match the offered pages against the
  prompt, skip what the local cache holds, READ the rest when it is at least
  ``recompute_threshold_tokens`` and the sender still holds the lease, into
  pages allocated with reclaim (``allocate_for_pull``; ``pull_reclaims=False``:
  the worker before it, which refused a pull on a pool full of retained
  conversations and recomputed the prompt); the pulled pages are
  pinned until the request is admitted, with the local prefix the pull matched
  (a pull that reads nothing pins that prefix alone; ``pull_pins_local=False``:
  the worker before, which left it to the LRU). Those **admission pins** yield, after
  retained conversations, to a running sequence's growth, never to a pull
  (taken, their request would compute the pages again; a running sequence
  frees pages as it ends: ``PagePoolBase.allocate_reclaiming(up_to)``), giving up only
  the pages the allocation lacks, from the pin's tail (its request keeps the rest;
  ``pins_trim=False``: the worker before, whose pins yielded whole), and to the
  queue head's admission only while no sequence runs and no waiting request
  queued before the head was held up fits without them: those are admitted
  ahead of the head first, in queue order (``Scheduler._overtake``).
  ``idle_overtakes=False``: the worker before that, whose idle head took the
  pins at once; ``pins_yield_always=True``: the worker before these rules (and
  before ``pull_pins_local``), whose pins yielded to every allocation. A prefill
  worker's transfer hold is released once the decode's pull is over, read or not.
  The hold and its release are **engine calls** on the sender (``engine_call``):
  answered between its steps, so a busy prefill keeps a finished prompt's pages
  through its next step before the READ and until the step in progress ends after
  it (its steps of long prompt chunks: hundreds of ms each). The calls queued during a step
  all run before the next step is planned (``_run_calls``), adds among them too, as the
  engine thread's executor runs them before the step queued after them. A prefill's own pull plans
  on its engine thread too (``Puller._plan``: the match, the local prefix's pin, the pages
  to READ into), so it finds the room that the releases queued during the step in progress
  left. A pull that adopts (pins the READ's pages, or the local prefix it matched when it
  read nothing) adds the request in the adopt's engine call, asked once the plan returned
  (once the READ is over, for a pull that read), so on a busy prefill it waits for one more
  step; a pull that adopts nothing adds the request in one call asked the same way
  (``Simulator._at_prefill``; ``adopt_adds=False``: the worker before, whose add was a call
  of its own after the adopt's, a step later again).
- A decode worker's pull that finds no pages **waits for them** (``Puller.wait_for_pages``):
  it tries again where pages come back -- at the end of an engine step that
  ended sequences, preempted or released leases, or at a release or expiry
  while the engine is idle, at most once per ``PAGE_WAIT_POLL_S`` -- until
  ``PAGE_WAIT_SHARE * transfer_timeout_s`` after it was sent, then skips
  (``no_free_pages``) and the request recomputes. Meanwhile the request is
  not queued, the local prefix it matched stays pinned, and the sender's
  transfer hold stays (``pull_waits=False``: the worker before the wait,
  which skipped at once). A prefill worker's pull skips at once (its wait
  would be the turn's TTFT; ``KVTransfer``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvserving.config import ReuseConfig, SchedulerConfig
from kvserving.gateway.router import WorkerView
from kvserving.sim.cache import Hold, Key, PageCache
from kvserving.sim.costs import CostModel
from kvserving.worker.kv.leases import HOLD_MARGIN_S, NO_ROOM_HOLDERS
from kvserving.worker.kv.page_pool import PAGE_WAIT_POLL_S, PAGE_WAIT_SHARE

# how a prefill's transfer lease ends in the replay (``WorkerStats``; the worker's five: kv.leases.TRANSFER_ENDS)
SIM_TRANSFER_ENDS = ("released", "expired")
SKIP_REASONS = ("nothing_to_pull", "below_threshold", "no_free_pages")  # ``PullResult.skipped``: nothing pulled, no fault


@dataclass(slots=True, frozen=True)
class PullRules:
    """The KV pull and admission-pin rules a simulated worker follows: the current worker's by
    default; each one turned off replays the worker before it, for points measured on that worker."""

    pull_reclaims: bool = True  # a pull's pages reclaim retained conversations (``allocate_for_pull``)
    pull_waits: bool = True  # a decode worker's pull without free pages waits for them (a prefill worker's never does)
    pins_yield_always: bool = False  # admission pins yield to every allocation (the worker before the two rules below)
    idle_overtakes: bool = True  # an idle queue's held-up head lets requests that fit without pins run first
    pull_pins_local: bool = True  # a pull that reads nothing keeps the local prefix it matched pinned for admission
    pins_trim: bool = True  # an admission pin gives an allocation only the pages it lacks, from its tail (after idle_overtakes)
    adopt_adds: bool = True  # a prefill's pull that adopts adds its request in the adopt's engine call (not one call later)


@dataclass(slots=True, eq=False)
class Req:
    """One turn as the workers see it. Pages are counted from the prompt's start."""

    turn_id: int
    conv: str
    segs: list[tuple[Key, int]]
    prompt: int  # tokens
    output: int
    stable_prompt: int  # leading prompt pages every later prompt of the conversation repeats
    stable_stream: int  # the same for prompt + reply
    sent_at: float
    lease_offer: WLease | None = None  # what the gateway's lease table offers the prefill (D->P)
    # filled in on the way
    hold: Hold | None = None
    pin: WLease | None = None
    pulled: tuple[int, int] = (0, 0)  # pulled page range [a, b) pinned for this request
    in_place: int = 0  # pages its last pull found or put in place (lost_before_admission)
    hit_pages: int = 0
    remote_pages: int = 0
    fallback: str | None = None
    prefill_url: str = ""
    decode_url: str = ""
    cached_tokens: int = 0
    local_tokens: int = 0
    remote_tokens: int = 0
    first_token_at: float = 0.0
    done_at: float = 0.0
    transfer_offer: WLease | None = None  # the prefill's transfer lease (P->D)
    sampled: int = 0  # reply tokens sampled so far (the decode worker starts with the prefill's)
    preemptions: int = 0  # on the worker running it now
    queued: int = 0  # its place in the worker's queue order (``Sequence.queued``)


@dataclass(slots=True, eq=False)
class WLease:
    """A lease a worker holds: pinned pages, offered to another worker's pull."""

    lease_id: str
    worker: Worker
    hold: Hold
    expires_at: float
    conv: str | None
    pages: int  # full pages it holds (num_tokens // page_size)
    stable: int  # of those, the leading pages later prompts repeat (the hashes that match)
    reclaimable: bool = False  # a retained conversation: released early when pages run out
    yields: bool = False  # pulled pages waiting for admission: released early after retained conversations
    gone: bool = False  # released (no longer in its worker's ``leases``)
    created_at: float = 0.0

    def alive(self, now: float) -> bool:
        return not self.gone and self.expires_at > now


@dataclass(slots=True)
class PullOutcome:
    seconds: float = 0.0  # the READ on an idle GPU: its post and its copy (``CostModel.pull_s``)
    copy_s: float = 0.0  # of it, the copy: GPU work of the receiver's process on a shared GPU (``Worker.read``)
    fallback: str | None = None


_NO_PULL = PullOutcome()  # nothing pulled (shared: never mutated)


@dataclass(slots=True)
class WorkerStats:
    pulls: int = 0
    pulled_pages: int = 0
    pulled_bytes: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))  # pulls skipped, by reason
    skipped_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))  # prompt tokens they left to compute
    # by skip or fallback reason: the tokens it would have pulled (PullResult.missed_tokens)
    missed_tokens: dict[str, int] = field(default_factory=dict)
    page_waits: int = 0  # pulls that found no free page and waited for one
    no_room: int = 0  # pulls whose first allocation found no room (they waited or skipped)
    # summed over those: the pool's pages by holder then (``Worker.page_holders``, NO_ROOM_HOLDERS)
    no_room_held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NO_ROOM_HOLDERS, 0))
    # a prefill's transfer leases by how they ended (``released``: the decode's pull is over; ``expired``)
    # and the seconds they held their pages (the worker's ``TransferLifetimes``: lease and READ hold together)
    transfer_leases_ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SIM_TRANSFER_ENDS, 0))
    transfer_lease_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SIM_TRANSFER_ENDS, 0.0))
    page_wait_s: float = 0.0  # their waits, in all
    # on a shared GPU (``Worker.read``): the READs' own time, post and copy, and their waits for the READs before them
    read_s: float = 0.0
    read_wait_s: float = 0.0
    leases_expired: int = 0
    leases_reclaimed: int = 0  # leases and admission pins released early, trimmed to nothing included
    pages_trimmed: int = 0  # pages admission pins gave up from their tails (``PagePoolBase.trimmed_pages``)
    preemptions: int = 0
    computed_tokens: int = 0  # prompt tokens computed (chunks starting inside the prompt: the worker's prompt_tokens_total)
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    lost_tokens: int = 0  # prompt tokens a pull had in place that the first admission no longer found (lost_before_admission)
    prompt_steps: int = 0  # steps with prompt tokens (the worker's "mixed" steps) and their seconds as costed
    prompt_step_s: float = 0.0


@dataclass(slots=True, eq=False)
class _PullWait:
    """A pull waiting for pages (``Worker.pull``): what it would READ, and whom to tell."""

    req: Req
    offer: WLease
    hold: Hold  # the local prefix it matched, pinned while it waits (``_Plan.local_pin``)
    local: int
    matched: int
    want: int
    diverged: bool
    sent: float
    until: float  # it skips at this time unless pages came by then
    tried: float  # its last try
    then: Callable[[Req, PullOutcome, float], None]
    freed: bool = False  # pages came back since its last try
    over: bool = False


class Worker:
    """What both roles share: the pool, leases (with expiry) and pulls."""

    def __init__(
        self,
        url: str,
        *,
        sim: Sim,
        pages: int,
        page_size: int,
        dtype: str,
        costs: CostModel,
        reuse: ReuseConfig,
        sched: SchedulerConfig,
        rules: PullRules = PullRules(),
    ) -> None:
        self.url = url
        self.pull_reclaims = rules.pull_reclaims  # ``allocate_for_pull``: retained conversations yield to a pull
        self.pull_waits = rules.pull_waits  # ``Puller.wait_for_pages``: a pull without pages waits for them (False: skips at once)
        self.pins_yield_always = rules.pins_yield_always  # admission pins yield to admissions and pulls while sequences run
        # an idle queue's head lets the requests queued before it was held up that fit without pins go first
        self.idle_overtakes = rules.idle_overtakes and not rules.pins_yield_always
        self._queued = 0  # requests ever queued (``Req.queued``)
        # a pull that read nothing pins its local prefix for admission (not in the worker before held pins)
        self.pull_pins_local = rules.pull_pins_local and not rules.pins_yield_always
        # an admission pin yields only the pages an allocation lacks, from its tail (not in the workers before idle overtakes)
        self.pins_trim = rules.pins_trim and self.idle_overtakes
        self._held_up: tuple[Req, int] | None = None  # ``Scheduler._held_up``
        self.page_wait_s = PAGE_WAIT_SHARE * reuse.transfer_timeout_s
        self._pulls: list[_PullWait] = []  # pulls waiting for pages, oldest first
        self._retrying = False
        self.sim = sim
        self.cache = PageCache(pages)
        self.page_size = page_size
        self.page_bytes = costs.page_bytes(dtype, page_size)
        self.dtype = dtype
        self.costs = costs
        self.reuse = reuse
        self.sched = sched
        self.threshold_pages = _threshold_pages(reuse, page_size)
        self.attn_s = costs.attn_s(dtype)  # the cost model is frozen: per token x context, this format
        self.pull_ttl_s = max(60.0, 2 * reuse.transfer_timeout_s)
        self.leases: dict[str, WLease] = {}
        self.conv_lease: dict[str, str] = {}
        self._expiry: list[tuple[float, str]] = []
        self._reclaimable: list[tuple[float, str]] = []  # (expires_at, lease id) of reclaimable leases
        self._yielding: list[tuple[float, str]] = []  # the same for pulls' admission pins: reclaimed after those
        self._compact_at = 1024  # heap entries (both heaps) past which stale ones are dropped
        self._inflight = 0  # the gateway's count of this worker's open requests (``inflight``)
        self._board: list[Any] | None = None  # the router's inputs, ``board_entry(inflight)`` mirrored at ``_slot``
        self._slot = 0
        self.waiting: deque[Req] = deque()
        self.stats = WorkerStats()
        self._lease_seq = 0
        self._wake_at = float("inf")
        self.running: list[_Seq] = []  # in admission order
        self.busy = False  # a step runs
        self._planning = False  # a step is being planned: releases must not start another
        self._batch = False  # the engine calls queued during a step run: the next step waits for them all
        self._arrivals = 0
        self.gpu: Any = None  # a ``SharedGpu`` when the other role runs on the same GPU
        self.merge_steps = True  # a run of identical decode steps advances in one event (``_Run``)
        self._run: _Run | None = None
        self._run_version = 0  # the live run's end event carries it; a cut or a GPU hand-over voids older ones
        self._scratch = Hold(0)  # takes a run's pages in one allocation, then hands them to their holds
        self._calls: list[tuple[Callable[[Any, float], None], Any]] = []  # engine calls waiting for the step to end
        # READs waiting for the one in progress (``read``): (asked at, outcome, then, arg)
        self._reads: deque[tuple[float, PullOutcome, Callable[[Any, float], None], Any]] = deque()
        self._reading = False  # a READ posts or copies
        self._read_began = 0.0  # when it began, after the READs before it
        self.on_done: Callable[[Req, float], None] = lambda req, now: None

    @property
    def inflight(self) -> int:
        """The gateway's count of this worker's open requests."""
        return self._inflight

    @inflight.setter
    def inflight(self, n: int) -> None:
        self._inflight = n
        if self._board is not None:
            self._board[self._slot] = self.board_entry(n)

    def board_entry(self, n: int) -> Any:
        """What the router reads of this worker at load ``n``: the load itself."""
        return n

    def bind_board(self, board: list[Any], slot: int) -> None:
        """Keep ``board[slot]`` equal to ``board_entry(inflight)`` from now on."""
        self._board, self._slot = board, slot
        self.inflight = self._inflight

    # ------------------------------------------------------------------ engine steps
    def engine_call(self, fn: Callable[[Any, float], None], arg: Any, now: float) -> None:
        """Run ``fn(arg, t)`` where the worker's engine thread runs a call from its server (a
        transfer lease's hold, ``KVTransfer.hold``): between steps, so at once when no step
        runs, else when the step in progress ends, before the next one is planned."""
        if not self.busy:
            fn(arg, now)
        elif self._run is not None:  # a run's steps end at its times: the step in progress ends at the next
            self.sim.call_at(self._run.times[self._settle(now) + 1], fn, arg)
        else:
            self._calls.append((fn, arg))

    def _run_calls(self, now: float) -> None:
        """The engine calls queued during the step that just ended, in order, before the next step is
        planned: the engine thread is one single-thread executor (``AsyncEngine._run``), and the step
        is submitted after the calls queued before it, so an add among them does not start the step."""
        calls, self._calls = self._calls, []
        self._batch = True
        try:
            for fn, arg in calls:
                fn(arg, now)
        finally:
            self._batch = False

    def arrive(self, req: Req, now: float) -> None:
        run = self._run
        if run is not None:
            m = self._settle(now)
            if run.admits:  # the next step admits it
                self._cut(m)
        self._queued += 1
        req.queued = self._queued
        self.waiting.append(req)
        self._kick(now)

    def on_freed(self, now: float) -> None:
        """Pages came back: a request waiting for them may go, and a pull waiting for them tries
        again after the step in progress (at once when none runs or starts)."""
        if self._pulls:
            self._pages_back(now)
        if self.waiting:
            self._kick(now)
        if self._pulls and not self.busy and not self._planning:
            self._retry_pulls(now)

    def _kick(self, now: float) -> None:
        """Start a step unless one runs, is being planned (a release while planning lands here) or
        waits for the batch of engine calls in progress (its caller kicks once they are done)."""
        if not self.busy and not self._planning and not self._batch:
            self._start_step(now)

    def _start_step(self, now: float) -> None:
        self._planning = True
        try:
            heap = self._expiry
            if heap and heap[0][0] <= now:
                self.expire(now)
            plan = self._plan(now)
        finally:
            self._planning = False
        if not plan:
            if self.waiting or self._pulls:
                self.wake_when_leases_expire(now)
            return
        self.busy = True
        dt = self._step_seconds(plan)
        if any(seq.computed < seq.req.prompt for seq, _ in plan):
            self.stats.prompt_steps += 1
            self.stats.prompt_step_s += dt
        if self.merge_steps and self._start_run(plan, now, dt):
            return
        if self.gpu is not None:  # a GPU shared with the other role times the step (kvserving.sim.shared_gpu)
            self.gpu.start(self, now, dt, plan)
            return
        self.sim.call_at(now + dt, self._step_done, plan)

    def _plan(self, now: float) -> list[tuple[_Seq, int]]:
        """``Scheduler.schedule``: the chunks of the next step, as ``(sequence, tokens)``."""
        sched = self.sched
        budget = sched.max_num_batched_tokens
        chunk = sched.chunk_size
        p = self.page_size
        plan: list[tuple[_Seq, int]] = []
        running = self.running
        preempted = self.stats.preemptions
        for seq in list(running):  # oldest first; a page shortage preempts the newest
            if budget == 0:
                break
            if not seq.active:
                continue
            left = seq.tokens - seq.computed
            n = min(left, chunk, budget)
            if n < left:
                n -= n % p  # a non-final chunk ends on a page boundary
            if n <= 0:
                continue
            need = -(-(seq.computed + n) // p) - seq.pages
            if need > 0:
                hold = seq.req.hold
                assert hold is not None
                while not self.allocate(hold, need, now):
                    if self._preempt_newest(plan) is seq:
                        break
                if not seq.active:
                    continue
                seq.pages += need
            plan.append((seq, n))
            budget -= n
        waiting = self.waiting
        idle = not running
        # a step that preempted admits nothing (Scheduler.schedule)
        while waiting and budget > 0 and len(running) < sched.max_num_seqs and self.stats.preemptions == preempted:
            head = waiting[0]
            pins = self.pins_yield_always or (not self.idle_overtakes and not running)
            admitted = self._admit(head, budget, now, pins=pins)
            if admitted is None:
                if idle and self.idle_overtakes:
                    budget = self._overtake(plan, budget, now)
                break  # the head waits for pages (or budget)
            self._start(admitted, plan)
            budget -= admitted[1]
        return plan

    def _start(self, admitted: tuple[_Seq, int], plan: list[tuple[_Seq, int]]) -> None:
        """``Scheduler._start``: an admitted request leaves the queue and runs its first chunk."""
        seq, n = admitted
        req = seq.req
        if req is self.waiting[0]:
            self.waiting.popleft()
            self._held_up = None
        else:
            self.waiting.remove(req)
        self.running.append(seq)
        plan.append((seq, n))

    def _overtake(self, plan: list[tuple[_Seq, int]], budget: int, now: float) -> int:
        """``Scheduler._overtake``: a step begun with nothing running, and the queue's head does not fit
        without pins: the requests queued before the head was first held up that fit without pins run
        first, in queue order; if none did and still nothing runs, the head takes pins. The budget left."""
        head = self.waiting[0]
        if self._held_up is None or self._held_up[0] is not head:
            self._held_up = (head, self._queued)
        last = self._held_up[1]
        for req in [r for r in self.waiting if r is not head and r.queued <= last]:
            if budget == 0 or len(self.running) >= self.sched.max_num_seqs:
                return budget
            admitted = self._admit(req, budget, now, pins=False)
            if admitted is not None:
                self._start(admitted, plan)
                budget -= admitted[1]
        if not self.running:
            admitted = self._admit(head, budget, now, pins=True)
            if admitted is not None:
                self._start(admitted, plan)
                budget -= admitted[1]
        return budget

    def _admit(self, req: Req, budget: int, now: float, *, pins: bool) -> tuple[_Seq, int] | None:
        """``Scheduler._admit`` for a waiting ``req``: its cached prefix, pages for all its known tokens
        (all or nothing); the pull pin goes once it holds its own refs. ``pins``: the waiting requests'
        admission pins (its own included) may yield to it.

        One placement, with the whole cached prefix. The worker retries one that does not fit with
        only the matched pages that stay held (from scratch when none do), for its triaxial slabs,
        where matched pages inside one end of a buffer can block the other end. In one pool of pages
        (the replay's, every format's) that retry never fits: each matched page it gives up frees at
        most one page and needs one more.
        """
        p = self.page_size
        tokens = self._tokens(req)
        cache = self.cache
        h = cache.match(req.segs, (tokens - 1) // p)
        left = tokens - h * p
        n = min(left, self.sched.chunk_size, budget)
        if n < left:
            n -= n % p
        if n <= 0:
            return None
        hold = cache.new_hold()
        cache.ref(hold, req.segs, h)
        need = -(-tokens // p) - h
        if not self.allocate(hold, need, now, pins=pins):
            cache.release(hold)  # the prefix goes back to the cache, evictable like any other
            self._mark_freed()
            return None
        req.hold = hold
        if not req.preemptions:  # the first admission: what the prompt found cached (usage.cached_tokens)
            req.hit_pages = h
            self.stats.lost_tokens += max(0, req.in_place - h) * p
            a, b = req.pulled
            req.remote_pages = max(0, min(b, h) - a) if req.pin is not None and req.pin.alive(now) else 0
        if req.pin is not None:
            self.release(req.pin.lease_id, now)
            req.pin = None
        self._arrivals += 1
        return _Seq(req, tokens, h * p, h + need, h), n

    def _preempt_newest(self, plan: list[tuple[_Seq, int]]) -> _Seq:
        """``Scheduler._preempt_latest``: the most recently admitted sequence lets go of its pages
        (its computed full pages stay cached) and goes back to the front of the queue."""
        victim = self.running.pop()
        victim.active = False
        plan[:] = [entry for entry in plan if entry[0] is not victim]
        req = victim.req
        self._let_go(victim)
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        return victim

    def _let_go(self, seq: _Seq) -> None:
        """Publish ``seq``'s computed full pages that later prompts repeat, then free its hold."""
        req = seq.req
        hold = req.hold
        assert hold is not None
        end = min(seq.computed // self.page_size, self._stable(req))
        if end > seq.start:
            self.cache.publish(hold, req.segs, seq.start, end)
        self.cache.release(hold)
        req.hold = None
        self._mark_freed()

    def _step_seconds(self, plan: list[tuple[_Seq, int]]) -> float:
        """One step: its one-token decodes at the decode step's cost, its prompt chunks at the
        prefill step's; a step with both pays both (on a GPU the decodes replay a CUDA graph
        only in a step of decodes alone: a step with prompt tokens runs eagerly, whose host
        overhead is ``prefill_step_s``)."""
        batch = 0
        context = 0
        tokens = 0
        work = 0.0
        for seq, n in plan:
            if seq.decodes(n):
                batch += 1
                context += seq.computed + 1
            else:
                tokens += n
                work += n * (seq.computed + n / 2)
        costs = self.costs
        if not tokens:
            return costs.decode_step(self.dtype, batch, context)
        dt = costs.prefill_step(self.dtype, tokens, work)
        if batch:
            dt += costs.decode_step(self.dtype, batch, context)
        return dt

    def _step_done(self, plan: list[tuple[_Seq, int]], now: float) -> None:
        stats = self.stats
        for seq, n in plan:  # still busy: releases on the way must not plan a step in between
            req = seq.req
            if seq.computed < req.prompt:
                stats.computed_tokens += n
            if req.preemptions and not seq.decodes(n):
                stats.recomputed_tokens += n
            seq.computed += n
            if seq.computed >= seq.tokens:
                self._sampled(seq, now)
        if self._pulls:
            self._retry_pulls(now)  # between this step and the next (Puller.wait_for_pages' engine call)
        self.busy = False
        if self._calls:
            self._run_calls(now)
        self._kick(now)

    # ------------------------------------------------------------------ runs of decode steps
    def _start_run(self, plan: list[tuple[_Seq, int]], now: float, dt: float) -> bool:
        """Run ``plan`` (step 0, ``dt`` seconds, its pages allocated) and the identical steps after
        it as one event, when there are at least two (see ``_Run``); False: step it alone."""
        sched = self.sched
        admits = len(plan) < sched.max_num_batched_tokens and len(self.running) < sched.max_num_seqs
        if admits and self.waiting:
            return False  # the next step tries the queue's head
        for w in self._pulls:
            if w.freed:
                return False  # a waiting pull tries again at the end of a step to come
        gpu = self.gpu
        if gpu is not None and not gpu.alone(self):
            return False  # the other role's step sets this one's rate
        p = self.page_size
        steps = 1 << 62
        ctx = 0
        firsts: list[int] = []
        phase = [0] * p
        due: dict[int, int] = {}  # step -> sequences whose first new page comes after step p
        for seq, n in plan:
            req = seq.req
            c = seq.computed
            if n != 1 or c < req.prompt:
                return False  # a prompt chunk
            left = req.output - max(1, req.sampled)  # steps until its reply ends, that one included
            if left < steps:
                if left < 2:
                    return False
                steps = left
            ctx += c + 1
            first = seq.pages * p - c  # the first step whose token starts a page it lacks
            firsts.append(first)
            if first <= p:  # then every step j >= 1 with j = first mod p
                phase[first % p] += 1
            else:
                due[first] = due.get(first, 0) + 1
        a, c_s = self.costs.decode_step_parts(self.dtype, len(plan))
        run = _Run(
            plan=plan, times=[now], firsts=firsts, admits=admits, a=a, c=c_s, ctx0=ctx, version=0, steps=steps,
            expiry=self.next_expiry(), free=self.cache.free, due=due, phase=phase, dt=dt, ctx=ctx,
        )  # fmt: skip
        self._extend(run)
        if len(run.times) < 3:
            return False
        self._run_version += 1
        run.version = self._run_version
        self._run = run
        if gpu is not None:
            gpu.start_run(self, now)
        self.sim.call_at(run.times[-1], self._run_end, run.version)
        return True

    def _extend(self, run: _Run) -> bool:
        """Time up to ``_RUN_CHUNK`` more steps of an open run (fewer where one would end a reply,
        expire a lease or lack pages: the run closes there); whether any were added."""
        times = run.times
        t = times[-1]
        j = len(times) - 1  # the step that would start at t
        dt = run.dt  # step 0's: planned, timed and given its pages by ``_start_step``
        if j and (j >= run.steps or t >= run.expiry):
            run.open = False  # step j - 1 ends a reply, or step j expires a lease
            return False
        p = self.page_size
        phase, due, batch, a, c = run.phase, run.due, len(run.plan), run.a, run.c
        gpu = self.gpu
        free, ctx = run.free, run.ctx
        stop = j + _RUN_CHUNK
        added = False
        while True:
            if j:
                r = j % p
                if due and j in due:
                    phase[r] += due.pop(j)
                need = phase[r]
                if need > free:
                    run.open = False  # step j's pages might need a lease reclaimed or a preemption
                    break
                free -= need
                ctx += batch
                dt = a + c * ctx
            end = t + dt
            if gpu is not None and dt - (end - t) > 1e-9:
                run.open = False  # the shared GPU would not end step j there (SharedGpu._done)
                break
            times.append(end)
            added = True
            t = end
            j += 1
            if j >= run.steps or t >= run.expiry:
                run.open = False
                break
            if j >= stop:
                break
        run.free, run.ctx = free, ctx
        return added

    def _settle(self, now: float) -> int:
        """Allocate the pages of the run's steps planned by ``now`` (before anything else touches
        the pool); the step in progress at ``now``."""
        run = self._run
        assert run is not None
        times = run.times
        m = bisect_right(times, now) - 1
        if m > len(times) - 2:
            m = len(times) - 2
        if m > run.planned:
            self._run_pages(run, m)
        return m

    def _run_pages(self, run: _Run, upto: int) -> None:
        """The pages steps ``run.planned + 1 .. upto`` allocate. With no other pool operation in
        between (every one settles first) and none failing, allocating them all at once leaves
        the pool as step-by-step allocation would: pages are counted, not named, and eviction
        takes the same LRU pages in the same order whichever hold asks."""
        p = self.page_size
        lo = run.planned
        grown: list[tuple[_Seq, int]] = []
        total = 0
        for (seq, _), first in zip(run.plan, run.firsts):
            if upto < first:
                continue
            n = (upto - first) // p + 1
            if lo >= first:
                n -= (lo - first) // p + 1
            if n:
                grown.append((seq, n))
                total += n
        run.planned = upto
        scratch = self._scratch
        if not self.cache.allocate(scratch, total):
            raise AssertionError("a run's pages were counted free")
        scratch.loose = 0
        for seq, n in grown:
            hold = seq.req.hold
            assert hold is not None
            hold.loose += n
            seq.pages += n

    def _cut(self, m: int) -> None:
        """The run ends with step ``m`` (in progress): the next step is planned as usual."""
        run = self._run
        assert run is not None
        run.open = False
        times = run.times
        if m + 2 < len(times):
            del times[m + 2 :]
            self._run_version += 1
            run.version = self._run_version
            self.sim.call_at(times[-1], self._run_end, run.version)

    def _advance(self, run: _Run, upto: int) -> None:
        """Steps ``run.advanced .. upto - 1`` are over (none ended a reply): what ``_step_done`` did for each."""
        d = upto - run.advanced
        if d <= 0:
            return
        run.advanced = upto
        for seq, _ in run.plan:
            seq.computed += d
            seq.tokens += d
            req = seq.req
            req.sampled = max(1, req.sampled) + d

    def _run_end(self, version: int, now: float) -> None:
        """The run's last timed step is over: time more, or end it as ``_step_done`` ends a step."""
        run = self._run
        if run is None or run.version != version:
            return  # cut shorter, or handed to the shared GPU
        if run.open and self._extend(run):
            self.sim.call_at(run.times[-1], self._run_end, version)
            return
        last = len(run.times) - 2  # the run's last step
        if last > run.planned:
            self._run_pages(run, last)
        self._run = None
        if self.gpu is not None:
            self.gpu.end_run(self, run.times)
        d = last + 1 - run.advanced  # steps still to count, the last included
        for seq, _ in run.plan:
            req = seq.req
            s = max(1, req.sampled) + d
            seq.computed += d
            if s < req.output:
                req.sampled = s
                seq.tokens += d
            else:  # its reply ends with the last step
                req.sampled = s - 1
                seq.tokens += d - 1
                self._sampled(seq, now)
        if self._pulls:
            self._retry_pulls(now)
        self.busy = False
        if self._calls:
            self._run_calls(now)
        self._kick(now)

    def hand_run_to_gpu(self, now: float) -> None:
        """The other role starts a step (or the GPU's counters are read) during a run: the steps
        before ``now`` are over and the one in progress becomes a GPU job, as if stepped alone."""
        run = self._run
        assert run is not None
        m = self._settle(now)
        self._run = None
        self._run_version += 1
        self._advance(run, m)
        seconds = run.a + run.c * (run.ctx0 + m * len(run.plan))
        self.gpu.resume(self, run.times, m, seconds, run.plan)

    def catch_up(self, now: float) -> None:
        """Bring the pool and the sequences up to ``now`` (the run's steps planned by then
        allocated, those over counted), as stepping leaves them: before they are read."""
        run = self._run
        if run is not None:
            self._advance(run, self._settle(now))

    def _tokens(self, req: Req) -> int:
        """Tokens whose KV ``req`` needs before it samples its next token."""
        raise NotImplementedError

    def _stable(self, req: Req) -> int:
        """Leading pages of ``req``'s stream that later prompts repeat (the ones worth caching)."""
        raise NotImplementedError

    def _sampled(self, seq: _Seq, now: float) -> None:
        """``seq`` computed all it needed and sampled a token."""
        raise NotImplementedError

    def _leave(self, seq: _Seq) -> None:
        seq.active = False
        self.running.remove(seq)
        self._mark_freed()

    # ------------------------------------------------------------------ leases
    def pin(
        self,
        hold: Hold,
        *,
        ttl_s: float,
        now: float,
        conv: str | None,
        pages: int,
        stable: int,
        prefix: str,
        reclaimable: bool = False,
        yields: bool = False,
    ) -> WLease:
        """A lease on ``hold``'s pages. ``reclaimable``: a retained conversation, released early when
        pages run out (``RECLAIM_FIRST``); ``yields``: pulled pages waiting for their request's
        admission, released early only when no retained conversation is left (``RECLAIM_LAST``)."""
        run = self._run
        if run is not None:
            m = self._settle(now)
            if now + ttl_s <= run.times[-2]:
                self._cut(m)  # a later step of the run would expire it
            elif now + ttl_s < run.expiry:
                run.expiry = now + ttl_s  # nor may a step timed later
        self._lease_seq += 1
        lease = WLease(
            f"{prefix}{self.url}-{self._lease_seq}", self, hold, now + ttl_s, conv, pages, stable, reclaimable, yields, created_at=now
        )
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        if reclaimable:
            heapq.heappush(self._reclaimable, (lease.expires_at, lease.lease_id))
        elif yields:
            heapq.heappush(self._yielding, (lease.expires_at, lease.lease_id))
        if len(self._expiry) + len(self._reclaimable) + len(self._yielding) > self._compact_at:
            self._compact()
        return lease

    def _compact(self) -> None:
        """Drop the heap entries of released and renewed leases (``expire`` and ``reclaim_one``
        skip them anyway; the live ones pop in the same order), once they outnumber the live."""
        leases = self.leases
        live = 0
        for heap in (self._expiry, self._reclaimable, self._yielding):
            kept = []
            for entry in heap:
                lease = leases.get(entry[1])
                if lease is not None and lease.expires_at == entry[0]:
                    kept.append(entry)
            heapq.heapify(kept)
            heap[:] = kept
            live += len(kept)
        self._compact_at = 2 * live + 1024

    def _next_in(self, heap: list[tuple[float, str]]) -> WLease | None:
        """The live lease at the top of ``heap`` (entries of released or renewed leases dropped)."""
        while heap:
            expires, lease_id = heap[0]
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires_at == expires:
                return lease
            heapq.heappop(heap)  # released, or renewed (a newer entry is in the heap)
        return None

    def reclaim_one(self, now: float, *, pins: bool = True) -> bool:
        """``PagePoolBase.reclaim_one``: release the reclaimable lease with the earliest expiry, whole, a
        retained conversation before a pull's admission pin (whose pages stay cached); ``pins``:
        admission pins may go (``up_to=RECLAIM_LAST``), else retained conversations only."""
        for heap in (self._reclaimable, self._yielding) if pins else (self._reclaimable,):
            lease = self._next_in(heap)
            if lease is not None:
                heapq.heappop(heap)
                if lease.yields and self.pins_trim:  # trimmed to nothing at once
                    self.stats.pages_trimmed += self.cache.held(lease.hold)
                self.stats.leases_reclaimed += 1
                self.release(lease.lease_id, now)
                return True
        return False

    def _yield_one(self, n: int, now: float, *, pins: bool) -> bool:
        """``PagePoolBase._yield_one`` for ``n`` pages: a retained conversation goes whole; with none
        left, the earliest admission pin (``pins``) gives up the pages the allocation lacks from its
        tail (``pins_trim``; whole when that is all it holds, else always whole)."""
        if self.pins_trim and pins and self._next_in(self._reclaimable) is None:
            lease = self._next_in(self._yielding)
            short = max(1, n - self.cache.free)
            if lease is not None and short < self.cache.held(lease.hold):
                if self._run is not None:
                    self._settle(now)
                self.stats.pages_trimmed += self.cache.trim(lease.hold, short)
                self.on_freed(now)
                return True
        return self.reclaim_one(now, pins=pins)

    def allocate(self, hold: Hold, n: int, now: float, *, pins: bool = True) -> bool:
        """``KVCacheManager.allocate_until``: retained conversations yield to live requests, then
        (``pins``) admission pins, their tails first; none yields when all of them together would not
        make room."""
        cache = self.cache
        if cache.allocate(hold, n):
            return True
        yielding = [lease.hold for lease in self.leases.values() if lease.reclaimable or (pins and lease.yields)]
        if not cache.could_fit_after_release(yielding, n):
            return False
        while not cache.allocate(hold, n):
            if not self._yield_one(n, now, pins=pins):
                return False
        return True

    def release(self, lease_id: str, now: float) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        if self._run is not None:
            self._settle(now)
        lease.gone = True
        if not lease.reclaimable and not lease.yields:  # a prefill's transfer lease
            end = "expired" if lease.expires_at <= now else "released"
            self.stats.transfer_leases_ended[end] += 1
            self.stats.transfer_lease_seconds[end] += now - lease.created_at
        self.cache.release(lease.hold)
        if lease.conv is not None and self.conv_lease.get(lease.conv) == lease_id:
            del self.conv_lease[lease.conv]
        self.on_freed(now)
        return True

    def renew(self, lease_id: str, *, ttl_s: float, now: float) -> float | None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.expires_at <= now:
            return None
        lease.expires_at = now + min(ttl_s, self.reuse.retention_ttl_s)
        heapq.heappush(self._expiry, (lease.expires_at, lease_id))
        if lease.reclaimable:
            heapq.heappush(self._reclaimable, (lease.expires_at, lease_id))
        return lease.expires_at

    def expire(self, now: float) -> None:
        """Release every lease whose expiry has passed (the engine does it every step)."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                self.stats.leases_expired += 1
                self.release(lease_id, now)

    def next_expiry(self) -> float:
        heap = self._expiry
        while heap and (heap[0][1] not in self.leases or self.leases[heap[0][1]].expires_at != heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def wake_when_leases_expire(self, now: float) -> None:
        """The queue waits for pages that only an expiry frees: look again then."""
        t = self.next_expiry()
        if t < self._wake_at:
            self._wake_at = t
            self.sim.at(t, self._wake)

    def _wake(self, now: float) -> None:
        self._wake_at = float("inf")
        self.expire(now)
        self.on_freed(now)

    # ------------------------------------------------------------------ pulls
    def pull(self, req: Req, offer: WLease | None, now: float, then: Callable[[Req, PullOutcome, float], None]) -> None:
        """``KVTransfer.pull`` against ``offer`` (the sender's lease as the receiver knows it);
        ``then(req, outcome, t)`` when it is over: now, or when a pull waiting for pages got them
        or gave up (``Puller.wait_for_pages``)."""
        req.in_place = 0
        if offer is None:
            then(req, _NO_PULL, now)
            return
        if self._run is not None:
            self._cut(self._settle(now))  # the pull takes pages the run counted on
        if offer.expires_at <= now:
            then(req, self._fail("lease_expired"), now)
            return
        p = self.page_size
        limit = (req.prompt - 1) // p
        usable = min(offer.pages, limit)
        matched = min(usable, offer.stable)
        diverged = matched < usable
        local = self.cache.match(req.segs, matched)
        want = matched - local
        req.in_place = local  # what a skip or a fallback leaves (lost_before_admission: the leading local pages)
        if want <= 0 or want < self.threshold_pages:
            if diverged:
                out = self._fail("hash_mismatch", max(0, want) * p)
            else:
                self._skip("nothing_to_pull" if want <= 0 else "below_threshold", req.prompt - local * p, max(0, want) * p)
                out = _NO_PULL
            self._pin_local(req, local, now)
            then(req, out, now)
            return
        hold = self.cache.new_hold()
        self.cache.ref(hold, req.segs, local)
        if not offer.alive(now):
            # released since the gateway listed it (reclaimed): the receiver plans and allocates the
            # pages (``Puller._plan``) before the holder answers that it no longer knows the lease;
            # they go back free, what they evicted stays evicted. Without pages a prefill's pull skips
            # before that answer counts (a decode's, which would wait for pages first, fails at once)
            got = self._allocate_for_pull(hold, want, now)
            if not got:
                self._count_no_room(hold)
            self.cache.release(hold)
            self._mark_freed()
            if got or self.pull_waits:
                out = self._fail("lease_expired", want * p)
            else:
                self._skip("no_free_pages", req.prompt - local * p, want * p)
                out = _NO_PULL
            self._pin_local(req, local, now)
            then(req, out, now)
            return
        if self._allocate_for_pull(hold, want, now):
            then(req, self._pulled(req, offer, hold, local, matched, diverged, now), now)
            return
        self._count_no_room(hold)
        if not self.pull_waits:
            self.cache.release(hold)
            self._skip("no_free_pages", req.prompt - local * p, want * p)
            self._mark_freed()
            self._pin_local(req, local, now)
            then(req, _NO_PULL, now)
            return
        wait = _PullWait(req, offer, hold, local, matched, want, diverged, now, now + self.page_wait_s, now, then)
        self._pulls.append(wait)
        self.stats.page_waits += 1
        if not offer.reclaimable:  # a prefill's transfer lease: the hold (taken as the pull was sent) keeps its pages
            offer.worker.hold_pages(offer, now + self.reuse.transfer_timeout_s + HOLD_MARGIN_S)
        self.sim.call_at(wait.until, self._give_up, wait)
        if not self.busy:
            self.wake_when_leases_expire(now)

    def page_holders(self, pulling: Hold) -> dict[str, int]:
        """``PagePoolBase.page_holders`` by ``NO_ROOM_HOLDERS`` (the puller's split of never-reclaimed pins):
        running requests, transfer leases, the local prefixes of pulls in progress (``pulling``: the one
        asking now), retained conversations, pulled pages waiting for admission."""
        classes: dict[str, list[Hold]] = {name: [] for name in NO_ROOM_HOLDERS}
        classes["requests"] = [s.req.hold for s in self.running if s.req.hold is not None]
        classes["pins_pulling"] = [pulling] + [w.hold for w in self._pulls]
        for lease in self.leases.values():
            kind = "pins_retained" if lease.reclaimable else "pins_pulled" if lease.yields else "pins_transfer"
            classes[kind].append(lease.hold)
        return dict(zip(NO_ROOM_HOLDERS, self.cache.holders([classes[name] for name in NO_ROOM_HOLDERS])))

    def _count_no_room(self, pulling: Hold) -> None:
        self.stats.no_room += 1
        for name, n in self.page_holders(pulling).items():
            self.stats.no_room_held[name] += n

    def _pin_local(self, req: Req, local: int, now: float) -> None:
        """``Puller.pull`` that read nothing: the ``local`` prefix pages it matched wait for the request
        under an admission pin, as pulled pages do (``pull_pins_local=False``: the worker before, which
        left them to the LRU)."""
        if local <= 0 or not self.pull_pins_local:
            return
        hold = self.cache.new_hold()
        self.cache.ref(hold, req.segs, local)
        req.pin = self.pin(hold, ttl_s=self.pull_ttl_s, now=now, conv=None, pages=0, stable=0, prefix="pull-", yields=True)
        req.pulled = (local, local)

    def _allocate_for_pull(self, hold: Hold, n: int, now: float) -> bool:
        """``allocate_for_pull``: one call on the engine thread, so no step starts inside it (a
        reclaimed lease's pages go to the pull); the queue may take what is left afterwards.
        Retained conversations yield to it, admission pins do not (``pins_yield_always``: they did)."""
        if not self.pull_reclaims:
            return self.cache.allocate(hold, n)
        planning = self._planning
        reclaimed = self.stats.leases_reclaimed
        self._planning = True
        try:
            got = self.allocate(hold, n, now, pins=self.pins_yield_always)
        finally:
            self._planning = planning
        if self.stats.leases_reclaimed != reclaimed and self.waiting and not planning:
            self._kick(now)  # what the pull left of the reclaimed pages
        return got

    def _pulled(self, req: Req, offer: WLease, hold: Hold, local: int, matched: int, diverged: bool, now: float) -> PullOutcome:
        """The pull's pages are allocated (``hold``, after the local prefix): the READ and its pin."""
        self.cache.publish(hold, req.segs, local, matched)
        req.pin = self.pin(hold, ttl_s=self.pull_ttl_s, now=now, conv=None, pages=0, stable=0, prefix="pull-", yields=True)
        req.pulled = (local, matched)
        req.in_place = matched
        want = matched - local
        nbytes = want * offer.worker.page_bytes
        self.stats.pulls += 1
        self.stats.pulled_pages += want
        self.stats.pulled_bytes += nbytes
        out = PullOutcome(seconds=self.costs.pull_s(nbytes), copy_s=self.costs.copy_s(nbytes))
        if diverged:
            out.fallback = self._count("hash_mismatch")
        return out

    def read(self, out: PullOutcome, then: Callable[[Any, float], None], arg: Any, now: float) -> None:
        """The READ of a pull that got its pages; ``then(arg, t)`` when it is over. Alone on its GPU it
        takes ``out.seconds``. On a GPU shared with the other role (``SharedGpu``) the worker's READs go
        one at a time: each posts (``out.seconds - out.copy_s``), then copies as work of this worker's
        process, which waits for its step in progress and shares the device with the other role's, so
        a READ slows with the load and the prompts of one burst reach the engine a READ apart."""
        if self.gpu is None:
            self.sim.call_at(now + out.seconds, then, arg)
            return
        self._reads.append((now, out, then, arg))
        if not self._reading:
            self._next_read(now)

    def _next_read(self, now: float) -> None:
        self._reading = True
        self._read_began = now
        out = self._reads[0][1]
        self.sim.call_at(now + max(0.0, out.seconds - out.copy_s), self._post_done, None)

    def _post_done(self, _: Any, now: float) -> None:
        self.gpu.copy(self, now, self._reads[0][1].copy_s, self._read_done, None)

    def _read_done(self, _: Any, now: float) -> None:
        asked, _out, then, arg = self._reads.popleft()
        self.stats.read_s += now - self._read_began
        self.stats.read_wait_s += self._read_began - asked
        self._reading = False
        if self._reads:
            self._next_read(now)
        then(arg, now)

    def _mark_freed(self) -> None:
        """Pages came back (or may have): every waiting pull tries again at its next chance."""
        for w in self._pulls:
            w.freed = True

    def _pages_back(self, now: float) -> None:
        """``_mark_freed`` outside a step: a run of decode steps ends after the step in progress, so
        that the pulls try at its end as they would after stepping it."""
        self._mark_freed()
        if self._run is not None:
            self._cut(self._settle(now))

    def _retry_pulls(self, now: float) -> None:
        """Between engine steps (or with none running): each waiting pull whose pages may have come
        back tries ``allocate_for_pull`` again, oldest first, once per ``PAGE_WAIT_POLL_S`` at most."""
        if self._retrying:
            return  # a lease a try reclaimed came back to ``on_freed``
        self._retrying = True
        try:
            poll_at = float("inf")
            for w in list(self._pulls):
                if not w.freed or w.over or now >= w.until:
                    continue  # nothing came back since its last try, or it gives up now (``_give_up``)
                if now < w.tried + PAGE_WAIT_POLL_S:
                    poll_at = min(poll_at, w.tried + PAGE_WAIT_POLL_S)
                    continue
                w.freed = False
                w.tried = now
                if self._allocate_for_pull(w.hold, w.want, now):
                    w.over = True
                    self._pulls.remove(w)
                    self.stats.page_wait_s += now - w.sent
                    w.then(w.req, self._pulled(w.req, w.offer, w.hold, w.local, w.matched, w.diverged, now), now)
        finally:
            self._retrying = False
        if poll_at < float("inf"):
            self.sim.at(poll_at, self._poll)  # with a step running then, its end tries instead

    def _poll(self, now: float) -> None:
        """A waiting pull's next try came due with no step running (one running tries at its end)."""
        if self._pulls and not self.busy and not self._planning:
            self._retry_pulls(now)

    def _give_up(self, w: _PullWait, now: float) -> None:
        """``PAGE_WAIT_SHARE`` of the transfer timeout passed without pages: skip, the request recomputes."""
        if w.over:
            return
        w.over = True
        self._pulls.remove(w)
        if self._run is not None:
            self._settle(now)  # the prefix's pin goes: a pool operation
        self.stats.page_wait_s += now - w.sent
        self.cache.release(w.hold)
        self._skip("no_free_pages", w.req.prompt - w.local * self.page_size, w.want * self.page_size)
        self._pin_local(w.req, w.local, now)
        w.then(w.req, _NO_PULL, now)
        self.on_freed(now)

    def hold_pages(self, lease: WLease, until: float) -> None:
        """A puller's hold on a transfer lease's pages: they stay until ``until`` unless released first."""
        if lease.gone or lease.expires_at >= until:
            return
        lease.expires_at = until
        heapq.heappush(self._expiry, (until, lease.lease_id))

    def _skip(self, reason: str, tokens: int, missed: int) -> None:
        stats = self.stats
        stats.skipped[reason] += 1
        stats.skipped_tokens[reason] += tokens
        if missed:
            stats.missed_tokens[reason] = stats.missed_tokens.get(reason, 0) + missed

    def _count(self, reason: str) -> str:
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        return reason

    def _fail(self, reason: str, missed: int = 0) -> PullOutcome:
        if missed:
            self.stats.missed_tokens[reason] = self.stats.missed_tokens.get(reason, 0) + missed
        return PullOutcome(fallback=self._count(reason))


def _threshold_pages(reuse: ReuseConfig, page_size: int) -> int:
    t = reuse.recompute_threshold_tokens
    tokens = 64 if t == "auto" else int(t)  # "auto" before both rates are measured: 64
    return -(-tokens // page_size) if tokens > 0 else 1


_RUN_CHUNK = 16  # steps a run times ahead at a time (most runs are cut within a few)


@dataclass(slots=True, eq=False)
class _Run:
    """Decode steps of one plan advanced in one event (``Worker.merge_steps``).

    While no admission can happen, no reply ends, no lease expires and the shared GPU (if any)
    runs nothing else, every step repeats the plan: one token per sequence, a step time that
    only grows with the context. Step ``j`` runs ``[times[j], times[j + 1])`` with the time
    ``_step_seconds`` gives it and ``times[j + 1] = times[j] + dt`` as stepping adds it; the
    steps are timed ``_RUN_CHUNK`` at a time (``_extend``), the run's event sits at the end of
    the last one timed. A sequence needing a page does not end the run: while the run's pages
    fit in the pool's free and evictable pages, none fails or reclaims, so they are allocated
    lazily (``_settle``, before any other pool operation). An arrival that the next step would
    admit, a pull or a lease that a later step would expire cuts the run after the step in
    progress; the shared GPU's other role starting a step turns that step into a GPU job
    (``hand_run_to_gpu``). Results equal stepping one event per step (tests/test_sim_merged_steps.py)."""

    plan: list[tuple[_Seq, int]]
    times: list[float]
    firsts: list[int]  # per plan entry: the step allocating its next page (then every page_size steps)
    admits: bool  # the plan leaves room for the queue's head (an arrival cuts the run)
    a: float  # a step's seconds: a + c * context tokens (CostModel.decode_step_parts)
    c: float
    ctx0: int  # context tokens of step 0 (each step adds one per sequence)
    version: int
    steps: int  # the run's steps at most: its first reply ends with the last
    expiry: float  # no step may start at or after it (the first lease to expire)
    free: int  # pages the pool could still give the steps timed next without reclaiming
    due: dict[int, int]  # step -> sequences whose first page it allocates (not yet timed)
    phase: list[int]  # sequences allocating at every step j with j % page_size == index
    dt: float  # step 0's seconds
    ctx: int  # context tokens of the last step timed
    open: bool = True  # more steps may be timed
    planned: int = 0  # steps whose pages are allocated
    advanced: int = 0  # steps counted in the sequences


@dataclass(slots=True, eq=False)
class _Seq:
    """A request the engine runs: KV for ``tokens`` tokens is needed before it samples next,
    ``computed`` have it, ``pages`` pages cover the first ``pages * page_size``; ``start``
    pages came from the cache at its admission."""

    req: Req
    tokens: int
    computed: int
    pages: int
    start: int
    active: bool = True

    def decodes(self, n: int) -> bool:
        """Whether a chunk of ``n`` of its tokens is a decode: one token past its prompt (the worker's
        ``is_decode_step``, chunk by chunk)."""
        return n == 1 and self.computed >= self.req.prompt


class PrefillWorker(Worker):
    """Prompt steps; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        sim: Sim,
        pages: int,
        page_size: int,
        dtype: str,
        costs: CostModel,
        reuse: ReuseConfig,
        sched: SchedulerConfig,
        rules: PullRules = PullRules(),
    ) -> None:
        super().__init__(
            url,
            sim=sim,
            pages=pages,
            page_size=page_size,
            dtype=dtype,
            costs=costs,
            reuse=reuse,
            sched=sched,
            # its pages free only as decode workers pull its transfer leases, and its waits are TTFT
            rules=replace(rules, pull_waits=False),
        )
        self._view_by_load: dict[int, WorkerView] = {}
        self.merge_steps = False  # its steps are prompt chunks

    def board_entry(self, n: int) -> WorkerView:
        """The router's view of this worker at load ``n``."""
        view = self._view_by_load.get(n)
        if view is None:  # immutable, so one per load value serves every routing
            view = self._view_by_load[n] = WorkerView(self.url, True, n)
        return view

    def _tokens(self, req: Req) -> int:
        return req.prompt

    def _stable(self, req: Req) -> int:
        return req.stable_prompt

    def _sampled(self, seq: _Seq, now: float) -> None:
        """The prompt is computed and the reply's first token sampled: the request ends here."""
        self._leave(seq)
        req = seq.req
        p = self.page_size
        full = req.prompt // p
        hold = req.hold
        assert hold is not None
        self.cache.publish(hold, req.segs, seq.start, min(full, req.stable_prompt))
        partial = seq.pages - full
        hold.loose -= partial  # the partial last page is unhashed: freed now
        self.cache.used -= partial
        req.transfer_offer = self.pin(
            hold,
            ttl_s=self.reuse.transfer_timeout_s,
            now=now,
            conv=None,
            pages=full,
            stable=min(full, req.stable_prompt),
            prefix="xfer-",
        )
        req.hold = None
        self.on_done(req, now)


class DecodeWorker(Worker):
    """Decode steps; see the module docstring."""

    def _tokens(self, req: Req) -> int:
        return req.prompt + max(1, req.sampled)  # the prompt and every token sampled (the prefill's first)

    def _stable(self, req: Req) -> int:
        return req.stable_stream

    def _sampled(self, seq: _Seq, now: float) -> None:
        req = seq.req
        req.sampled = max(1, req.sampled) + 1
        if req.sampled < req.output:
            seq.tokens += 1  # the token just sampled: its KV comes with the next step
            return
        self._leave(seq)
        self._finish(seq, now)

    def _finish(self, seq: _Seq, now: float) -> None:
        req = seq.req
        p = self.page_size
        hold = req.hold
        assert hold is not None
        held = seq.pages
        full = min((req.prompt + req.output - 1) // p, held)  # the last sampled token has no KV
        keep = min(full, req.stable_stream)
        if keep > seq.start:
            self.cache.publish(hold, req.segs, seq.start, keep)
        extra = held - full  # partial last page: freed
        hold.loose -= extra
        self.cache.used -= extra
        req.done_at = now
        req.hold = None
        lease = None
        if self.sim.bidirectional:
            lease = self.pin(
                hold, ttl_s=self.reuse.retention_ttl_s, now=now, conv=req.conv, pages=full, stable=keep, prefix="kv-", reclaimable=True
            )
            old = self.conv_lease.get(req.conv)
            self.conv_lease[req.conv] = lease.lease_id
            if old is not None:
                self.release(old, now)
        else:
            self.cache.release(hold)
        req.transfer_offer = lease
        self.on_done(req, now)


class Sim:
    """What workers need of the simulator: the clock, scheduling and the reuse switch."""

    now: float
    bidirectional: bool

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        raise NotImplementedError

    def call_at(self, t: float, fn: Callable[[Any, float], None], arg: Any) -> None:
        raise NotImplementedError

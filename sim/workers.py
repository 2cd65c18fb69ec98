"""Simulated prefill and decode workers (``kvserving simulate``): the engine
loop's timing, the KV pool (``sim_cache.PageCache``), leases and NIXL pulls,
with the policies of ``worker/engine.py``, ``worker/scheduler.py`` and
``worker/kv/transfer.py``.

- A **prefill worker** runs engine steps: running prompts continue, then
  waiting ones are admitted FIFO while the token budget, ``max_num_seqs`` and
  free pages allow (the head of the queue waits for pages: nothing overtakes
  it); one step costs ``CostModel.prefill_step``. A finished prompt's full
  pages stay pinned under a transfer lease until the decode worker pulls them
  (then released) or ``transfer_timeout_s`` passes.
- A **decode worker** is fluid: every running sequence gains one token per
  step, so one step counter ``S`` advances at 1 / step time (``decode_step`` of
  the batch and its context) and a sequence ends when ``S`` reaches its target.
  The prefill worker's sampled token is the reply's first (gateway/turn.py:
  TTFT is the prefill's); the decode computes it and the few prompt tokens it
  neither holds nor pulled (stalling the batch that long), then runs
  ``output - 1`` steps; a one-token reply skips the decode. Admission takes
  pages for the prompt and the first token; the reply's pages are taken when
  it ends (with reclaim; no preemption is modelled, so a reply that finds no
  pages keeps only what it holds). Pages for the prompt and the whole reply are
  taken at admission (no preemption); when it ends, its full pages are
  retained under a lease for ``retention_ttl_s`` (the conversation's older
  lease on the worker is released).
- **Pulls** follow ``KVTransfer.pull``: match the offered pages against the
  prompt, skip what the local cache holds, READ the rest when it is at least
  ``recompute_threshold_tokens`` and the sender still holds the lease; the
  pulled pages are pinned until the request is admitted. A prefill worker's
  transfer hold is released once the decode's pull is over, read or not.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserving.config import ReuseConfig, SchedulerConfig
from kvserving.gateway.router import WorkerView
from kvserving.sim.cache import Hold, Key, PageCache
from kvserving.sim.costs import CostModel


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
    gone: bool = False  # released (no longer in its worker's ``leases``)

    def alive(self, now: float) -> bool:
        return not self.gone and self.expires_at > now


@dataclass(slots=True)
class PullOutcome:
    seconds: float = 0.0
    fallback: str | None = None


_NO_PULL = PullOutcome()  # nothing pulled (shared: never mutated)


@dataclass(slots=True)
class WorkerStats:
    pulls: int = 0
    pulled_pages: int = 0
    pulled_bytes: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)
    leases_expired: int = 0
    leases_reclaimed: int = 0


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
    ) -> None:
        self.url = url
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
        self._compact_at = 1024  # heap entries (both heaps) past which stale ones are dropped
        self._inflight = 0  # the gateway's count of this worker's open requests (``inflight``)
        self._board: list[Any] | None = None  # the router's inputs, ``board_entry(inflight)`` mirrored at ``_slot``
        self._slot = 0
        self.waiting: deque[Req] = deque()
        self.stats = WorkerStats()
        self._lease_seq = 0
        self._wake_at = float("inf")
        self._admitting = False  # releases during admission must not re-enter it

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

    # ------------------------------------------------------------------ arrivals
    def arrive(self, req: Req, now: float) -> None:
        self.waiting.append(req)
        self._admit(now)

    def on_freed(self, now: float) -> None:
        """Pages came back: a request waiting for them may go."""
        if self.waiting and not self._admitting:
            self._admit(now)

    def _admit(self, now: float) -> bool:
        """Admit what fits; True when that rescheduled the role's next event. Never re-entered:
        a release during admission calls ``on_freed``, which must not start a second one."""
        if self._admitting:
            return False
        self._admitting = True
        try:
            return self._admit_waiting(now)
        finally:
            self._admitting = False

    def _admit_waiting(self, now: float) -> bool:
        raise NotImplementedError

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
    ) -> WLease:
        self._lease_seq += 1
        lease = WLease(f"{prefix}{self.url}-{self._lease_seq}", self, hold, now + ttl_s, conv, pages, stable, reclaimable)
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        if reclaimable:
            heapq.heappush(self._reclaimable, (lease.expires_at, lease.lease_id))
        if len(self._expiry) + len(self._reclaimable) > self._compact_at:
            self._compact()
        return lease

    def _compact(self) -> None:
        """Drop the heap entries of released and renewed leases (``expire`` and ``reclaim_one``
        skip them anyway; the live ones pop in the same order), once they outnumber the live."""
        leases = self.leases
        live = 0
        for heap in (self._expiry, self._reclaimable):
            kept = []
            for entry in heap:
                lease = leases.get(entry[1])
                if lease is not None and lease.expires_at == entry[0]:
                    kept.append(entry)
            heapq.heapify(kept)
            heap[:] = kept
            live += len(kept)
        self._compact_at = 2 * live + 1024

    def reclaim_one(self, now: float) -> bool:
        """``PagePoolBase.reclaim_one``: release the reclaimable lease with the earliest expiry."""
        heap = self._reclaimable
        while heap:
            expires, lease_id = heapq.heappop(heap)
            lease = self.leases.get(lease_id)
            if lease is None or lease.expires_at != expires:
                continue  # released, or renewed (a newer entry is in the heap)
            self.stats.leases_reclaimed += 1
            self.release(lease_id, now)
            return True
        return False

    def allocate(self, hold: Hold, n: int, now: float) -> bool:
        """``KVCacheManager.allocate_until``: retained conversations yield to live requests."""
        while not self.cache.allocate(hold, n):
            if not self.reclaim_one(now):
                return False
        return True

    def release(self, lease_id: str, now: float) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        lease.gone = True
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
    def pull(self, req: Req, offer: WLease | None, now: float) -> PullOutcome:
        """``KVTransfer.pull`` against ``offer`` (the sender's lease as the receiver knows it)."""
        if offer is None:
            return _NO_PULL
        if offer.expires_at <= now:
            return self._fail("lease_expired")
        limit = (req.prompt - 1) // self.page_size
        usable = min(offer.pages, limit)
        matched = min(usable, offer.stable)
        diverged = matched < usable
        local = self.cache.match(req.segs, matched)
        want = matched - local
        if want <= 0 or want < self.threshold_pages:
            return self._fail("hash_mismatch") if diverged else _NO_PULL
        if not offer.alive(now):
            return self._fail("lease_expired")
        hold = self.cache.new_hold()
        self.cache.ref(hold, req.segs, local)
        if not self.cache.allocate(hold, want):
            self.cache.release(hold)
            return _NO_PULL  # skipped: no_free_pages
        self.cache.publish(hold, req.segs, local, matched)
        req.pin = self.pin(hold, ttl_s=self.pull_ttl_s, now=now, conv=None, pages=0, stable=0, prefix="pull-")
        req.pulled = (local, matched)
        nbytes = want * offer.worker.page_bytes
        self.stats.pulls += 1
        self.stats.pulled_pages += want
        self.stats.pulled_bytes += nbytes
        out = PullOutcome(seconds=self.costs.pull_s(nbytes))
        if diverged:
            out.fallback = self._count("hash_mismatch")
        return out

    def _count(self, reason: str) -> str:
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        return reason

    def _fail(self, reason: str) -> PullOutcome:
        return PullOutcome(fallback=self._count(reason))

    # ------------------------------------------------------------------ admission
    def admit_pages(self, req: Req, total_pages: int) -> bool:
        """Match the prefix, take refs, allocate the rest (all or nothing); drop the pull pin."""
        limit = (req.prompt - 1) // self.page_size
        cache = self.cache
        h = cache.match(req.segs, limit)
        hold = cache.new_hold()
        cache.ref(hold, req.segs, h)
        if not self.allocate(hold, total_pages - h, self.sim.now):
            cache.release(hold)
            return False
        req.hold = hold
        req.hit_pages = h
        a, b = req.pulled
        req.remote_pages = max(0, min(b, h) - a) if req.pin is not None and req.pin.alive(self.sim.now) else 0
        if req.pin is not None:
            self.release(req.pin.lease_id, self.sim.now)
            req.pin = None
        return True


def _threshold_pages(reuse: ReuseConfig, page_size: int) -> int:
    t = reuse.recompute_threshold_tokens
    tokens = 64 if t == "auto" else int(t)  # "auto" before both rates are measured: 64
    return -(-tokens // page_size) if tokens > 0 else 1


@dataclass(slots=True, eq=False)
class _Prompt:
    """A prompt the prefill engine is computing: tokens left, position reached."""

    req: Req
    left: int
    pos: int


class PrefillWorker(Worker):
    """Engine steps over prompts; see the module docstring."""

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
    ) -> None:
        super().__init__(url, sim=sim, pages=pages, page_size=page_size, dtype=dtype, costs=costs, reuse=reuse, sched=sched)
        self.running: list[_Prompt] = []
        self._view_by_load: dict[int, WorkerView] = {}
        self.busy = False
        self.gpu: Any = None  # a ``SharedGpu`` when the decode worker runs on the same GPU
        self.on_done: Callable[[Req, float], None] = lambda req, now: None

    def board_entry(self, n: int) -> WorkerView:
        """The router's view of this worker at load ``n``."""
        view = self._view_by_load.get(n)
        if view is None:  # immutable, so one per load value serves every routing
            view = self._view_by_load[n] = WorkerView(self.url, True, n)
        return view

    def _admit_waiting(self, now: float) -> bool:
        if not self.busy:
            self._start_step(now)
        return False

    def _start_step(self, now: float) -> None:
        heap = self._expiry
        if heap and heap[0][0] <= now:
            self.expire(now)
        sched = self.sched
        budget = sched.max_num_batched_tokens
        chunk = sched.chunk_size
        steps: list[tuple[_Prompt, int]] = []
        tokens = 0
        work = 0.0
        for item in self.running:
            n = item.left
            if chunk < n:
                n = chunk
            if budget < n:
                n = budget
            if n <= 0:
                break
            steps.append((item, n))
            budget -= n
            tokens += n
            work += n * (item.pos + n / 2)
        p = self.page_size
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < sched.max_num_seqs:
            req = waiting[0]
            if not self.admit_pages(req, -(-req.prompt // p)):
                self.wake_when_leases_expire(now)
                break
            waiting.popleft()
            start = req.hit_pages * p
            item = _Prompt(req, req.prompt - start, start)
            running.append(item)
            n = min(chunk, req.prompt - start, budget)
            steps.append((item, n))
            budget -= n
            tokens += n
            work += n * (start + n / 2)
        if not steps:
            return
        self.busy = True
        dt = self.costs.prefill_step(self.dtype, tokens, work)
        if self.gpu is not None:  # a GPU shared with a decode worker times the step (kvserving.sim.shared_gpu)
            self.gpu.start_prefill(now, dt, steps)
            return
        self.sim.call_at(now + dt, self._step_done, steps)

    def _step_done(self, steps: list[tuple[_Prompt, int]], now: float) -> None:
        self.busy = False
        for item, n in steps:
            item.left -= n
            item.pos += n
            if item.left == 0:
                self.running.remove(item)
                self._finish(item.req, now)
        self._admit(now)

    def _finish(self, req: Req, now: float) -> None:
        p = self.page_size
        full = req.prompt // p
        hold = req.hold
        assert hold is not None
        self.cache.publish(hold, req.segs, req.hit_pages, min(full, req.stable_prompt))
        partial = -(-req.prompt // p) - full
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
    """Fluid decode batch; see the module docstring."""

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
    ) -> None:
        super().__init__(url, sim=sim, pages=pages, page_size=page_size, dtype=dtype, costs=costs, reuse=reuse, sched=sched)
        self.steps = 0.0  # S: decode steps run so far (every running sequence gained one token per step)
        self.t_steps = 0.0
        self.step_s = 0.0
        self.batch: list[tuple[float, int, Req]] = []  # (target S, turn id, req): a heap
        self.ctx_base = 0.0  # sum over the batch of (context at admission - S at admission)
        self._version = 0
        self.gpu: Any = None  # a ``SharedGpu`` when the prefill worker runs on the same GPU
        self.gpu_share = 1.0  # step time multiplier while the shared GPU also runs a prefill step
        self.on_done: Callable[[Req, float], None] = lambda req, now: None

    def _advance(self, now: float) -> None:
        if self.batch and self.step_s > 0:
            self.steps += (now - self.t_steps) / self.step_s
        self.t_steps = now

    def _reschedule(self, now: float) -> None:
        b = len(self.batch)
        self._version += 1
        if self.gpu is not None:
            self.gpu.decode_busy(now, b > 0)
        if not b:
            self.step_s = 0.0
            return
        self.step_s = self.costs.decode_step(self.dtype, b, self.ctx_base + b * self.steps) * self.gpu_share
        t = now + max(0.0, self.batch[0][0] - self.steps) * self.step_s
        self.sim.call_at(t, self._tick, self._version)

    def _admit_waiting(self, now: float) -> bool:
        """Admit what fits; True when that rescheduled the batch's next finish."""
        heap = self._expiry
        if heap and heap[0][0] <= now:
            self.expire(now)
        p = self.page_size
        token_s, attn_s = self.costs.prefill_token_s, self.attn_s
        admitted: list[tuple[Req, float]] = []
        while self.waiting and len(self.batch) + len(admitted) < self.sched.max_num_seqs:
            req = self.waiting[0]
            if not self.admit_pages(req, -(-(req.prompt + 1) // p)):  # the reply's pages come as it grows
                self.wake_when_leases_expire(now)
                break
            self.waiting.popleft()
            c = req.prompt + 1 - req.hit_pages * p  # prompt + the prefill's first token, less what it holds
            stall = token_s * c + attn_s * c * (req.prompt - c / 2)
            admitted.append((req, stall))
        if not admitted:
            return False
        self._advance(now)
        stall = 0.0
        for _, s in admitted:
            stall += s
        for req, _ in admitted:
            # the first token came from the prefill worker: output - 1 steps here
            heapq.heappush(self.batch, (self.steps + req.output - 1, req.turn_id, req))
            self.ctx_base += req.prompt + 1 - self.steps
        b = len(self.batch)
        step_s = self.costs.decode_step(self.dtype, b, self.ctx_base + b * self.steps)
        self.steps -= stall / step_s  # every sequence waits for the admitted prompts' compute
        self._reschedule(now)
        return True

    def _tick(self, version: int, now: float) -> None:
        if version != self._version:
            return
        self._advance(now)
        done: list[Req] = []
        while self.batch and self.batch[0][0] <= self.steps + 1e-6:
            target, _, req = heapq.heappop(self.batch)
            self.ctx_base -= req.prompt + 1 - (target - req.output + 1)
            done.append(req)
        for req in done:
            self._finish(req, now)
        if not self._admit(now):  # an admission already rescheduled (the same time, one event fewer)
            self._reschedule(now)

    def _finish(self, req: Req, now: float) -> None:
        p = self.page_size
        hold = req.hold
        assert hold is not None
        held = -(-(req.prompt + 1) // p)
        grow = -(-(req.prompt + req.output) // p) - held  # the reply's pages, taken as it grew
        if grow > 0 and self.allocate(hold, grow, now):
            held += grow
        # (a reply that found no pages would have been preempted and recomputed: keep what is held)
        full = min((req.prompt + req.output - 1) // p, held)  # the last sampled token has no KV
        keep = min(full, req.stable_stream)
        self.cache.publish(hold, req.segs, req.hit_pages, keep)
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

"""Continuous batching with chunked prefill: decide each step which tokens of
which sequences run, within the token budget and the free pages.

Order each step: running decodes first (one token each), then running
prefills continue, then waiting sequences are admitted FIFO. A sequence is
admitted with pages for every token it knows (its prompt, and on a return
after preemption what it generated), not just its first chunk: a long prompt
that does not fit waits in the queue instead of being preempted, and its
computed chunks lost, by the growth of the prompts admitted beside it. When a
decode cannot get a page, the most recently admitted running sequence is preempted:
its pages go back to the pool and it re-enters the queue front, to be
recomputed later (its sampled tokens are kept, so its output is unchanged);
a step that preempted admits no waiting sequence.

Pages pulled from another worker for a waiting request are pinned until it is
admitted (``kv/leases.py``, admission pins). An admission takes them only when
nothing else can make progress: while a sequence runs, the head of the queue
waits for it to end (it frees pages) and leaves the pins alone. When nothing
runs and the head does not fit without pins, the waiting requests that fit
without anyone's pins are admitted ahead of it, in queue order -- a request
whose pages were pulled needs few new ones, and their pages come back as
they end -- and only when none fits does the head take the pins
(taken, their requests compute those tokens again). Only requests already
queued when the head was first held up may overtake it, so it waits for a
bounded number of them. A queue with no other way forward takes the pins
rather than wait for a prefill worker's transfer leases to be pulled (its
pool is often held by them and by pins with nothing running): that wait
would be the turn's time to first token, and no deadlock is possible.

An admission places a request with its whole cached prefix; when that does
not fit, with only the leading matched pages that stay held whatever it does
(pulled pages under its own admission pin, unless its pins may yield) -- from
scratch when none do: dropping a held page makes no room, it only computes
its tokens again. Pages its tags now want at 2 bits are aged down once it is
placed, never by an attempt that fails (``_admit``, ``kv/manager.py``).
Counted: ``from_scratch_admissions``, ``dropped_cached_tokens``.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from kvserving.config import SchedulerConfig
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.kv.page_pool import RECLAIM_FIRST, RECLAIM_LAST
from kvserving.worker.sequence import ScheduledChunk, SchedulerOutput, Sequence, SeqStatus

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput"]

_arrival = attrgetter("arrival")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        if config.chunk_size % kv.page_size:
            # Chunks end on page boundaries, so a page (INT2 ones are written
            # whole) never straddles two steps.
            raise ValueError(f"scheduler.chunk_size ({config.chunk_size}) must be a multiple of the page size ({kv.page_size})")
        if config.max_num_batched_tokens < kv.page_size:
            raise ValueError("scheduler.max_num_batched_tokens must be >= the page size")
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0
        self._queued = 0  # requests ever added: each one's place in queue order (Sequence.queued)
        # (the queue's head, the last ``queued`` that may overtake it): set when an idle step first found
        # the head unable to fit without pins (``_overtake``)
        self._held_up: tuple[Sequence, int] | None = None
        # admissions placed with fewer cached pages than they matched (``_admit``), ever (counters): those
        # placed from scratch, and the cached tokens all of them gave up (computed again)
        self.from_scratch_admissions = 0
        self.dropped_cached_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._queued += 1
        seq.queued = self._queued
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.kv.publish_full_pages(seq)
        self.kv.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, self.config.chunk_size, budget)
        if n < seq.num_uncomputed:
            n -= n % self.kv.page_size  # a non-final chunk ends on a page boundary
        return n

    def _preempt_latest(self, out: SchedulerOutput) -> Sequence:
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = SeqStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        out.chunks = [c for c in out.chunks if c.seq is not victim]
        return victim

    def _admit(self, seq: Sequence, budget: int, *, reclaim: int) -> int:
        """Give a waiting ``seq`` pages for all its known tokens and schedule its first chunk; returns the chunk
        length (0: not now). ``reclaim``: the reclaimable pins that may yield (``RECLAIM_FIRST``: retained
        conversations only; ``RECLAIM_LAST``: the waiting requests' admission pins too).

        First with its whole cached prefix. If that placement does not fit,
        once more with only the leading matched pages that stay held whatever
        the placement does (``KVCacheManager.held_prefix``: its own admission
        pin's pulled pages, unless ``reclaim`` lets that pin yield; from
        scratch when there are none): matched pages can sit deep inside one
        end of a triaxial buffer and block the other end, while a placement
        that evicts them fits. Giving up pages that stay held makes no room
        and only computes their tokens again, so the retry keeps them.

        Matched pages its tags now want at 2 bits are aged down only once it is
        placed (``KVCacheManager.age_matched``), in the room the placement left:
        copies made first take room the placement may need, and a failed
        attempt would leave them unpinned beside pinned originals that no
        longer match (``kv/manager.py``).
        """
        page = self.kv.page_size
        wanted = self.kv.match_unaged(seq)
        matched = len(wanted)
        kept = matched
        n = self._chunk_len(seq, budget)
        placed = n > 0 and self.kv.allocate_until(seq, seq.num_tokens, reclaim_up_to=reclaim)
        if not placed and n > 0 and matched:
            kept = self.kv.held_prefix(seq, reclaim_up_to=reclaim)
            if kept < matched:
                self.kv.keep_matched(seq, kept)
                n = self._chunk_len(seq, budget)
                placed = n > 0 and self.kv.allocate_until(seq, seq.num_tokens, reclaim_up_to=reclaim)
        if not placed:
            self.kv.free(seq)  # back to no pages, nothing computed
            return 0
        self.kv.age_matched(seq, wanted)
        if kept < matched:
            self.dropped_cached_tokens += (matched - kept) * page
            self.from_scratch_admissions += int(kept == 0)
        if seq.num_preemptions == 0:  # first admission (output_ids may be given: the prefill's token)
            seq.num_cached_prompt = min(kept * page, len(seq.prompt_ids))
        return n

    def _start(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Move an admitted ``seq`` from the queue to the running sequences, its first chunk ``n`` tokens."""
        if seq is self.waiting[0]:
            self.waiting.popleft()
            self._held_up = None
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self._arrivals += 1
        seq.arrival = self._arrivals
        self.running.append(seq)
        out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))

    def _overtake(self, budget: int, out: SchedulerOutput) -> int:
        """A step that began with nothing running, and the queue's head does not fit without pins: admit, in
        queue order, the waiting requests that fit without anyone's pins (only those queued before the head
        was first held up: it is overtaken a bounded number of times); if none did and still nothing runs,
        the head, taking pins. Returns the budget left."""
        head = self.waiting[0]
        if self._held_up is None or self._held_up[0] is not head:
            self._held_up = (head, self._queued)
        last = self._held_up[1]
        for seq in [s for s in self.waiting if s is not head and s.queued <= last]:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return budget
            n = self._admit(seq, budget, reclaim=RECLAIM_FIRST)
            if n:
                self._start(seq, n, out)
                budget -= n
        if not self.running:
            n = self._admit(head, budget, reclaim=RECLAIM_LAST)
            if n:
                self._start(head, n, out)
                budget -= n
        return budget

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # 1. running sequences, oldest first; a page shortage preempts the newest
        # (inlined _chunk_len and a page check before allocate_until: per-sequence host cost of decode steps)
        page = self.kv.page_size
        chunk = self.config.chunk_size
        for seq in sorted(self.running, key=_arrival):
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            left = len(seq.prompt_ids) + len(seq.output_ids) - seq.num_computed
            n = min(left, chunk, budget)
            if n < left:
                n -= n % page  # a non-final chunk ends on a page boundary
            if n == 0:
                continue
            if seq.num_computed + n > len(seq.page_ids) * page:
                while not self.kv.allocate_until(seq, seq.num_computed + n):
                    victim = self._preempt_latest(out)
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n

        # 2. admit waiting sequences in order while pages and budget last; none in a step that preempted: the
        # victim waits at the queue's front for pages a running sequence just lacked, and admitted at once (or
        # another in its place) it would recompute a chunk that the next step's growth preempts again. The
        # waiting requests' admission pins yield only when nothing runs and no other request fits (``_overtake``).
        idle = not self.running
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget, reclaim=RECLAIM_FIRST)
            if n == 0:
                if idle:
                    budget = self._overtake(budget, out)
                break  # retry next step, when pages or budget free up
            self._start(seq, n, out)
            budget -= n
        return out

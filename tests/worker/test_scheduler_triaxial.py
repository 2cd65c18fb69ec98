"""Admitting requests whose prefix was pulled, in a triaxial pool (INT4 and INT2 pages in slabs), driven
step by step against the real scheduler, KV manager and pool: a request keeps the pulled pages its
admission pin holds whenever a placement with them fits, and a failed admission converts none of them
(age-down runs only once the admission is placed).

Pools of 30-byte slabs: INT4 pages of 10 bytes (3 a slab), INT2 pages of 6 (5 a slab); with N slabs,
slab k holds INT4 pages 3k..3k+2 or INT2 pages F | 5(N-1-k) .. F | 5(N-1-k)+4 (``test_triaxial_pool.py``).
Tags: OLD (an older tool result) wants 2 bits, NOW 4. Pulled pages arrive at 4 bits, as the decode worker
stored them a turn earlier; this turn's tags want the old ones at 2 (age-down at admission)."""

from __future__ import annotations

import itertools

import torch
from engine_steps import step

from kvserving.config import SchedulerConfig
from kvserving.kernels.page_ids import INT2_PAGE_FLAG as F
from kvserving.tags import NUM_TAGS, encode_tag
from kvserving.worker.kv.leases import pin_for_admission
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.scheduler import Scheduler
from kvserving.worker.sequence import Sequence, SeqStatus
from kvserving.worker.triaxial_pool import TriaxialPagePool

OLD = encode_tag("turn_m2", "text", "obs")
NOW = encode_tag("current", "text", "obs")
TABLE = tuple(2 if t == OLD else 4 for t in range(NUM_TAGS))
P = 32

Copies = list[tuple[list[int], list[int]]]


def _setup(num_slabs: int) -> tuple[TriaxialPagePool, KVCacheManager, Scheduler, Copies]:
    """A pool of ``num_slabs`` slabs on a clock that ticks at every read (LRU order is call order),
    age-down on (the copies it makes are recorded: ``(src, dst)`` per call)."""
    tick = itertools.count(1)
    pool = TriaxialPagePool(30 * num_slabs, int4_page_bytes=10, int2_page_bytes=6, page_size=P, clock=lambda: float(next(tick)))
    copies: Copies = []
    kv = KVCacheManager(pool, page_size=P, bits_table=TABLE, requantize=lambda src, dst: copies.append((list(src), list(dst))))
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, chunk_size=512), kv)
    return pool, kv, sched, copies


def _request(name: str, tags: list[int], *, first: int = 0, max_tokens: int = 1) -> Sequence:
    return Sequence(name, list(range(first, first + len(tags))), SamplingParams(max_tokens=max_tokens), torch.Generator(), tags=tags)


def _pulled(kv: KVCacheManager, seq: Sequence, pids: list[int], *, keep: int | None = None) -> None:
    """``pids`` (owned by the caller) hold ``seq``'s leading pages at their stored precision: registered,
    pinned for its admission and handed over as ``Puller._adopt`` does; the pin then keeps only its first
    ``keep`` (a pin trimmed under pressure: the rest stays in the prefix cache)."""
    pool = kv.pool
    for pid, h in zip(pids, kv.page_hashes(seq, [4 if pid < F else 2 for pid in pids])):
        pool.register(pid, h)
    seq.admission_pin = pin_for_admission(pool, pids, pulled=pids, ttl_s=60.0)
    pool.free(pids)
    if keep is not None:
        pool.trim_pin(seq.admission_pin, len(pids) - keep)


def test_a_pulled_prefix_is_aged_down_after_its_admission_is_placed_not_before() -> None:
    """4 slabs: w's 3 pulled INT4 pages (0-2, slab 0) pinned; another request's pages fill slab 1 (3-5);
    slab 3 is INT2, one page owned (F|0) and 4 cached (F|1-F|4); slab 2 free. w (96 OLD + 1 NOW token)
    needs one new INT4 page. Placed first, it takes slab 2 (page 6); then its 3 pulled pages are re-stored
    at 2 bits in the room left (the cached INT2 pages, least recently used first: F|4, F|3, F|2) and the
    INT4 originals go with the pin. Before, the copies were made first: they took slab 2 (F|5-F|7), the
    INT4 page found no slab, and the retry from scratch fit (INT2 pages over the cached ones of slab 3,
    slab 2 converted back to INT4, the copies evicted): w computed its 96 pulled tokens again."""
    pool, kv, sched, copies = _setup(4)
    w = _request("w", [OLD] * 96 + [NOW])
    pulled = pool.allocate([4, 4, 4])
    other = pool.allocate([4, 4, 4])
    int2 = pool.allocate([2] * 5)
    assert (pulled, other, int2) == ([0, 1, 2], [3, 4, 5], [F | 0, F | 1, F | 2, F | 3, F | 4])
    for i, pid in enumerate(int2[1:]):
        pool.register(pid, 10_000 + i)
    pool.free(int2[1:])
    _pulled(kv, w, pulled)
    sched.add(w)
    assert step(sched) == [("w", [F | 4, F | 3, F | 2, 6])]
    assert copies == [([0, 1, 2], [F | 4, F | 3, F | 2])] and kv.aged_pages == 3
    assert (w.num_cached_prompt, w.status) == (96, SeqStatus.FINISHED)
    assert w.num_pulled_prompt == 96  # the INT2 copies hold the pulled content: counted pulled, not local
    assert [pool.page(pid) for pid in pulled] == [None, None, None]  # retired: free once the pin went
    assert (sched.from_scratch_admissions, sched.dropped_cached_tokens, kv.age_down_skipped_pages) == (0, 0, 0)


def test_an_admission_that_fails_converts_no_pulled_page_and_the_request_later_finds_them_all() -> None:
    """3 slabs: w's 3 pulled INT4 pages (0-2) pinned; r runs in slab 1 (65 NOW tokens, 33 to generate);
    slab 2 free. w (96 OLD + 100 NOW tokens) needs 4 new INT4 pages, 2 slabs: it waits. Its failed
    attempts convert nothing: the pulled pages keep their INT4 hashes, no copy is made. r's 97th token
    takes slab 2 (page 6) at step 33 and r ends; at step 34 w is placed with all 96 pulled tokens (new
    pages 5-8), and no INT2 room is left to age them (3 skipped: kept at 4 bits, more precise). Before,
    the first failed attempt made INT2 copies in slab 2 and dropped the originals' hashes; r's growth
    converted slab 2 back to INT4, evicting the copies, so w matched nothing and, once nothing ran,
    took its own pin's pages and computed the 96 pulled tokens again."""
    pool, kv, sched, copies = _setup(3)
    w = _request("w", [OLD] * 96 + [NOW] * 100)
    pulled = pool.allocate([4, 4, 4])
    assert pulled == [0, 1, 2]
    _pulled(kv, w, pulled)
    r = _request("r", [NOW] * 65, first=5000, max_tokens=33)
    sched.add(r)
    sched.add(w)
    steps = [step(sched)]
    assert steps == [[("r", [3, 4, 5])]]
    assert [pool.lookup(h) for h in kv.page_hashes(w, [4, 4, 4])] == [0, 1, 2] and copies == []
    assert pool.held_pages(bits=2) == 0 and pool.slab_precision(2) == 0
    while sched.has_work():
        steps.append(step(sched))
        assert len(steps) < 50
    assert [i + 1 for i, s in enumerate(steps) if s] == [1, 34]
    assert steps[33] == [("w", [0, 1, 2, 5, 6, 7, 8])]
    assert (w.num_cached_prompt, w.num_pulled_prompt) == (96, 96)
    assert copies == [] and (kv.aged_pages, kv.age_down_skipped_pages) == (0, 3)
    assert (sched.from_scratch_admissions, sched.dropped_cached_tokens) == (0, 0)
    assert (pool.trimmed_pages, pool.reclaimed_pins) == (0, 0) and pool.pins() == []


def test_a_retry_drops_only_the_matched_pages_past_the_pinned_prefix() -> None:
    """4 slabs: w's pulled pages 0 (slab 0, slots 1-2 free) and 3 (alone in slab 1); the pin kept page 0
    only (trimmed: page 3 is cached, still matched). Slab 2 is another request's, slab 3 free. w (64 NOW
    + 320 OLD tokens) needs 10 INT2 pages, 2 slabs: with page 3 held, slab 1 cannot convert and only slab
    3 is free. Dropping page 3 (which stays evictable) is enough: w keeps pinned page 0, places its second
    page in slab 0 (page 1) and its INT2 pages in slabs 3 and 1 (page 3 evicted); it computes 352 tokens,
    32 cached tokens dropped. Before, the retry went from scratch: 0 cached, the pinned page 0 unused."""
    pool, kv, sched, copies = _setup(4)
    w = _request("w", [NOW] * 64 + [OLD] * 320)
    ids = pool.allocate([4] * 9)
    assert ids == list(range(9))  # 6-8: the other request's
    pool.free([1, 2, 4, 5])  # never registered: free slots of slabs 0 and 1
    _pulled(kv, w, [0, 3], keep=1)
    assert pool.pin_pages(w.admission_pin or "") == [0] and pool.cached_page_ids() == [3]
    sched.add(w)
    int2 = [F | i for i in (*range(0, 5), *range(10, 15))]
    assert step(sched) == [("w", [0, 1, *int2])]
    assert (w.num_cached_prompt, w.num_pulled_prompt) == (32, 32)
    assert (sched.from_scratch_admissions, sched.dropped_cached_tokens) == (0, 32)
    assert copies == [] and pool.page(3) is None


def test_an_idle_queue_whose_head_fits_only_without_its_own_pulled_pages_recomputes_them_and_counts_it() -> None:
    """3 slabs: w's 3 pulled INT4 pages (0-2) pinned, slabs 1 and 2 another request's. w (160 OLD
    tokens: 5 INT2 pages) finds no INT2 room beside its pulled pages, and nothing runs that would free
    any: as the pin policy says, the head of an idle queue takes pins rather than wait, its own
    included. Its pin yields page by page (2, 1, then 0: released), slab 0 becomes INT2 and w is placed
    from scratch (F|10-F|14): counted, with the 96 cached tokens it dropped."""
    pool, kv, sched, copies = _setup(3)
    w = _request("w", [OLD] * 160)
    pulled = pool.allocate([4, 4, 4])
    assert pulled == [0, 1, 2] and pool.allocate([4] * 6) == [3, 4, 5, 6, 7, 8]
    _pulled(kv, w, pulled)
    sched.add(w)
    assert step(sched) == [("w", [F | 10, F | 11, F | 12, F | 13, F | 14])]
    assert (w.num_cached_prompt, w.num_pulled_prompt) == (0, 0)
    assert (pool.trimmed_pages, pool.reclaimed_pins) == (3, 1)
    assert (sched.from_scratch_admissions, sched.dropped_cached_tokens) == (1, 96)
    assert copies == [] and kv.aged_pages == 0

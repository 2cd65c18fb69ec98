"""TriaxialPagePool: INT4 and INT2 pages in slabs of one buffer, no fixed split.

Buffer of 4 slabs of 30 bytes: INT4 pages of 10 bytes (3 per slab, 12 in all), INT2 pages of
6 (5 per slab, 20 in all)::

    slab        0              1              2              3
    INT4     0  1  2  |     3  4  5  |     6  7  8  |     9 10 11
    INT2   19 18 17 16 15 | 14 13 12 11 10 | 9 8 7 6 5 | 4 3 2 1 0    (F | index, top down)
"""

import copy
import random

import pytest

from kvserving.kernels import layout, page_ids
from kvserving.kernels.page_ids import INT2_PAGE_FLAG, page_id_bits
from kvserving.worker.kv.page_pool import RECLAIM_LAST
from kvserving.worker.triaxial_pool import TriaxialPagePool

F = INT2_PAGE_FLAG
B4, B2, TOTAL = 10, 6, 120


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_pool() -> tuple[TriaxialPagePool, FakeClock]:
    clock = FakeClock()
    pool = TriaxialPagePool(TOTAL, int4_page_bytes=B4, int2_page_bytes=B2, page_size=32, clock=clock)
    return pool, clock


def live_ranges(pool: TriaxialPagePool, ids: list[int]) -> list[tuple[int, int]]:
    """Byte ranges of ``ids``, checked against kernels.page_ids, for overlap and against the buffer."""
    ranges = []
    for pid in ids:
        start = pool.byte_offset(pid)
        assert start == page_ids.page_byte_offset(pid, page_bytes=B4, int2_page_bytes=B2, total_bytes=TOTAL)
        ranges.append((start, start + (B2 if pid & F else B4)))
    ordered = sorted(ranges)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:])), ordered
    assert all(0 <= s and e <= TOTAL for s, e in ranges)
    return ranges


def free_counts(pool: TriaxialPagePool) -> tuple[int, int]:
    return pool.num_free_pages(bits=4), pool.num_free_pages(bits=2)


def kinds(pool: TriaxialPagePool) -> list[int]:
    return [pool.slab_precision(k) for k in range(pool.slabs.num_slabs)]


def cache(pool: TriaxialPagePool, ids: list[int], first_hash: int) -> None:
    """Register ``ids`` and drop their refs: cached, LRU order tail first."""
    for i, pid in enumerate(ids):
        pool.register(pid, first_hash + i)
    pool.free(ids)


def test_flag_matches_kernels_layout_and_ids_carry_it() -> None:
    assert INT2_PAGE_FLAG == layout.INT2_PAGE_FLAG
    assert page_id_bits(3) == 4 and page_id_bits(3 | F) == 2


def test_int4_fills_slabs_from_the_bottom_and_int2_from_the_top() -> None:
    pool, _ = make_pool()
    assert free_counts(pool) == (12, 20)
    assert pool.allocate([4] * 4) == [0, 1, 2, 3]  # slab 0, then the lowest free slab
    assert pool.allocate([2] * 6) == [F | 0, F | 1, F | 2, F | 3, F | 4, F | 5]  # the top slab, then the next down
    assert kinds(pool) == [4, 4, 2, 2]
    assert [pool.byte_offset(p) for p in (0, 3, F | 0, F | 4, F | 5)] == [0, 30, 114, 90, 84]
    live_ranges(pool, [0, 1, 2, 3, F | 0, F | 1, F | 2, F | 3, F | 4, F | 5])
    assert free_counts(pool) == (2, 4)  # the free slots of slab 1 and of slab 2
    assert pool.num_free == 2
    assert pool.allocate([4] * 3) is None  # all-or-nothing
    assert pool.allocate([4] * 2) == [4, 5]
    assert pool.allocate([2] * 4) == [F | 6, F | 7, F | 8, F | 9]
    assert free_counts(pool) == (0, 0)
    assert pool.allocate([4]) is None and pool.allocate([2]) is None


def test_one_precision_fills_the_whole_buffer() -> None:
    pool, _ = make_pool()
    assert pool.allocate([4] * 12) == list(range(12))
    assert live_ranges(pool, list(range(12)))[-1] == (110, 120)
    assert free_counts(pool) == (0, 0)
    pool2, _ = make_pool()
    ids = pool2.allocate([2] * 20)
    assert ids == [F | i for i in range(20)]
    assert live_ranges(pool2, ids)[-1] == (0, 6)


def test_a_slab_without_live_pages_is_free_for_either_precision() -> None:
    pool, _ = make_pool()
    assert pool.allocate([4] * 4) == [0, 1, 2, 3]
    assert kinds(pool) == [4, 4, 0, 0]
    pool.free([3])
    assert kinds(pool) == [4, 0, 0, 0]
    assert free_counts(pool) == (9, 15)
    assert pool.allocate([2]) == [F | 0]  # the highest free slab: 3
    assert pool.allocate([4]) == [3]  # the lowest free slab: 1
    assert kinds(pool) == [4, 4, 0, 2]
    pool.free([0, 1, 2])
    assert pool.allocate([2] * 5) == [F | 1, F | 2, F | 3, F | 4, F | 5]  # slab 3's slots, then slab 2 from the top
    assert kinds(pool) == [0, 4, 2, 2]


def test_free_slots_in_slabs_holding_an_owned_page_come_first() -> None:
    pool, _ = make_pool()
    assert pool.allocate([4] * 6) == [0, 1, 2, 3, 4, 5]
    pool.register(0, 100)
    pool.register(1, 101)
    pool.free([0, 1, 2])  # slab 0: 0, 1 cached, 2 free, nothing owned
    pool.free([5])  # slab 1: 3, 4 owned, 5 free
    assert pool.allocate([4]) == [5]  # not 2: slab 0 stays whole, convertible
    assert pool.allocate([4]) == [2]  # then the free slot of the slab with no owned page
    assert pool.allocate([4]) == [6]  # then a free slab
    assert pool.lookup(100) == 0 and pool.lookup(101) == 1


def test_int2_prefers_the_highest_slab_holding_an_owned_page() -> None:
    pool, _ = make_pool()
    assert pool.allocate([2] * 10) == [F | i for i in range(10)]  # slabs 3 and 2
    cache(pool, [F | 0, F | 1], 200)  # slab 3: F|0, F|1 cached
    pool.free([F | 2, F | 3, F | 4])  # slab 3: nothing owned, 3 slots free
    pool.free([F | 9])  # slab 2: F|5..F|8 owned, F|9 free
    assert pool.allocate([2]) == [F | 9]
    assert pool.allocate([2]) == [F | 2]
    assert pool.lookup(200) == F | 0


def test_an_all_cached_slab_of_the_other_precision_older_than_own_lru_is_converted() -> None:
    pool, clock = make_pool()
    assert pool.allocate([4] * 3) == [0, 1, 2]  # slab 0
    cache(pool, [0, 1, 2], 40)  # cached at t = 0
    clock.t = 1.0
    int2 = pool.allocate([2] * 15)
    assert int2 == [F | i for i in range(15)]  # slabs 3, 2, 1
    cache(pool, int2, 20)  # cached at t = 1
    assert kinds(pool) == [4, 2, 2, 2]
    assert free_counts(pool) == (3 + 3 * 3, 15 + 5)
    clock.t = 2.0
    # no free slot or slab: slab 0's newest page (t = 0) is older than INT2's LRU page (t = 1)
    assert pool.allocate([2]) == [F | 15]  # slab 0, top slot
    assert kinds(pool) == [2, 2, 2, 2]
    assert [pool.lookup(40 + i) for i in range(3)] == [None] * 3 and pool.evicted_pages == 3
    assert all(pool.lookup(20 + i) == F | i for i in range(15))
    assert free_counts(pool) == (3 * 3, 15 + 4)
    assert pool.allocate([2] * 4) == [F | 16, F | 17, F | 18, F | 19]  # the converted slab's slots
    live_ranges(pool, [F | i for i in range(20)])


def test_a_slab_of_the_other_precision_newer_than_own_lru_stays() -> None:
    pool, clock = make_pool()
    assert pool.allocate([4] * 3) == [0, 1, 2]
    cache(pool, [0, 1, 2], 40)
    clock.t = 1.0
    int2 = pool.allocate([2] * 15)
    cache(pool, int2, 20)  # LRU order: F|14 first (tail first)
    clock.t = 2.0
    pool.incref([1])  # one page of slab 0 used at t = 2: the slab's newest page is newer than INT2's LRU
    pool.free([1])
    assert pool.allocate([2]) == [F | 14]  # own LRU page
    assert pool.lookup(34) is None and pool.lookup(40) == 0 and kinds(pool) == [4, 2, 2, 2]
    # a tie goes to the own LRU page too
    pool2, clock2 = make_pool()
    assert pool2.allocate([4] * 3) == [0, 1, 2]
    int2 = pool2.allocate([2] * 15)
    cache(pool2, [0, 1, 2] + int2, 0)  # all at t = 0
    assert pool2.allocate([2]) == [F | 14] and kinds(pool2) == [4, 2, 2, 2]


def test_pages_evicted_tail_first_go_to_the_next_sequence_in_ascending_ids() -> None:
    """The LRU gives a freed conversation's pages back last page first (F|14, F|13, ...); the sequence that
    evicts them gets them in ascending ids, i.e. in runs (one NIXL region a run and layer, not a page)."""
    pool, clock = make_pool()
    int4 = pool.allocate([4] * 12)
    assert int4 == list(range(12))
    cache(pool, int4, 100)  # LRU order: 11, 10, ..., 0
    clock.t = 1.0
    got = pool.allocate([4] * 5)  # chosen 11, 10, 9, 8, 7 (LRU order)
    assert got == [7, 8, 9, 10, 11] and pool.evicted_pages == 5
    assert all(pool.lookup(100 + i) == i for i in range(7))  # the older half of the LRU stays cached
    # both precisions in one call: each in ascending ids, in the order of page_bits
    pool2, _ = make_pool()
    assert pool2.allocate([4] * 3) == [0, 1, 2]  # slab 0, kept owned
    int2 = pool2.allocate([2] * 15)  # slabs 3, 2, 1
    cache(pool2, int2, 0)  # LRU: F|14 first
    # INT2: its LRU's F|14, F|13, F|12 (slab 1); INT4: slab 2 converted (the lowest of the stalest), slot 6
    assert pool2.allocate([2, 2, 4, 2]) == [F | 12, F | 13, 6, F | 14]
    assert kinds(pool2) == [4, 2, 4, 2] and pool2.evicted_pages == 3 + 5
    live_ranges(pool2, [0, 1, 2, 6, F | 12, F | 13, F | 14] + [F | i for i in range(5)])


def test_an_owned_page_pins_its_slab_to_its_precision() -> None:
    pool, clock = make_pool()
    assert pool.allocate([4] * 3) == [0, 1, 2]
    cache(pool, [1, 2], 41)  # slab 0: 0 owned, 1 and 2 cached at t = 0
    clock.t = 1.0
    int2 = pool.allocate([2] * 15)
    cache(pool, int2, 20)
    # slab 0 cannot turn INT2: only INT2's own 15 cached pages; INT4 may convert the three INT2 slabs
    assert free_counts(pool) == (2 + 3 * 3, 15)
    assert pool.allocate([2] * 16) is None
    assert pool.allocate([2]) == [F | 14]  # its own LRU page, though slab 0's cached pages are older
    assert pool.lookup(41) == 1 and pool.lookup(42) == 2
    pool.free([0])
    assert free_counts(pool) == (3 + 3 * 2, 14 + 5)  # slab 0 holds no owned page now
    clock.t = 2.0
    assert pool.allocate([2]) == [F | 15]  # and is converted: its newest page (t = 0) is the oldest
    assert kinds(pool) == [2, 2, 2, 2]


def test_mixed_allocation_succeeds_exactly_at_the_slab_count() -> None:
    pool, _ = make_pool()
    # empty: 3 INT4 pages (1 slab) and 15 INT2 pages (3 slabs) fill it; one page more of either fails
    assert pool.allocate([4] * 4 + [2] * 15) is None
    assert pool.allocate([4] * 3 + [2] * 16) is None
    assert free_counts(pool) == (12, 20) and pool.live_page_ids() == []
    got = pool.allocate([2, 4] * 3 + [2] * 12)
    assert got is not None
    assert got[:6] == [F | 0, 0, F | 1, 1, F | 2, 2]
    assert sorted(got) == [0, 1, 2] + [F | i for i in range(15)]
    assert kinds(pool) == [4, 2, 2, 2] and free_counts(pool) == (0, 0)


def test_int2_leaves_int4_the_slab_it_needs() -> None:
    pool, clock = make_pool()
    assert pool.allocate([4] * 6) == [0, 1, 2, 3, 4, 5]  # slabs 0 and 1, owned throughout
    assert pool.allocate([2] * 10) == [F | i for i in range(10)]  # slabs 3 and 2
    cache(pool, [F | 5, F | 6, F | 7, F | 8, F | 9], 50)  # slab 2: nothing owned, cached at t = 0
    clock.t = 1.0
    cache(pool, [F | 1, F | 2, F | 3, F | 4], 60)  # slab 3: F|0 owned, 4 cached at t = 1
    # alone, an INT2 page evicts INT2's LRU page, in slab 2 (t = 0)
    alone = copy.deepcopy(pool)
    assert alone.allocate([2]) == [F | 9]
    # with 3 INT4 pages, slab 2 is the one slab INT4 can get: INT2 evicts in slab 3 (its LRU page
    # there, F|4), INT4 converts slab 2
    before = (free_counts(pool), pool.cached_page_ids())
    assert pool.allocate([4, 4, 4, 4, 2]) is None  # one INT4 page more: nothing changes
    assert (free_counts(pool), pool.cached_page_ids()) == before
    assert pool.allocate([4, 4, 2, 4]) == [6, 7, F | 4, 8]
    assert kinds(pool) == [4, 4, 4, 2]
    assert pool.lookup(63) is None and pool.lookup(60) == F | 1 and all(pool.lookup(50 + i) is None for i in range(5))
    live_ranges(pool, [0, 1, 2, 3, 4, 5, 6, 7, 8, F | 0, F | 1, F | 2, F | 3, F | 4])


def test_prefix_cache_and_pins_work_on_int2_pages() -> None:
    pool, clock = make_pool()
    ids = pool.allocate([2] * 2)
    assert ids == [F | 0, F | 1]
    hashes = TriaxialPagePool.chain_hashes(list(range(64)), 32, [3] * 64)
    pool.register(F | 0, hashes[0])
    pool.register(F | 1, hashes[1])
    assert pool.pin("conv", ids, ttl_s=10) == 10.0
    pool.free(ids)
    assert [pool.ref_count(p) for p in ids] == [1, 1]
    # the pinned INT2 pages keep slab 3 INT2: INT4 has the three other slabs
    assert free_counts(pool) == (9, 18)
    assert pool.allocate([4] * 10) is None
    clock.t = 10.0
    assert pool.expire_pins() == ["conv"]
    assert pool.cached_page_ids() == [F | 1, F | 0]
    assert free_counts(pool) == (12, 20)
    assert pool.match_prefix(hashes) == [F | 0, F | 1]
    assert [pool.ref_count(p) for p in ids] == [1, 1]
    pool.free(ids)
    assert pool.allocate([4] * 12) == list(range(12))  # slab 3's cached pages converted
    assert pool.match_prefix(hashes) == []


def test_an_admission_pin_yields_its_tail_one_page_at_a_time_until_the_allocation_fits() -> None:
    # INT4 pages 0-5 (slabs 0 and 1) pinned for an admission, 6-11 a running sequence's: the buffer is full
    pool, _ = make_pool()
    ids = pool.allocate([4] * 12)
    assert ids == list(range(12))
    for pid in ids[:6]:
        pool.register(pid, 10 + pid)
    pool.pin("pull", ids[:6], ttl_s=60, reclaim=RECLAIM_LAST)
    pool.free(ids[:6])
    assert free_counts(pool) == (0, 0)
    # one INT4 page: the pin's last page is enough
    assert pool.allocate_reclaiming([4], up_to=RECLAIM_LAST) == [5]
    assert pool.pin_pages("pull") == [0, 1, 2, 3, 4] and pool.trimmed_pages == 1
    # the sequence lets page 5 go; one INT2 page: slab 1 converts only once none of its pages is owned,
    # so the pin gives up page 4, then page 3, one at a time (a page's room is not a page there)
    pool.free([5])
    assert pool.allocate_reclaiming([2], up_to=RECLAIM_LAST) == [F | 10]
    assert pool.pin_pages("pull") == [0, 1, 2] and (pool.trimmed_pages, pool.reclaimed_pins) == (3, 0)


def test_retire_frees_a_cached_page_at_once_and_an_owned_one_at_its_last_ref() -> None:
    pool, _ = make_pool()
    assert pool.allocate([4] * 3) == [0, 1, 2]
    cache(pool, [0, 1], 10)
    pool.retire(0)  # cached: its slot is free now
    assert pool.page(0) is None and pool.lookup(10) is None and pool.cached_page_ids() == [1]
    assert free_counts(pool) == (1 + 1 + 9, 15)
    pool.register(2, 12)
    pool.retire(2)  # owned: forgets its hash, freed when its last ref goes
    assert pool.lookup(12) is None and pool.ref_count(2) == 1
    pool.free([2])
    assert pool.page(2) is None and pool.cached_page_ids() == [1]
    pool.retire(1)
    assert kinds(pool) == [0, 0, 0, 0] and free_counts(pool) == (12, 20)


def test_capacity_tokens_by_int2_fraction() -> None:
    pool, _ = make_pool()
    assert pool.capacity_tokens(0.0) == 12 * 32
    assert pool.capacity_tokens(1.0) == 20 * 32
    # 0.5: 12 pages are 6 INT4 (2 slabs) + 6 INT2 (2 slabs); 13 to 16 pages need 3 INT4 slabs
    assert pool.capacity_tokens(0.5) == 12 * 32
    with pytest.raises(ValueError, match="frac_int2"):
        pool.capacity_tokens(1.5)


def test_bad_arguments() -> None:
    pool, _ = make_pool()
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        pool.allocate([8])
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        pool.allocate([4, 3])
    assert pool.allocate([]) == []
    with pytest.raises(ValueError, match="INT4 page index must be in 0..11"):
        pool.ref_count(12)
    with pytest.raises(ValueError, match="INT2 page index must be in 0..19"):
        pool.ref_count(F | 20)
    assert pool.ref_count(F | 19) == 0
    with pytest.raises(ValueError, match="holds no page"):
        TriaxialPagePool(5, int4_page_bytes=10, int2_page_bytes=6)
    with pytest.raises(ValueError, match="total_bytes_per_layer 100 is not a whole number of slabs of 30 bytes"):
        TriaxialPagePool(100, int4_page_bytes=10, int2_page_bytes=6)
    with pytest.raises(ValueError, match="more than 64 pages"):
        TriaxialPagePool(1009 * 1013, int4_page_bytes=1009, int2_page_bytes=1013)


def _random_ops(seed: int, steps: int) -> None:
    """Random allocations (mixed precisions), frees, matches and retires; after every op the
    byte ranges of the live pages are disjoint and inside the buffer, ref counts are exact, and
    ``num_free_pages(b)`` pages of ``b`` can be allocated (on a copy) but not one more."""
    rng = random.Random(seed)
    pool, clock = make_pool()
    owned: list[int] = []  # one entry per ref we hold
    next_hash = 1
    for _ in range(steps):
        clock.t += 1
        op = rng.random()
        if op < 0.45:
            want = [rng.choice((2, 4)) for _ in range(rng.randint(1, 5))]
            got = pool.allocate(want)
            if got is not None:
                assert [page_id_bits(p) for p in got] == want
                owned += got
                for p in got:
                    if rng.random() < 0.6:
                        pool.register(p, next_hash)
                        next_hash += 1
        elif op < 0.85 and owned:
            drop = rng.sample(owned, rng.randint(1, min(4, len(owned))))
            for p in drop:
                owned.remove(p)
            pool.free(drop)
        elif op < 0.95 and pool.cached_page_ids():
            p = rng.choice(pool.cached_page_ids())
            pool.incref([p])
            owned.append(p)
        elif pool.live_page_ids():
            pool.retire(rng.choice(pool.live_page_ids()))
        live_ranges(pool, pool.live_page_ids())
        assert sorted(set(owned) | set(pool.cached_page_ids())) == sorted(pool.live_page_ids())
        for p in set(owned):
            assert pool.ref_count(p) == owned.count(p)
        for bits in (2, 4):
            assert pool.held_pages(bits=bits, cached=False) == sum(1 for p in set(owned) if page_id_bits(p) == bits)
            n = pool.num_free_pages(bits=bits)
            assert copy.deepcopy(pool).allocate([bits] * n) is not None, (bits, n)
            assert copy.deepcopy(pool).allocate([bits] * (n + 1)) is None, (bits, n)


def test_random_ops_keep_pages_apart_and_free_counts_exact() -> None:
    _random_ops(seed=0, steps=1500)


def test_random_mixed_allocations_fit_exactly_at_the_slab_count() -> None:
    """Brute force: a mixed request fits iff some choice of whole slabs covers both precisions."""
    rng = random.Random(1)
    pool, clock = make_pool()
    owned: list[int] = []
    for step in range(1500):
        clock.t += 1
        if rng.random() < 0.5:
            want = [rng.choice((2, 4)) for _ in range(rng.randint(1, 8))]
            fits = any(_fits_after(pool, want.count(4), want.count(2), s4) for s4 in range(pool.slabs.num_slabs + 1))
            before = (pool.live_page_ids(), pool.cached_page_ids())
            got = pool.allocate(want)
            assert (got is not None) == fits, (step, want)
            if got is None:
                assert (pool.live_page_ids(), pool.cached_page_ids()) == before
            else:
                assert [page_id_bits(p) for p in got] == want
                owned += got
                for i, p in enumerate(got):
                    if rng.random() < 0.6:
                        pool.register(p, step * 10 + i)
        elif owned:
            drop = rng.sample(owned, rng.randint(1, min(3, len(owned))))
            for p in drop:
                owned.remove(p)
            pool.free(drop)
        live_ranges(pool, pool.live_page_ids())


def _fits_after(pool: TriaxialPagePool, n4: int, n2: int, slabs4: int) -> bool:
    """Whether INT4 can have its pages from at most ``slabs4`` slabs holding no owned page and
    INT2 its pages from the rest, counted slab by slab."""
    a4, a2 = pool.slabs.int4_per_slab, pool.slabs.int2_per_slab
    room = {4: 0, 2: 0}  # free and cached slots of each precision in slabs holding an owned page
    spare = 0  # slabs holding no owned page: a whole slab of either precision
    for k in range(pool.slabs.num_slabs):
        bits = pool.slab_precision(k)
        ids = pool.slabs.page_ids(k, bits=bits or 4)
        if bits and any(pool.ref_count(p) > 0 for p in ids):
            room[bits] += sum(1 for p in ids if pool.ref_count(p) == 0)
        else:
            spare += 1
    if slabs4 > spare:
        return False
    return room[4] + a4 * slabs4 >= n4 and room[2] + a2 * (spare - slabs4) >= n2

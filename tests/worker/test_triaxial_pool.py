"""TriaxialPagePool: INT4 pages grow from byte 0, INT2 pages from the top, no fixed split.

Buffer of 100 bytes, INT4 pages of 20 bytes (at most 5), INT2 pages of 10 (at most 10)."""

import pytest

from kvserving.kernels import layout, page_ids
from kvserving.kernels.page_ids import INT2_PAGE_FLAG, page_id_bits
from kvserving.worker.triaxial_pool import TriaxialPagePool

F = INT2_PAGE_FLAG
B4, B2, TOTAL = 20, 10, 100


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
    """Byte ranges of ``ids``, checked against kernels.page_ids and for overlap."""
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


def test_flag_matches_kernels_layout_and_ids_carry_it() -> None:
    assert INT2_PAGE_FLAG == layout.INT2_PAGE_FLAG
    assert page_id_bits(3) == 4 and page_id_bits(3 | F) == 2


def test_two_ends_grow_without_overlap() -> None:
    pool, _ = make_pool()
    assert free_counts(pool) == (5, 10)
    assert pool.allocate([4] * 2) == [0, 1]
    assert pool.allocate([2] * 3) == [F | 0, F | 1, F | 2]
    assert [pool.byte_offset(p) for p in (0, 1, F | 0, F | 1, F | 2)] == [0, 20, 90, 80, 70]
    assert live_ranges(pool, [0, 1, F | 0, F | 1, F | 2]) == [(0, 20), (20, 40), (90, 100), (80, 90), (70, 80)]
    assert (pool.high_water(bits=4), pool.high_water(bits=2)) == (2, 3)
    assert free_counts(pool) == (1, 3)
    assert pool.num_free == 1
    assert pool.allocate([4] * 2) is None  # all-or-nothing
    assert pool.allocate([4] * 1) == [2]
    assert free_counts(pool) == (0, 1)
    assert pool.allocate([2] * 1) == [F | 3]
    assert pool.allocate([2] * 1) is None
    live_ranges(pool, [0, 1, 2, F | 0, F | 1, F | 2, F | 3])


def test_int4_only_workload_fills_the_whole_buffer() -> None:
    pool, _ = make_pool()
    assert pool.allocate([4] * 5) == [0, 1, 2, 3, 4]
    assert live_ranges(pool, [0, 1, 2, 3, 4])[-1] == (80, 100)
    assert free_counts(pool) == (0, 0)
    assert pool.allocate([4] * 1) is None and pool.allocate([2] * 1) is None


def test_int2_only_workload_fills_the_whole_buffer() -> None:
    pool, _ = make_pool()
    ids = pool.allocate([2] * 10)
    assert ids == [F | i for i in range(10)]
    assert live_ranges(pool, ids)[-1] == (0, 10)
    assert free_counts(pool) == (0, 0)


def test_freeing_top_pages_lets_the_other_precision_grow() -> None:
    pool, _ = make_pool()
    assert pool.allocate([4] * 5) == [0, 1, 2, 3, 4]
    pool.free([3, 4])
    assert pool.high_water(bits=4) == 3
    assert free_counts(pool) == (2, 4)
    pool.free([1])  # inside the INT4 end: only INT4 can reuse it
    assert pool.high_water(bits=4) == 3
    assert free_counts(pool) == (3, 4)
    assert pool.allocate([2] * 4) == [F | 0, F | 1, F | 2, F | 3]
    assert free_counts(pool) == (1, 0)
    assert pool.allocate([4] * 1) == [1]
    live_ranges(pool, [0, 1, 2, F | 0, F | 1, F | 2, F | 3])
    # and back: INT2 frees its inner pages, INT4 grows into them
    pool.free([F | 3, F | 2])
    assert pool.high_water(bits=2) == 2
    assert pool.allocate([4] * 1) == [3]
    assert pool.high_water(bits=4) == 4
    live_ranges(pool, [0, 1, 2, 3, F | 0, F | 1])


def test_an_owned_inner_page_holds_its_end_open() -> None:
    # the documented limit: free slots below an owned page serve only their own precision
    pool, _ = make_pool()
    assert pool.allocate([4] * 5) == [0, 1, 2, 3, 4]
    pool.free([0, 1, 2, 3])
    assert pool.high_water(bits=4) == 5
    assert free_counts(pool) == (4, 0)
    pool.free([4])
    assert pool.high_water(bits=4) == 0
    assert free_counts(pool) == (5, 10)


def test_cached_pages_of_the_other_end_are_evicted_only_after_own() -> None:
    pool, _ = make_pool()
    assert pool.allocate([2] * 4) == [F | 0, F | 1, F | 2, F | 3]
    pool.register(F | 2, 22)
    pool.register(F | 3, 23)
    pool.free([F | 0, F | 1, F | 2, F | 3])
    assert pool.high_water(bits=2) == 4  # cached F|3 holds the mark
    assert pool.cached_page_ids() == [F | 3, F | 2]
    assert free_counts(pool) == (5, 10)
    assert pool.allocate([4] * 3) == [0, 1, 2]  # the gap is enough: nothing evicted
    pool.register(2, 42)
    pool.free([2])
    assert pool.cached_page_ids() == [2, F | 3, F | 2]
    assert free_counts(pool) == (3, 6)
    # needs 2 more INT4 slots: own cached page 2 first, then pull the INT2 mark back
    # from 4 to 2 (evicting F|2 and F|3); its free slots 0, 1 go with it
    assert pool.allocate([4] * 3) == [2, 3, 4]
    assert pool.lookup(42) is None and pool.lookup(22) is None and pool.lookup(23) is None
    assert pool.high_water(bits=2) == 0
    assert free_counts(pool) == (0, 0)
    live_ranges(pool, [0, 1, 2, 3, 4])


def test_eviction_takes_the_older_of_own_lru_and_the_other_ends_innermost_pages() -> None:
    """A mix that shifts to INT2 (a bit-budget cut that moved) must not evict the newest INT2
    pages while stale INT4 pages fill the other end."""
    pool, clock = make_pool()
    assert pool.allocate([4] * 4) == [0, 1, 2, 3]  # stale INT4 pages, cached at t = 0
    for pid in (0, 1, 2, 3):
        pool.register(pid, 40 + pid)
    pool.free([0, 1, 2, 3])
    clock.t = 1.0
    assert pool.allocate([2, 2]) == [F | 0, F | 1]  # the gap: 20 bytes
    pool.register(F | 0, 20)
    pool.register(F | 1, 21)
    pool.free([F | 0, F | 1])
    clock.t = 2.0
    # no free slot, no gap: page 3 (innermost INT4, last used at 0) is older than INT2's LRU page (1)
    assert pool.allocate([2, 2]) == [F | 2, F | 3]
    assert pool.high_water(bits=4) == 3 and pool.lookup(43) is None
    assert pool.lookup(20) == F | 0 and pool.lookup(21) == F | 1
    clock.t = 3.0
    pool.incref([2])  # the innermost INT4 page used again at 3: newer than INT2's LRU page
    pool.free([2])
    assert pool.allocate([2]) == [F | 1]  # own LRU page (F|1, freed tail first, used at 1) goes
    assert pool.lookup(21) is None and pool.lookup(20) == F | 0 and pool.lookup(42) == 2
    live_ranges(pool, [0, 1, 2, F | 0, F | 1, F | 2, F | 3])


def test_int2_evicts_the_int4_ends_cached_pages() -> None:
    pool, _ = make_pool()
    assert pool.allocate([4] * 5) == [0, 1, 2, 3, 4]
    pool.register(4, 44)
    pool.free([3, 4])
    assert pool.high_water(bits=4) == 5
    assert free_counts(pool) == (2, 4)
    assert pool.allocate([2] * 3) == [F | 0, F | 1, F | 2]
    assert pool.high_water(bits=4) == 3  # 4 evicted, 3 given back
    assert pool.lookup(44) is None
    assert free_counts(pool) == (0, 1)
    live_ranges(pool, [0, 1, 2, F | 0, F | 1, F | 2])


def test_prefix_cache_and_leases_work_on_int2_pages() -> None:
    pool, clock = make_pool()
    ids = pool.allocate([2] * 2)
    assert ids == [F | 0, F | 1]
    hashes = TriaxialPagePool.chain_hashes(list(range(64)), 32, [3] * 64)
    pool.register(F | 0, hashes[0])
    pool.register(F | 1, hashes[1])
    assert pool.pin("conv", ids, ttl_s=10) == 10.0
    pool.free(ids)
    assert [pool.ref_count(p) for p in ids] == [1, 1]
    # the pinned INT2 pages block INT4 from taking their bytes
    assert free_counts(pool) == (4, 8)
    assert pool.allocate([4] * 5) is None
    clock.t = 10.0
    assert pool.expire_pins() == ["conv"]
    assert pool.cached_page_ids() == [F | 1, F | 0]
    assert pool.match_prefix(hashes) == [F | 0, F | 1]
    assert [pool.ref_count(p) for p in ids] == [1, 1]
    pool.free(ids)
    assert pool.allocate([4] * 5) == [0, 1, 2, 3, 4]
    assert pool.match_prefix(hashes) == []


def test_capacity_tokens_by_int2_fraction() -> None:
    pool, _ = make_pool()
    assert pool.capacity_tokens(0.0) == 5 * 32
    assert pool.capacity_tokens(1.0) == 10 * 32
    assert pool.capacity_tokens(0.5) == 7 * 32  # 4 INT2 (40 B) + 3 INT4 (60 B)
    with pytest.raises(ValueError, match="frac_int2"):
        pool.capacity_tokens(1.5)


def test_bad_arguments() -> None:
    pool, _ = make_pool()
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        pool.allocate([8])
    with pytest.raises(ValueError, match="INT4 page index must be in 0..4"):
        pool.ref_count(5)
    with pytest.raises(ValueError, match="INT2 page index must be in 0..9"):
        pool.ref_count(F | 10)
    assert pool.ref_count(F | 9) == 0
    with pytest.raises(ValueError, match="holds no page"):
        TriaxialPagePool(10, int4_page_bytes=20, int2_page_bytes=10)


def test_random_workload_keeps_ends_apart_and_free_counts_exact() -> None:
    import random

    rng = random.Random(0)
    pool, clock = make_pool()
    owned: list[int] = []  # one entry per ref we hold
    next_hash = 1
    for _ in range(3000):
        clock.t += 1
        op = rng.random()
        if op < 0.5:
            bits = rng.choice((2, 4))
            n = rng.randint(1, 4)
            can = pool.num_free_pages(bits=bits)
            got = pool.allocate([bits] * n)
            assert (got is not None) == (n <= can)
            if got is not None:
                assert all(page_id_bits(p) == bits for p in got)
                owned += got
                for p in got:
                    if rng.random() < 0.5:
                        pool.register(p, next_hash)
                        next_hash += 1
        elif owned:
            drop = rng.sample(owned, rng.randint(1, min(3, len(owned))))
            for p in drop:
                owned.remove(p)
            pool.free(drop)
        live = sorted(set(owned) | set(pool.cached_page_ids()))
        live_ranges(pool, live)
        for p in set(owned):
            assert pool.ref_count(p) == owned.count(p)
        assert pool.high_water(bits=4) * B4 + pool.high_water(bits=2) * B2 <= TOTAL


def test_one_allocate_places_both_kinds_where_two_calls_would_fail() -> None:
    pool, _ = make_pool()
    assert pool.allocate([2] * 2) == [F | 0, F | 1]
    pool.register(F | 0, 1)
    pool.register(F | 1, 2)
    pool.free([F | 0, F | 1])  # cached at the top; LRU order F|1, F|0
    assert pool.allocate([4] * 3) == [0, 1, 2]
    # gap: 20 bytes. Allocating the INT2 page alone would grow into it (F|2) and leave
    # INT4 short; one joint call evicts INT2's own cached F|1 instead and leaves the gap to INT4.
    assert pool.allocate([4, 2]) == [3, F | 1]
    assert pool.lookup(2) is None and pool.lookup(1) == F | 0
    assert (pool.high_water(bits=4), pool.high_water(bits=2)) == (4, 2)
    live_ranges(pool, [0, 1, 2, 3, F | 0, F | 1])
    # infeasible jointly: nothing changes
    assert pool.allocate([2, 2, 4]) is None
    assert pool.cached_page_ids() == [F | 0] and pool.lookup(1) == F | 0
    assert pool.allocate([2, 4]) is None
    assert pool.allocate([2]) == [F | 0]  # one kind
    assert pool.allocate([]) == []
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        pool.allocate([4, 3])


def test_random_mixed_allocations_succeed_exactly_when_both_ends_fit() -> None:
    import random

    rng = random.Random(1)
    pool, clock = make_pool()
    owned: list[int] = []
    for step in range(3000):
        clock.t += 1
        if rng.random() < 0.5:
            want = [rng.choice((2, 4)) for _ in range(rng.randint(1, 4))]
            n2, n4 = want.count(2), want.count(4)
            # brute force: some split of the buffer fits both kinds' extents
            e = {}
            for bits, n in ((2, n2), (4, n4)):
                region = pool._r[bits]
                e[bits] = max(pool._min_mark(region), pool._num_owned_in(region) + n)
            fits = e[2] * B2 + e[4] * B4 <= TOTAL
            got = pool.allocate(want)
            assert (got is not None) == fits, (step, want)
            if got is not None:
                assert [page_id_bits(p) for p in got] == want
                owned += got
                for p in got:
                    if rng.random() < 0.6:
                        pool.register(p, step * 10 + got.index(p))
        elif owned:
            drop = rng.sample(owned, rng.randint(1, min(3, len(owned))))
            for p in drop:
                owned.remove(p)
            pool.free(drop)
        live_ranges(pool, sorted(set(owned) | set(pool.cached_page_ids())))

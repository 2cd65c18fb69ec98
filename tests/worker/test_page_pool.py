"""PagePool: exact page ids, ref counts, free-list and LRU order after each step."""

import subprocess
import sys

import pytest

from kvserving.worker.kv.page_pool import HASH_BITS, RECLAIM_FIRST, RECLAIM_LAST, RECLAIM_NEVER, PagePool, chain_hashes


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_pool(num_pages: int = 4, page_size: int = 2) -> tuple[PagePool, FakeClock]:
    clock = FakeClock()
    return PagePool(num_pages, page_size=page_size, clock=clock), clock


def refs(pool: PagePool) -> list[int]:
    return [pool.ref_count(i) for i in range(pool.num_pages)]


# -- allocation and the free list -------------------------------------------------------


def test_placement_extends_in_place_and_keeps_concurrent_sequences_apart() -> None:
    pool, _ = make_pool(16)
    assert pool.capacity_tokens() == 32
    # a: a new sequence expecting 4 pages: best fit for 4 is the whole pool, from its start
    assert pool.allocate_next([4] * 2, after=None, expect=4) == [0, 1]
    assert pool.growing_tails() == [1] and pool.free_runs() == [(2, 14)]
    # b: the only run starts right after a's growing tail: b starts in its middle
    assert pool.allocate_next([4] * 2, after=None, expect=2) == [9, 10]
    assert pool.growing_tails() == [1, 10] and pool.free_runs() == [(2, 7), (11, 5)]
    # each grows in place
    assert pool.allocate_next([4] * 2, after=1, expect=2) == [2, 3]
    assert pool.allocate_next([4] * 1, after=10) == [11]
    assert pool.growing_tails() == [3, 11] and pool.free_runs() == [(4, 5), (12, 4)]
    # c: both runs are someone's to grow into: the longest, leaving it 2 pages of its 5
    assert pool.allocate([4] * 3) == [6, 7, 8]
    assert pool.growing_tails() == [3, 8, 11] and pool.free_runs() == [(4, 2), (12, 4)]
    assert refs(pool) == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    # a ends: its tail stops growing, its pages merge with the run after them
    pool.free([0, 1, 2, 3])
    assert pool.growing_tails() == [8, 11] and pool.free_runs() == [(0, 6), (12, 4)]
    # best fit for 4 is (12, 4), but b's tail 11 grows into it: the next fit, from its start
    assert pool.allocate([4] * 4) == [0, 1, 2, 3]
    assert pool.num_free == 6
    with pytest.raises(ValueError, match="page id must be in 0..15"):
        pool.allocate_next([4], after=16)


def test_best_fit_takes_the_smallest_run_that_holds_the_sequence() -> None:
    pool, _ = make_pool(12)
    assert pool.allocate([4] * 12) == list(range(12))
    pool.free([1, 2, 3, 5, 6, 8, 9, 10, 11])  # tail 11 freed: nobody grows into a run now
    assert pool.growing_tails() == []
    assert pool.free_runs() == [(1, 3), (5, 2), (8, 4)]
    assert pool.allocate([4] * 2) == [5, 6]  # fits (5, 2) exactly
    assert pool.allocate_next([4] * 1, after=None, expect=3) == [1]  # room for 3: (1, 3)
    assert pool.allocate([4] * 3) == [8, 9, 10]  # (2, 2) is 2's to grow into; (8, 4) holds 3
    # longer than any run: the longest first, then the next longest (lowest id on ties)
    pool.free([5, 6, 8, 9, 10])
    assert pool.free_runs() == [(2, 2), (5, 2), (8, 4)]
    assert pool.growing_tails() == [1]
    # (2, 2) and (5, 2) tie: the lower one; it is 1's to grow into, but all of it is needed
    assert pool.allocate([4] * 7) == [8, 9, 10, 11, 2, 3, 5]
    assert pool.free_runs() == [(6, 1)]


def test_the_free_pages_of_a_sequence_merge_back_into_one_run() -> None:
    pool, _ = make_pool(8)
    a = pool.allocate([4] * 3)
    b = pool.allocate([4] * 3)
    assert (a, b) == ([0, 1, 2], [5, 6, 7])  # b leaves a's tail 2 pages to grow into
    pool.free(list(reversed(b)))  # any order
    assert pool.free_runs() == [(3, 5)]
    pool.free(a)
    assert pool.free_runs() == [(0, 8)]


def test_allocate_is_all_or_nothing() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 3) == [0, 1, 2]
    assert pool.allocate([4] * 2) is None
    assert refs(pool) == [1, 1, 1, 0]
    assert pool.num_free == 1
    assert pool.allocate([]) == []
    assert pool.allocate([4] * 1) == [3]
    assert pool.allocate([4] * 1) is None


def test_live_page_ids_are_the_owned_and_cached_pages() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 3) == [0, 1, 2]
    pool.register(1, 7)
    pool.free([1, 2])  # 1 stays cached under its hash, 2 goes back free
    assert sorted(pool.live_page_ids()) == [0, 1]
    assert pool.cached_page_ids() == [1]


def test_free_of_the_top_page_then_reuse() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 4) == [0, 1, 2, 3]
    pool.free([3])
    pool.free([0])
    assert pool.allocate([4] * 2) == [0, 3]


def test_refs_incref_and_double_free() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 2) == [0, 1]
    pool.incref([1, 1])
    assert refs(pool) == [1, 3, 0, 0]
    pool.free([1])
    assert refs(pool) == [1, 2, 0, 0]
    pool.free([0, 1, 1])
    assert refs(pool) == [0, 0, 0, 0]
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="is free"):
        pool.free([0])
    assert pool.allocate([4] * 1) == [0]
    # a double free inside one call changes nothing
    with pytest.raises(ValueError, match="double free of page 0"):
        pool.free([0, 0])
    assert refs(pool) == [1, 0, 0, 0]
    with pytest.raises(ValueError, match="is free"):
        pool.incref([0, 2])
    assert refs(pool) == [1, 0, 0, 0]
    with pytest.raises(ValueError, match="0..3"):
        pool.ref_count(4)
    with pytest.raises(ValueError, match=r"page bits must be 4 in a pool without INT2 pages, got \[2\]"):
        pool.allocate([4, 2])
    assert refs(pool) == [1, 0, 0, 0]


# -- chained hashes ---------------------------------------------------------------------


def test_chain_hashes_full_pages_only_and_deterministic() -> None:
    tokens = list(range(10, 17))  # 7 tokens, page 2: three full pages, one partial
    h = chain_hashes(tokens, 2)
    assert len(h) == 3
    assert h == PagePool.chain_hashes(tokens, 2)
    assert all(0 <= x < 2**HASH_BITS for x in h)
    assert chain_hashes(tokens[:6], 2) == h  # the partial page adds nothing
    assert chain_hashes(tokens[:1], 2) == []
    # chaining: the continuation from a parent equals the tail of the full chain
    assert chain_hashes(tokens[2:], 2, parent=h[0]) == h[1:]
    assert chain_hashes(tokens[2:], 2) != h[1:]


def test_a_salt_changes_the_first_hash_and_so_the_whole_chain() -> None:
    tokens = list(range(10, 16))  # three full pages of 2
    plain = chain_hashes(tokens, 2)
    a = chain_hashes(tokens, 2, salt=b"tenant-a")
    assert a == chain_hashes(tokens, 2, salt=b"tenant-a")  # equal salts: equal chains
    b = chain_hashes(tokens, 2, salt=b"tenant-b")
    assert all(x != y for x, y in zip(a, plain)) and all(x != y for x, y in zip(a, b))
    assert chain_hashes(tokens, 2, salt=b"") == chain_hashes(tokens, 2, salt=None) == plain  # no salt: as before
    # the salt lives in the first page: a continuation from a salted parent stays salted, whatever salt it names
    assert chain_hashes(tokens[2:], 2, parent=a[0]) == chain_hashes(tokens[2:], 2, parent=a[0], salt=b"x") == a[1:]
    # a salt is not a token page: the salted first hash is no page-1 hash of any parent
    assert a[0] not in chain_hashes(tokens[:2], 2, parent=0) + chain_hashes(tokens[:2], 2)


def test_chain_hashes_same_in_another_process() -> None:
    code = "from kvserving.worker.kv.page_pool import chain_hashes; print(chain_hashes(list(range(10, 17)), 2, [1] * 7))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == str(chain_hashes(list(range(10, 17)), 2, [1] * 7))


def test_one_token_change_in_page_k_changes_hashes_from_k_on() -> None:
    tokens = list(range(8))
    base = chain_hashes(tokens, 2)
    changed = tokens.copy()
    changed[5] = 99  # page 2
    h = chain_hashes(changed, 2)
    assert h[:2] == base[:2]
    assert h[2] != base[2] and h[3] != base[3]


def test_tags_change_the_hash() -> None:
    tokens = list(range(4))
    plain = chain_hashes(tokens, 2)
    tagged = chain_hashes(tokens, 2, [0, 0, 0, 0])
    assert plain[0] != tagged[0]
    retagged = chain_hashes(tokens, 2, [0, 0, 0, 5])
    assert retagged[0] == tagged[0] and retagged[1] != tagged[1]
    with pytest.raises(ValueError, match="one entry per token"):
        chain_hashes(tokens, 2, [0])
    with pytest.raises(ValueError, match="bad token ids"):
        chain_hashes([-(2**70), 1], 2)


# -- prefix cache and LRU ----------------------------------------------------------------


def test_freed_hashed_page_stays_cached_and_match_prefix_refinds_it() -> None:
    pool, _ = make_pool(4)
    h = chain_hashes([1, 2, 3, 4, 5], 2)  # two full pages
    ids = pool.allocate([4] * 3)
    assert ids == [0, 1, 2]
    pool.register(0, h[0])
    pool.register(1, h[1])
    pool.free(ids)
    assert refs(pool) == [0, 0, 0, 0]
    assert pool.num_cached == 2 and pool.num_free == 4
    assert pool.cached_page_ids() == [1, 0]  # tail first in line for eviction
    assert pool.lookup(h[0]) == 0
    # the next turn shares the first page only
    assert pool.match_prefix([h[0], 12345, h[1]]) == [0]
    assert refs(pool) == [1, 0, 0, 0]
    assert pool.cached_page_ids() == [1]
    assert pool.match_prefix(h) == [0, 1]
    assert refs(pool) == [2, 1, 0, 0]
    assert pool.num_cached == 0 and pool.num_free == 2
    # a free page (2, unhashed) is not cached
    assert pool.page(2) is None


def test_register_keeps_the_first_page_for_a_hash() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 2) == [0, 1]
    pool.register(0, 7)
    pool.register(0, 7)  # idempotent
    pool.register(1, 7)  # same content computed twice: page 0 stays the cached copy
    assert pool.page(1).hash is None
    with pytest.raises(ValueError, match="already registered"):
        pool.register(0, 8)
    pool.free([0, 1])
    assert pool.cached_page_ids() == [0]
    assert pool.allocate([4] * 2) == [1, 2]  # page 1 went back to the free list
    with pytest.raises(ValueError, match="not owned"):
        pool.register(0, 9)


def test_lru_eviction_order_under_pressure() -> None:
    pool, clock = make_pool(4)
    a = pool.allocate([4] * 2)  # conversation A: pages 0, 1
    b = pool.allocate([4] * 2)  # conversation B: pages 2, 3
    assert (a, b) == ([0, 1], [2, 3])
    for pid, h in zip(a + b, (10, 11, 20, 21)):
        pool.register(pid, h)
    pool.free(a)
    clock.t += 1
    pool.free(b)
    assert pool.cached_page_ids() == [1, 0, 3, 2]
    assert pool.num_free == 4
    # A's head is touched again: it moves to the back of the line when freed
    clock.t += 1
    assert pool.match_prefix([10]) == [0]
    pool.free([0])
    assert pool.cached_page_ids() == [1, 3, 2, 0]
    assert pool.page(0).last_used == 102.0
    # pressure: evict LRU first, hashes leave the map
    assert pool.evicted_pages == 0
    assert pool.allocate([4] * 2) == [1, 3]
    assert pool.lookup(11) is None and pool.lookup(21) is None
    assert pool.evicted_pages == 2
    assert pool.cached_page_ids() == [2, 0]
    assert refs(pool) == [0, 1, 0, 1]
    assert pool.allocate([4] * 3) is None  # all-or-nothing: nothing evicted
    assert pool.cached_page_ids() == [2, 0]
    assert pool.allocate([4] * 1) == [2]
    assert pool.evicted_pages == 3  # the refused allocation evicted nothing
    assert pool.match_prefix([10, 11]) == [0]
    assert pool.num_free == 0 and pool.allocate([4] * 1) is None


def test_allocate_prefers_free_pages_over_evicting_cached_ones() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 1) == [0]
    pool.register(0, 5)
    pool.free([0])
    assert pool.allocate([4] * 3) == [1, 2, 3]
    assert pool.lookup(5) == 0
    assert pool.allocate([4] * 1) == [0]
    assert pool.lookup(5) is None


# -- pins ----------------------------------------------------------------------------------


def test_evicting_ahead_frees_a_run_for_the_pages_a_sequence_expects() -> None:
    pool, clock = make_pool(8)
    assert pool.allocate([4] * 8) == list(range(8))
    for pid in range(8):
        pool.register(pid, 10 + pid)
    pool.free([0, 1, 2, 3])  # conversation X
    clock.t += 1
    pool.free([4, 5, 6, 7])  # conversation Y
    assert pool.cached_page_ids() == [3, 2, 1, 0, 7, 6, 5, 4]
    # 2 pages now, 4 expected: no free run holds 2, so it evicts LRU until one holds 4
    assert pool.allocate_next([4] * 2, after=None, expect=4) == [0, 1]
    assert pool.evicted_pages == 4 and pool.cached_page_ids() == [7, 6, 5, 4]
    assert pool.free_runs() == [(2, 2)] and pool.num_free == 6
    # the next chunk extends in place, evicting nothing
    assert pool.allocate_next([4] * 2, after=1, expect=2) == [2, 3]
    assert pool.evicted_pages == 4
    # one page: evicting the least recently used one is enough
    assert pool.allocate([4] * 1) == [7]
    assert pool.evicted_pages == 5 and pool.cached_page_ids() == [6, 5, 4]
    assert pool.lookup(17) is None and pool.lookup(16) == 6


def test_pinned_pages_are_never_evicted_until_expiry() -> None:
    pool, clock = make_pool(4)
    ids = pool.allocate([4] * 2)
    assert ids == [0, 1]
    pool.register(0, 10)
    pool.register(1, 11)
    assert pool.pin("conv-1", ids, ttl_s=30) == 130.0
    pool.free(ids)  # the sequence ends; the pin keeps the pages
    assert refs(pool) == [1, 1, 0, 0]
    assert pool.page(0).pins == ["conv-1"]
    assert pool.pin_pages("conv-1") == [0, 1]
    assert pool.num_free == 2
    assert pool.allocate([4] * 3) is None
    assert pool.allocate([4] * 2) == [2, 3]
    clock.t = 129.9
    assert pool.expire_pins() == []
    assert refs(pool) == [1, 1, 1, 1]
    clock.t = 130.0
    assert pool.expire_pins() == ["conv-1"]
    assert refs(pool) == [0, 0, 1, 1]
    assert pool.cached_page_ids() == [1, 0]
    assert pool.page(0).pins == []
    assert pool.pin_ids() == []
    assert pool.allocate([4] * 1) == [1]  # now evictable


def test_page_holders_names_what_keeps_each_referenced_page() -> None:
    pool, _ = make_pool(12)
    ids = pool.allocate([4] * 10)
    assert ids is not None
    for pid in ids:
        pool.register(pid, 100 + pid)
    pool.pin("hold", [0, 1], ttl_s=5)  # a transfer hold
    pool.pin("conv", [2, 3, 4], ttl_s=5, reclaim=RECLAIM_FIRST)  # a retained conversation
    pool.pin("pulled", [4, 5], ttl_s=5, reclaim=RECLAIM_LAST)  # page 4 in two pins: the least reclaimable names it
    pool.pin("prefix", [5], ttl_s=5, reclaim=RECLAIM_NEVER)  # and page 5: never beats pulled
    pool.free(ids[:6] + ids[8:])  # pages 6 and 7 stay a request's; 8 and 9 become cached; 10 and 11 are free
    assert pool.page_holders() == {"requests": 2, "pins_never": 3, "pins_retained": 3, "pins_pulled": 0}
    pool.pin("again", [6], ttl_s=5, reclaim=RECLAIM_LAST)  # a request's page pinned too stays the request's
    assert pool.page_holders()["requests"] == 2 and sum(pool.page_holders().values()) == 8
    # the caller names never-reclaimed pins by what it keeps with them (the pool never reads a record)
    named = pool.page_holders(kind_of=lambda pin: f"pins_{pin.pin_id}")
    assert named == {"requests": 2, "pins_retained": 3, "pins_pulled": 0, "pins_hold": 2, "pins_prefix": 1}


def test_reclaim_one_releases_retained_conversations_first_then_admission_pins_earliest_expiry_first() -> None:
    pool, clock = make_pool(8)
    ids = pool.allocate([4] * 8)
    assert ids == [0, 1, 2, 3, 4, 5, 6, 7]
    for pid in ids:
        pool.register(pid, 10 + pid)
    pool.pin("hard", [0, 1], ttl_s=5)  # a transfer hold: never reclaimed
    pool.pin("pin", [6, 7], ttl_s=2, reclaim=RECLAIM_LAST)  # pulled pages awaiting admission: last
    pool.pin("conv-late", [2, 3], ttl_s=60, reclaim=RECLAIM_FIRST)
    clock.t += 1
    pool.pin("conv-early", [4, 5], ttl_s=30, reclaim=RECLAIM_FIRST)  # expires first (131 < 160)
    pool.free(ids)
    assert pool.num_free == 0 and pool.allocate([4] * 1) is None
    assert pool.reclaim_one() == "conv-early"
    assert pool.pin_ids() == ["hard", "pin", "conv-late"]
    assert refs(pool) == [1, 1, 1, 1, 0, 0, 1, 1]
    assert pool.cached_page_ids() == [5, 4]  # back in the prefix cache, tail first
    assert pool.lookup(14) == 4  # hashes kept: a later request can still match them
    assert pool.reclaim_one() == "conv-late"
    assert pool.reclaim_one() == "pin"
    assert pool.reclaim_one() is None  # only the hard pin is left
    assert pool.reclaimed_pins == 3
    assert pool.pin_ids() == ["hard"]
    with pytest.raises(ValueError, match="reclaim must be one of"):
        pool.pin("bad", [0], ttl_s=1, reclaim=3)


def _full_pool_with_an_admission_pin(num_pages: int, pinned: int) -> tuple[PagePool, str, list[int]]:
    """``pinned`` hashed pages (0..pinned-1) under an admission pin (RECLAIM_LAST) and nothing else
    holding them; the rest owned by a running sequence: nothing free or cached."""
    pool, _ = make_pool(num_pages)
    ids = pool.allocate([4] * pinned)
    assert ids == list(range(pinned))
    for pid in ids:
        pool.register(pid, 10 + pid)
    pool.pin("pull-a", ids, ttl_s=60, reclaim=RECLAIM_LAST)
    pool.free(ids)
    running = pool.allocate([4] * (num_pages - pinned))
    assert running is not None and pool.num_free == 0
    return pool, "pull-a", running


def test_an_admission_pin_gives_a_running_sequence_only_the_pages_it_lacks_from_its_tail() -> None:
    pool, pin, running = _full_pool_with_an_admission_pin(10, 8)
    assert running == [8, 9]
    # the running sequence needs one page more: the pin's last page (7) only, re-allocated to it
    assert pool.allocate_reclaiming([4], up_to=RECLAIM_LAST, after=9) == [7]
    assert pool.pin_pages(pin) == [0, 1, 2, 3, 4, 5, 6]
    assert refs(pool) == [1] * 10 and pool.num_free == 0
    assert pool.lookup(17) is None and pool.lookup(16) == 6  # page 7 evicted, the pinned prefix still matches
    assert (pool.trimmed_pages, pool.reclaimed_pins) == (1, 0)
    # a pull never takes them (``up_to=RECLAIM_FIRST``): the 7 stay pinned
    assert pool.allocate_reclaiming([4], up_to=RECLAIM_FIRST) is None
    assert pool.pin_pages(pin) == [0, 1, 2, 3, 4, 5, 6] and pool.trimmed_pages == 1
    # the request admitted now matches the 7 pinned pages
    assert pool.match_prefix([10 + i for i in range(8)]) == [0, 1, 2, 3, 4, 5, 6]


def test_an_admission_pin_gives_up_as_many_tail_pages_as_the_allocation_lacks_in_one_trim() -> None:
    pool, pin, _ = _full_pool_with_an_admission_pin(10, 8)
    pool.free([9])  # one free page: 3 more are lacking for 4
    assert pool.allocate_reclaiming([4] * 4, up_to=RECLAIM_LAST) is not None
    assert pool.pin_pages(pin) == [0, 1, 2, 3, 4] and (pool.trimmed_pages, pool.reclaimed_pins) == (3, 0)


def test_retained_conversations_still_yield_whole_and_before_an_admission_pin_is_trimmed() -> None:
    pool, clock = make_pool(8)
    ids = pool.allocate([4] * 6)
    assert ids == [0, 1, 2, 3, 4, 5]
    for pid in ids:
        pool.register(pid, 10 + pid)
    pool.pin("pull", [0, 1, 2, 3], ttl_s=2, reclaim=RECLAIM_LAST)  # expires first: still after the conversation
    pool.pin("conv", [4, 5], ttl_s=60, reclaim=RECLAIM_FIRST)
    pool.free(ids)
    assert pool.allocate([4, 4]) == [6, 7] and pool.num_free == 0
    # one page: the conversation goes whole (both pages cached, its tail 5 evicted first)
    assert pool.allocate_reclaiming([4], up_to=RECLAIM_LAST) == [5]
    assert pool.pin_ids() == ["pull"] and pool.cached_page_ids() == [4]
    assert (pool.reclaimed_pins, pool.trimmed_pages) == (1, 0)
    # two more: the conversation's cached page 4, then the admission pin's last page
    assert pool.allocate_reclaiming([4, 4], up_to=RECLAIM_LAST) == [3, 4]
    assert pool.pin_pages("pull") == [0, 1, 2] and (pool.reclaimed_pins, pool.trimmed_pages) == (1, 1)


def test_an_admission_pin_trimmed_to_nothing_is_released_once() -> None:
    pool, pin, _ = _full_pool_with_an_admission_pin(4, 2)
    released: list[str] = []
    pool.on_release = lambda p, _now: released.append(p.pin_id)
    assert pool.allocate_reclaiming([4, 4, 4], up_to=RECLAIM_LAST) is None  # more than the pin holds: nothing yields
    assert pool.pin_pages(pin) == [0, 1] and released == []
    assert pool.allocate_reclaiming([4, 4], up_to=RECLAIM_LAST) == [0, 1]  # all it holds: released whole
    assert pool.get_pin(pin) is None and released == [pin]
    assert (pool.reclaimed_pins, pool.trimmed_pages) == (1, 2)
    # trimmed one page at a time, the last trim releases it
    pool, pin, _ = _full_pool_with_an_admission_pin(4, 2)
    pool.on_release = lambda p, _now: released.append(p.pin_id)
    pool.trim_pin(pin, 1)
    assert pool.pin_pages(pin) == [0] and pool.cached_page_ids() == [1] and released == [pin]
    pool.trim_pin(pin, 1)
    assert pool.get_pin(pin) is None and pool.cached_page_ids() == [1, 0] and released == [pin, pin]
    with pytest.raises(ValueError, match="k must be >= 1"):
        pool.trim_pin("none", 0)


def test_unhashed_pinned_pages_return_to_the_free_list_on_release() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 2) == [0, 1]
    pool.pin("a", [0, 1], ttl_s=5)
    pool.pin("b", [1], ttl_s=5)
    pool.free([0, 1])
    assert refs(pool) == [1, 2, 0, 0]
    assert pool.page(1).pins == ["a", "b"]
    pool.release("a")
    assert refs(pool) == [0, 1, 0, 0]
    assert pool.page(1).pins == ["b"]
    assert pool.allocate([4] * 1) == [0]


def test_a_pin_keeps_its_makers_record_and_the_pool_lists_pins_in_order() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 2) == [0, 1]
    record = object()
    pool.pin("a", [0], ttl_s=5, record=record)
    pool.pin("b", [1], ttl_s=5)
    assert [(p.pin_id, p.page_ids, p.record) for p in pool.pins()] == [("a", (0,), record), ("b", (1,), None)]
    assert pool.get_pin("a") is pool.pins()[0] and pool.get_pin("nope") is None
    pool.release("a")
    assert pool.get_pin("a") is None and pool.pin_ids() == ["b"]


def test_renew_extends_and_expiry_order() -> None:
    pool, clock = make_pool(4)
    assert pool.allocate([4] * 3) == [0, 1, 2]
    pool.pin("a", [0], ttl_s=10)
    pool.pin("b", [1], ttl_s=5)
    pool.pin("c", [2], ttl_s=20)
    clock.t = 104.0
    assert pool.renew("b", ttl_s=10) == 114.0
    assert pool.pin_expires_at("b") == 114.0
    clock.t = 115.0
    assert pool.expire_pins() == ["a", "b"]  # earliest expiry first
    assert pool.pin_ids() == ["c"]
    clock.t = 120.0
    with pytest.raises(ValueError, match="expired"):
        pool.renew("c", ttl_s=10)
    assert pool.expire_pins() == ["c"]


def test_pin_errors() -> None:
    pool, _ = make_pool(4)
    assert pool.allocate([4] * 1) == [0]
    with pytest.raises(ValueError, match="unknown pin 'nope'"):
        pool.release("nope")
    with pytest.raises(ValueError, match="unknown pin"):
        pool.renew("nope", ttl_s=1)
    with pytest.raises(ValueError, match="unknown pin"):
        pool.pin_pages("nope")
    with pytest.raises(ValueError, match="ttl_s"):
        pool.pin("x", [0], ttl_s=0)
    with pytest.raises(ValueError, match="is free"):
        pool.pin("x", [0, 1], ttl_s=1)
    assert refs(pool) == [1, 0, 0, 0]
    pool.pin("x", [0], ttl_s=1)
    with pytest.raises(ValueError, match="already exists"):
        pool.pin("x", [0], ttl_s=1)
    pool.release("x")
    with pytest.raises(ValueError, match="unknown pin"):
        pool.release("x")
    assert refs(pool) == [1, 0, 0, 0]


def test_pool_modules_do_not_import_torch() -> None:
    code = (
        "import sys, kvserving.kernels.page_ids, kvserving.worker.kv.page_pool, kvserving.worker.triaxial_pool,"
        " kvserving.worker.precision;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"

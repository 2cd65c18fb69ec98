"""Prefix matching above the pool: exact page ids, and triaxial pages reused
only at their request's precision or a more precise one."""

from __future__ import annotations

from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.tags import NUM_TAGS, encode_tag
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.kv.page_pool import RECLAIM_FIRST, PagePool
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import Sequence
from kvserving.worker.triaxial_pool import TriaxialPagePool

OLD = encode_tag("older", "text", "user")  # 2 bits in TABLE
NOW = encode_tag("current", "text", "user")  # 4 bits
TABLE = tuple(2 if t == OLD else 4 for t in range(NUM_TAGS))
TOKENS = list(range(100, 165))  # two full pages of 32 and one token


def seq(rid: str, tags: list[int], tokens: list[int] = TOKENS) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), make_generator(0), tags=tags)


def run_and_cache(kv: KVCacheManager, s: Sequence) -> list[int]:
    """Allocate and 'compute' the whole prompt, publish its pages, finish."""
    assert kv.match_prefix(s) == 0
    assert kv.allocate_until(s, s.num_tokens)
    s.num_computed = s.num_tokens
    kv.publish_full_pages(s)
    ids = list(s.page_ids)
    kv.free(s)
    return ids


def triaxial_manager() -> KVCacheManager:
    pool = TriaxialPagePool(64 * 1024, int4_page_bytes=1024, int2_page_bytes=512, page_size=32)
    return KVCacheManager(pool, page_size=32, bits_table=TABLE)


def test_int2_pages_are_not_reused_where_int4_is_wanted() -> None:
    kv = triaxial_manager()
    ids = run_and_cache(kv, seq("a", [OLD] * 65))
    assert [bool(p & INT2_PAGE_FLAG) for p in ids] == [True, True, False]
    fresh = seq("b", [NOW] * 65)  # same tokens, current turn: wants INT4
    assert kv.match_prefix(fresh) == 0
    assert fresh.page_ids == []


def test_int4_pages_are_reused_where_int2_is_wanted() -> None:
    kv = triaxial_manager()
    ids = run_and_cache(kv, seq("a", [NOW] * 65))
    assert ids == [0, 1, 2]
    aged = seq("b", [OLD] * 65)  # the same turn two turns later: wants INT2, INT4 is fine
    assert kv.match_prefix(aged) == 64
    assert aged.page_ids == [0, 1]
    assert kv.pool.ref_count(0) == 1 and kv.pool.ref_count(1) == 1
    # and the pages it then computes chain on the matched ones
    assert kv.allocate_until(aged, 65)
    assert aged.page_ids[:2] == [0, 1]


def test_int2_pages_are_reused_where_int2_is_wanted() -> None:
    kv = triaxial_manager()
    ids = run_and_cache(kv, seq("a", [OLD] * 65))
    again = seq("b", [OLD] * 65)
    assert kv.match_prefix(again) == 64
    assert again.page_ids == ids[:2]


def test_plain_pools_ignore_tags() -> None:
    kv = KVCacheManager(PagePool(16, page_size=16), page_size=16)
    run_and_cache(kv, seq("a", [OLD] * 65))
    other = seq("b", [NOW] * 65)
    assert kv.match_prefix(other) == 64  # four full pages of 16; the last token is computed
    assert other.page_ids == [0, 1, 2, 3]


def test_pages_match_only_requests_of_the_same_salt() -> None:
    kv = KVCacheManager(PagePool(16, page_size=16), page_size=16)
    tenant_a = seq("a", [NOW] * 65)
    tenant_a.cache_salt = b"aa"
    ids = run_and_cache(kv, tenant_a)
    for rid, salt in (("none", None), ("b", b"bb")):
        other = seq(rid, [NOW] * 65)
        other.cache_salt = salt
        assert kv.match_prefix(other) == 0 and other.page_ids == []
    same = seq("a2", [NOW] * 65)
    same.cache_salt = b"aa"
    assert kv.match_prefix(same) == 64 and same.page_ids == ids[:4]
    # the pull's view (kv_transfer): the hashes a sender offers are those the prefix cache holds
    assert kv.page_hashes(same, [4] * 4) == same.page_hashes


def test_triaxial_pages_match_whatever_roles_the_tokens_come_back_with() -> None:
    # A reply the decode worker tagged assistant comes back next turn as reasoning /
    # tool_call text of an older turn: same tokens, same stored precision, same KV.
    kv = triaxial_manager()
    ids = run_and_cache(kv, seq("a", [encode_tag("current", "text", "assistant")] * 65))
    retagged = seq(
        "b", [encode_tag("turn_m1", "text", s) for s in ("reasoning", "tool_call")] * 32 + [encode_tag("current", "text", "user")]
    )
    assert kv.match_prefix(retagged) == 64
    assert retagged.page_ids == ids[:2]


def test_a_pool_full_of_retained_conversations_yields_to_a_new_request() -> None:
    """Retained KV (reclaimable leases) must not starve live requests: the least recently
    active conversation's lease goes first, a hard pin (transfer hold) never."""
    pool = PagePool(6, page_size=32)
    kv = KVCacheManager(pool, page_size=32)
    old = seq("old", [NOW] * len(TOKENS))  # 65 tokens: 3 pages, 2 full
    assert kv.allocate_until(old, old.num_tokens)
    old.num_computed = old.num_tokens
    kv.publish_full_pages(old)
    pool.pin("conv-old", old.page_ids[:2], ttl_s=100, reclaim=RECLAIM_FIRST)
    pool.pin("xfer-hold", [old.page_ids[2]], ttl_s=200)
    kv.free(old)
    other = seq("other", [NOW] * 64, tokens=list(range(500, 564)))
    assert kv.allocate_until(other, other.num_tokens)  # 2 pages of the 3 free
    pool.pin("conv-other", other.page_ids, ttl_s=150, reclaim=RECLAIM_FIRST)
    kv.free(other)
    assert pool.num_free == 1
    new = seq("new", [NOW] * 96, tokens=list(range(900, 996)))  # 3 pages
    assert kv.allocate_until(new, new.num_tokens)
    assert pool.pin_ids() == ["xfer-hold", "conv-other"]  # conv-old (earliest expiry) went
    assert pool.reclaimed_pins == 1
    kv.free(new)
    big = seq("big", [NOW] * 192, tokens=list(range(1000, 1192)))  # 6 pages: more than any reclaim frees
    assert not kv.allocate_until(big, big.num_tokens)
    # nothing yields for a request that would not fit even then (conv-other's pages stay protected)
    assert pool.pin_ids() == ["xfer-hold", "conv-other"] and big.page_ids == [] and pool.reclaimed_pins == 1
    five = seq("five", [NOW] * 160, tokens=list(range(2000, 2160)))  # 5 pages: fits once conv-other yields
    assert kv.allocate_until(five, five.num_tokens)
    assert pool.pin_ids() == ["xfer-hold"] and pool.reclaimed_pins == 2


def test_a_triaxial_pool_releases_no_pin_for_a_request_that_would_not_fit_in_bytes() -> None:
    """The room check counts bytes where INT4 and INT2 pages share one buffer: pins yield only when the
    pages left referenced and the request's pages fit the buffer together."""
    pool = TriaxialPagePool(8 * 1024, int4_page_bytes=1024, int2_page_bytes=512, page_size=32)
    kv = KVCacheManager(pool, page_size=32, bits_table=TABLE)
    held = seq("held", [NOW] * 96, tokens=list(range(100, 196)))  # 3 INT4 pages
    assert kv.allocate_until(held, held.num_tokens)
    held.num_computed = held.num_tokens
    kv.publish_full_pages(held)
    pool.pin("conv", held.page_ids[:2], ttl_s=100, reclaim=RECLAIM_FIRST)
    pool.pin("hold", held.page_ids[2:], ttl_s=100)  # a hard pin: never yields
    kv.free(held)
    filler = seq("filler", [OLD] * 160, tokens=list(range(300, 460)))  # 5 INT2 pages (2.5 KiB) stay owned
    assert kv.allocate_until(filler, filler.num_tokens)
    # 8 KiB: 3 KiB pinned (2 of it yields), 2.5 KiB owned; 5 INT4 pages (5 KiB) need the conversation's 2 KiB
    # and still do not fit (1 KiB + 2.5 KiB + 5 KiB > 8 KiB): nothing is released
    wide = seq("wide", [NOW] * 160, tokens=list(range(600, 760)))
    assert not kv.allocate_until(wide, wide.num_tokens)
    assert pool.pin_ids() == ["conv", "hold"] and pool.reclaimed_pins == 0
    # 4 INT4 pages (4 KiB) fit once the conversation yields: it does
    four = seq("four", [NOW] * 128, tokens=list(range(800, 928)))
    assert kv.allocate_until(four, four.num_tokens)
    assert pool.pin_ids() == ["hold"] and pool.reclaimed_pins == 1


def test_a_waiting_request_is_hashed_once_however_often_its_admission_is_tried() -> None:
    """A queue head that does not fit tries its admission every step: its pages' chain hashes are computed
    once (``Sequence.token_chain``), equal to hashing them afresh, and its matches are unchanged."""
    from kvserving.worker.kv.page_pool import chain_hashes

    kv = KVCacheManager(PagePool(16, page_size=16), page_size=16)
    tokens = list(range(300, 397))  # six full pages and one token
    ids = run_and_cache(kv, seq("first", [NOW] * 97, tokens))
    calls: list[int] = []

    def counted(token_ids: list[int], page_size: int, tags: object = None, **kw: object) -> list[int]:
        calls.append(len(token_ids) // page_size)
        return chain_hashes(token_ids, page_size, None, **kw)  # type: ignore[arg-type]

    kv.pool.chain_hashes = counted  # type: ignore[method-assign]
    waiting = seq("waiting", [NOW] * 97, tokens)
    for _ in range(5):  # matched, then given back as an admission that does not fit would
        assert kv.match_prefix(waiting) == 96 and waiting.page_ids == ids[:6]
        kv.free(waiting)
    assert sum(calls) == 6  # each of the six full pages hashed once
    assert waiting.token_chain == chain_hashes(tokens[:96], 16)

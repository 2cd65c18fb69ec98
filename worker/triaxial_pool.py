"""The triaxial page pool: INT4 and INT2 pages in ONE byte buffer per layer,
growing from its two ends (DESIGN.md, KV formats: triaxial; kernels/layout.py).
Pure Python: ids and byte offsets; the storage layer owns the bytes.

    byte 0                                                                  total
    | int4 0 | int4 1 | ... | int4 h4-1 |   gap   | int2 h2-1 | ... | int2 1 | int2 0 |
    '------------ h4 * B4 -------------'          '------------- h2 * B2 ------------'

INT4 page i occupies ``[i*B4, (i+1)*B4)``; INT2 page j occupies
``[total-(j+1)*B2, total-j*B2)``; its page id is ``j | INT2_PAGE_FLAG``
(ids and offsets: ``kvserving.kernels.page_ids``, torch-free).

No static split: an allocation succeeds while ``h4*B4 + h2*B2 <= total``, so an
INT4-only workload can fill the whole buffer (every decode-generated token is
INT4; a fixed split ran a public TriAxialKV reproduction out of memory).

Policy that keeps the two ends from deadlocking each other:

- each end hands out its lowest free index first, so live pages stay packed at
  its outer end, and its high-water mark ``h`` drops as soon as its innermost
  page is freed -- the bytes go back to the gap for either precision;
- ``allocate(page_bits)`` places one page per entry (2 or 4) and is
  all-or-nothing across the two ends (one sequence's new pages at once: two
  separate calls could fail where one placement of both kinds fits). For each
  precision ``b`` it takes, in order: free slots of precision ``b`` below its
  mark, then the gap, then evicts cached pages, the least recently used of two
  candidates first: its own end's LRU page, or the *other* end's innermost
  cached pages (as many as free one slot of ``b``), whose mark then moves back
  (never past a page someone owns); on a tie its own. Without the second
  candidate a pool whose mix of precisions shifts (a bit-budget cut that moved,
  docs/kv-cache.md) would evict the newest pages of the growing end while stale
  pages of the other end stay cached. ``num_free_pages(bits=b)`` counts exactly
  what a one-precision request can get.

What can still strand space: an owned page deep inside one end keeps that end's
mark above it; free slots below it serve only its own precision. And a cached
innermost page used more recently than the other end's oldest (a live
conversation's system prompt, matched every turn) keeps the stale cached pages
below it from the other precision: under agent load the INT4 end keeps the size
its first turns gave it and the pool stores more bits than the table's mix
(docs/performance-log/bit-budget.md, the two-ended buffer).

Age-down (``KVCacheManager``, docs/kv-cache.md) adds ``retire``: the INT4 page
an aged INT2 copy replaces forgets its hash at once (no new request matches
it) and goes back to the free list as soon as nobody holds it, not to the LRU.
A holder (a lease, another running sequence) keeps reading it unchanged until
it lets go.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvserving.kernels.page_ids import INT2_PAGE_FLAG, page_byte_offset, page_id_bits, page_index

from kvserving.worker.kv.page_pool import PagePoolBase, _Region

BITS = (2, 4)


class TriaxialPagePool(PagePoolBase):
    """Dual INT4/INT2 page pool over a ``total_bytes_per_layer`` buffer (same bytes in every layer)."""

    precisions = BITS

    def __init__(
        self,
        total_bytes_per_layer: int,
        *,
        int4_page_bytes: int,
        int2_page_bytes: int,
        page_size: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(page_size=page_size, clock=clock)
        if int4_page_bytes < 1 or int2_page_bytes < 1:
            raise ValueError(f"page bytes must be >= 1, got int4 {int4_page_bytes}, int2 {int2_page_bytes}")
        if total_bytes_per_layer < max(int4_page_bytes, int2_page_bytes):
            raise ValueError(f"total_bytes_per_layer {total_bytes_per_layer} holds no page")
        if total_bytes_per_layer // min(int4_page_bytes, int2_page_bytes) >= INT2_PAGE_FLAG:
            raise ValueError("too many pages: indices must stay below INT2_PAGE_FLAG")
        self.total_bytes = total_bytes_per_layer
        self._bytes = {4: int4_page_bytes, 2: int2_page_bytes}
        self._r = {4: _Region(flag=0), 2: _Region(flag=INT2_PAGE_FLAG)}
        self._regions = (self._r[4], self._r[2])

    # -- ids and bytes ------------------------------------------------------------------------
    def page_bytes(self, *, bits: int) -> int:
        return self._bytes[_check_bits(bits)]

    def byte_offset(self, page_id: int) -> int:
        """Start of the page in its layer buffer (equals kernels.layout.page_byte_offset)."""
        self._check_id(page_id)
        return page_byte_offset(page_id, page_bytes=self._bytes[4], int2_page_bytes=self._bytes[2], total_bytes=self.total_bytes)

    def high_water(self, *, bits: int) -> int:
        """Slots the ``bits`` end spans now (its live pages all lie below this index)."""
        return self._r[_check_bits(bits)].hwm

    def _region_of(self, page_id: int) -> _Region:
        return self._r[page_id_bits(page_id)]

    def _check_id(self, page_id: int) -> None:
        bits = page_id_bits(page_id)
        index = page_index(page_id)
        limit = self.total_bytes // self._bytes[bits]
        if not 0 <= page_id < INT2_PAGE_FLAG << 1 or not index < limit:
            raise ValueError(f"INT{bits} page index must be in 0..{limit - 1}, got page id {page_id}")

    # -- capacity -----------------------------------------------------------------------------
    def _min_mark(self, region: _Region) -> int:
        """How low ``region``'s mark can go by evicting its innermost cached pages."""
        index = region.hwm
        while index:
            page = self._pages.get(region.flag | (index - 1))
            if page is not None and page.ref_count > 0:
                break
            index -= 1
        return index

    def num_free_pages(self, *, bits: int) -> int:
        """Exactly how many ``bits`` pages ``allocate`` can give now (free, gap, evictable)."""
        mine, other = self._r[_check_bits(bits)], self._r[6 - bits]
        gap = self.total_bytes - mine.hwm * self._bytes[bits] - self._min_mark(other) * self._bytes[6 - bits]
        return mine.num_free + len(mine.lru) + gap // self._bytes[bits]

    def held_pages(self, *, bits: int, cached: bool = True) -> int:
        """Pages of precision ``bits`` held now: owned, and cached unless ``cached`` is False
        (every slot below the mark is owned, cached or free)."""
        region = self._r[_check_bits(bits)]
        return region.hwm - region.num_free - (0 if cached else len(region.lru))

    def _room_of(self, bits: int) -> int:
        return self._bytes[bits]  # bytes

    def _room_referenced(self) -> int:
        return sum(self.held_pages(bits=b, cached=False) * self._bytes[b] for b in BITS)

    def _room_total(self) -> int:
        return self.total_bytes

    @property
    def num_free(self) -> int:
        """Pages allocatable at either precision (the smaller of the two counts)."""
        return min(self.num_free_pages(bits=b) for b in BITS)

    def capacity_tokens(self, frac_int2: float = 0.0) -> int:
        """Tokens the whole buffer holds when ``frac_int2`` of its pages are INT2:
        the most pages n with round(frac_int2*n) INT2 and the rest INT4 that fit."""
        if not 0.0 <= frac_int2 <= 1.0:
            raise ValueError(f"frac_int2 must be in [0, 1], got {frac_int2}")
        b4, b2 = self._bytes[4], self._bytes[2]
        n = int(self.total_bytes / (frac_int2 * b2 + (1.0 - frac_int2) * b4)) + 1
        while n > 0:
            n2 = round(frac_int2 * n)
            if n2 * b2 + (n - n2) * b4 <= self.total_bytes:
                break
            n -= 1
        return n * self.page_size

    # -- age-down: retired pages ----------------------------------------------------
    def retire(self, page_id: int) -> None:
        """Forget ``page_id``'s hashes (no new request matches it) and free it once its last
        ref goes (now, if it has none). Holders keep reading it unchanged meanwhile."""
        page = self._live(page_id)
        if page.hash is not None:
            del self._by_hash[page.hash]
            page.hash = None
        if page.ref_count == 0:  # cached: off the LRU, slot back to the free list
            region = self._region_of(page_id)
            region.lru.pop(page_id)
            del self._pages[page_id]
            region.put_free(page_id & ~region.flag)
        # else: with no hash, ``free`` puts it on the free list when its last ref goes

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, page_bits: Sequence[int]) -> list[int] | None:
        """One page per entry of ``page_bits`` (2 or 4 each), in that order, ref 1 each;
        None, changing nothing, if they do not all fit (policy in the module docstring).

        Both kinds are checked at once: it succeeds iff extents
        ``e2 = max(min_mark2, owned2 + n2)`` and ``e4`` likewise fit in the buffer.
        INT2 goes first, capped at the extent that still leaves INT4 its ``e4``."""
        n2 = sum(1 for b in page_bits if _check_bits(b) == 2)
        n4 = len(page_bits) - n2
        if not n2 or not n4:
            return self._allocate_one_kind(len(page_bits), bits=2 if n2 else 4)
        r2, r4 = self._r[2], self._r[4]
        e2 = max(self._min_mark(r2), self._num_owned_in(r2) + n2)
        e4 = max(self._min_mark(r4), self._num_owned_in(r4) + n4)
        if e2 * self._bytes[2] + e4 * self._bytes[4] > self.total_bytes:
            return None
        cap2 = (self.total_bytes - e4 * self._bytes[4]) // self._bytes[2]
        int2 = iter(self._own(self._take(n2, 2, cap=cap2, floor=e4)))
        int4 = iter(self._own(self._take(n4, 4, cap=None)))
        return [next(int2) if b == 2 else next(int4) for b in page_bits]

    def _allocate_one_kind(self, n: int, *, bits: int) -> list[int] | None:
        mine, other = self._r[bits], self._r[6 - bits]
        gap = (self.total_bytes - mine.hwm * self._bytes[bits] - other.hwm * self._bytes[6 - bits]) // self._bytes[bits]
        # Fast path first: scanning the other end (num_free_pages) is needed only when short.
        if n > mine.num_free + gap + len(mine.lru) and n > self.num_free_pages(bits=bits):
            return None
        return self._own(self._take(n, bits, cap=None))

    def _num_owned_in(self, region: _Region) -> int:
        # every slot below the mark is owned, free or cached (evicted slots are reused at once)
        return region.hwm - region.num_free - len(region.lru)

    def _shrink(self, region: _Region, mark: int) -> None:
        """Lower ``region``'s mark to ``mark``, evicting its cached pages from there up
        (the caller checked that nobody owns one)."""
        for index in range(mark, region.hwm):
            if region.flag | index in region.lru:
                self._evict(region.flag | index)
        region.truncate(mark)

    def _take(self, n: int, bits: int, *, cap: int | None, floor: int = 0) -> list[int]:
        """``n`` slots of precision ``bits`` (the caller checked they exist), keeping that end
        within ``cap`` slots and the other end's mark at ``floor`` or above when given: free
        slots, the gap, evictions by age (``_by_age``), then the other end's innermost cached
        pages."""
        mine, other = self._r[bits], self._r[6 - bits]
        b_mine, b_other = self._bytes[bits], self._bytes[6 - bits]
        if cap is not None and mine.hwm > cap:
            self._shrink(mine, cap)
        room = (self.total_bytes - mine.hwm * b_mine - other.hwm * b_other) // b_mine
        if cap is not None:
            room = min(room, cap - mine.hwm)
        ids = self._fill(mine, n, room=room, evict=False)
        ids += self._by_age(bits, n - len(ids), cap=cap, floor=floor)
        short = n - len(ids)
        if short:
            # Pull the other end's mark back just far enough for ``short`` more slots.
            self._shrink(other, (self.total_bytes - (mine.hwm + short) * b_mine) // b_other)
            ids += self._fill(mine, short, room=short)
        assert len(ids) == n
        return ids

    def _by_age(self, bits: int, n: int, *, cap: int | None, floor: int) -> list[int]:
        """Up to ``n`` slots of precision ``bits`` by eviction, free slots and the gap being used:
        each time the older of its own end's LRU page and the other end's innermost cached pages
        (as many as free one slot here; the other mark stays >= ``floor``, this end <= ``cap``)."""
        mine, other = self._r[bits], self._r[6 - bits]
        b_mine, b_other = self._bytes[bits], self._bytes[6 - bits]
        ids: list[int] = []
        while len(ids) < n:
            head = next(iter(mine.lru), None)
            gap = self.total_bytes - mine.hwm * b_mine - other.hwm * b_other
            if gap >= b_mine and (cap is None or mine.hwm < cap):  # left by an earlier move of the other mark
                ids.append(mine.flag | mine.grow())
                continue
            k = max(0, -(-(b_mine - gap) // b_other))  # innermost pages of the other end that free one slot
            inner = [other.flag | i for i in range(other.hwm - k, other.hwm)]
            movable = (
                k > 0
                and other.hwm - k >= floor
                and (cap is None or mine.hwm < cap)
                and all(pid in other.lru for pid in inner)
                and (head is None or max(self._pages[pid].last_used for pid in inner) < self._pages[head].last_used)
            )
            if movable:
                self._shrink(other, other.hwm - k)
                ids.append(mine.flag | mine.grow())
            elif head is not None:
                self._evict(head)
                ids.append(head)
            else:
                break
        return ids


def _check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    return bits

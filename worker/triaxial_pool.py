"""The triaxial page pool: INT4 and INT2 pages in ONE byte buffer per layer, cut into
slabs that each hold pages of one precision (DESIGN.md, KV formats: triaxial;
kernels/page_ids.py). Pure Python: ids and byte offsets; the storage layer owns the bytes.

A slab is ``S = lcm(B4, B2)`` bytes, ``a4 = S/B4`` INT4 pages or ``a2 = S/B2`` INT2
pages (122,880 B, 3 or 5 pages at the Qwen3-8B shape); the buffer is ``N = total/S``
slabs. Slab ``k`` holds INT4 indices ``a4*k ..`` or INT2 indices ``a2*(N-1-k) ..``
(``kernels.page_ids.Slabs``), so a page's bytes are where the one offset formula puts
them (INT4 page i at ``i*B4``, INT2 page j at ``total-(j+1)*B2``) and no page crosses
a slab. Five slabs, a4 = 3, a2 = 5 (numbers: live pages, owned or cached; ``.``: free)::

    0              S              2S             3S             4S             5S = total
    |  0 |  1 |  2 |  3 |  . |  5 |              | 9| .| 7| 6| 5| 4| 3| 2| 1| 0|
     '-slab 0 INT4-''-slab 1 INT4-''-slab 2 free-''-slab 3 INT2-''-slab 4 INT2-'

Policies, exact so tests can assert them:

- **A slab is free, INT4 or INT2**; one with no live page (owned or cached) is free again at
  once, for either precision.
- **Placement.** ``allocate`` places each page of precision ``b``, cheapest first:

  1. a free slot in a slab of ``b``: in slabs that hold an owned page first, then in the others
     (a slab with no owned page can still change precision: it stays whole while another slot
     serves); the lowest index first -- INT4 slabs from the bottom, INT2 slabs from the top,
     and in a slab its lowest index -- so a sequence's pages form runs of consecutive ids
     (one NIXL descriptor per run) and the precisions stay apart;
  2. a free slab: INT4 takes the lowest, INT2 the highest;
  3. an eviction by age, the older of (a) the least recently used cached page of ``b`` (its
     slot is reused) and (b) the slab of the other precision with no owned page whose newest
     cached page is the oldest of such slabs: its cached pages are evicted and it becomes a
     slab of ``b`` with ``a_b`` free slots. Ties go to (a). Without (b) a pool whose mix of
     precisions shifts (a bit-budget cut that moved, docs/kv-cache.md) would evict the newest
     pages of the growing precision while stale pages of the other stay cached; judging a
     slab by its newest page keeps a hot page (a system prompt matched every turn) cached.

  The slots chosen go to the sequence in ascending id order, not in the order chosen: the
  LRU hands a freed conversation's pages back last page first, and in that order no two of
  a sequence's pages would follow each other (a NIXL region each, per layer).

- **All or nothing, both precisions at once.** ``allocate(page_bits)`` gets one sequence's new
  pages in one call (two calls could fail where one placement fits). With ``O_b`` the free and
  cached slots of ``b`` in slabs that hold an owned page, ``U_b`` the slabs of ``b`` with no
  owned page and ``F`` the free slabs, ``n4`` INT4 and ``n2`` INT2 pages fit iff
  ``ceil(max(0, n4-O4)/a4) + ceil(max(0, n2-O2)/a2) <= F + U4 + U2``. INT2 is placed first
  and takes at most ``F + U4 + U2 - ceil(max(0, n4-O4)/a4)`` slabs that hold no owned page
  (past that it evicts only in slabs that hold one, least recently used first), which leaves
  INT4 its slabs.
- ``num_free_pages(bits=b)`` is exactly what a request of ``b`` alone can get: free slots and
  cached pages of ``b``, plus ``a_b`` per free slab and per slab of the other precision with
  no owned page (counters, O(1)).

What can still strand space: an owned page pins its slab to its precision, so up to
``a_b - 1`` free slots per such slab serve only ``b``; and a slab of the other precision
with one recently used cached page is not converted while that page is newer than ``b``'s
least recently used one (its older pages leave through their own precision's LRU).

Age-down (``KVCacheManager``, docs/kv-cache.md) adds ``retire``: the INT4 page
an aged INT2 copy replaces forgets its hash at once (no new request matches
it) and goes back to the free list as soon as nobody holds it, not to the LRU.
A holder (a lease, another running sequence) keeps reading it unchanged until
it lets go.
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvserving.kernels.page_ids import INT2_PAGE_FLAG, Slabs, page_byte_offset, page_id_bits, page_index, slab_bytes

from kvserving.worker.kv.page_pool import PagePoolBase
from kvserving.worker.kv.page_runs import Region

BITS = (2, 4)
FREE = 0  # the precision of a slab that holds no page

# Where a slab is filed (``_refile``): its precision (or FREE), whether it holds an owned page,
# whether it has a free slot.
_Key = tuple[int, bool, bool]


class _Side(Region):
    """One precision as ``PagePoolBase`` sees it: the id flag and the LRU of its cached pages;
    ``put_free`` (an owned page without a hash lost its last ref) gives the slot back to its slab."""

    __slots__ = ("_release",)

    def __init__(self, flag: int, release: Callable[[int], None]) -> None:
        super().__init__(flag)
        self._release = release

    def put_free(self, index: int) -> None:
        self._release(self.flag | index)


class TriaxialPagePool(PagePoolBase):
    """Dual INT4/INT2 page pool over a ``total_bytes_per_layer`` buffer (same bytes in every layer),
    a whole number of slabs (``kernels.page_ids.slab_bytes``)."""

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
        size = slab_bytes(int4_page_bytes, int2_page_bytes)
        if total_bytes_per_layer % size:
            raise ValueError(
                f"total_bytes_per_layer {total_bytes_per_layer} is not a whole number of slabs of {size} bytes "
                f"(the least common multiple of the page sizes {int4_page_bytes} and {int2_page_bytes})"
            )
        if total_bytes_per_layer // min(int4_page_bytes, int2_page_bytes) >= INT2_PAGE_FLAG:
            raise ValueError("too many pages: indices must stay below INT2_PAGE_FLAG")
        self.total_bytes = total_bytes_per_layer
        self.slabs = Slabs(int4_page_bytes, int2_page_bytes, total_bytes_per_layer // size)
        self._bytes = {4: int4_page_bytes, 2: int2_page_bytes}
        self._per = {4: self.slabs.int4_per_slab, 2: self.slabs.int2_per_slab}  # a4, a2
        self._r = {4: _Side(0, self._slot_released), 2: _Side(INT2_PAGE_FLAG, self._slot_released)}
        self._regions = (self._r[4], self._r[2])
        n = self.slabs.num_slabs
        # per slab
        self._kind = [FREE] * n  # FREE, 4 or 2
        self._slab_live = [0] * n  # owned + cached pages
        self._slab_owned = [0] * n  # pages with a ref
        self._free_slots = [0] * n  # bit s set: slot s is free (in a slab of a precision)
        self._newest = [0.0] * n  # newest last_used of its cached pages; kept while it holds no owned page
        self._filed: list[_Key] = [(FREE, False, False)] * n
        # the slabs by where they are filed (sorted lists: INT4 takes the lowest, INT2 the highest)
        self._empty = list(range(n))  # free slabs
        self._unowned: dict[int, set[int]] = {4: set(), 2: set()}  # U_b: live pages, none owned
        self._open: dict[tuple[int, bool], list[int]] = {(b, o): [] for b in BITS for o in (True, False)}  # a free slot; o: owned
        # per precision
        self._num_free_slots = {4: 0, 2: 0}
        self._num_owned = {4: 0, 2: 0}

    # -- ids and bytes ------------------------------------------------------------------------
    def page_bytes(self, *, bits: int) -> int:
        return self._bytes[_check_bits(bits)]

    def byte_offset(self, page_id: int) -> int:
        """Start of the page in its layer buffer (equals kernels.layout.page_byte_offset)."""
        self._check_id(page_id)
        return page_byte_offset(page_id, page_bytes=self._bytes[4], int2_page_bytes=self._bytes[2], total_bytes=self.total_bytes)

    def slab_precision(self, slab: int) -> int:
        """4 or 2 for a slab holding pages of that precision, 0 for a free slab."""
        return self._kind[slab]

    def _region_of(self, page_id: int) -> Region:
        return self._r[page_id_bits(page_id)]

    def _check_id(self, page_id: int) -> None:
        bits = page_id_bits(page_id)
        index = page_index(page_id)
        limit = self.total_bytes // self._bytes[bits]
        if not 0 <= page_id < INT2_PAGE_FLAG << 1 or not index < limit:
            raise ValueError(f"INT{bits} page index must be in 0..{limit - 1}, got page id {page_id}")

    # -- capacity -----------------------------------------------------------------------------
    def num_free_pages(self, *, bits: int) -> int:
        """Exactly how many ``bits`` pages ``allocate`` can give now (module docstring)."""
        other = 6 - _check_bits(bits)
        spare = len(self._empty) + len(self._unowned[other])
        return self._num_free_slots[bits] + len(self._r[bits].lru) + self._per[bits] * spare

    def held_pages(self, *, bits: int, cached: bool = True) -> int:
        """Pages of precision ``bits`` held now: owned, and cached unless ``cached`` is False."""
        return self._num_owned[_check_bits(bits)] + (len(self._r[bits].lru) if cached else 0)

    def _room_of(self, bits: int) -> int:
        return self._bytes[bits]  # bytes

    def _room_referenced(self) -> int:
        return sum(self._num_owned[b] * self._bytes[b] for b in BITS)

    def _room_total(self) -> int:
        return self.total_bytes

    @property
    def num_free(self) -> int:
        """Pages allocatable at either precision (the smaller of the two counts)."""
        return min(self.num_free_pages(bits=b) for b in BITS)

    def capacity_tokens(self, frac_int2: float = 0.0) -> int:
        """Tokens the whole buffer holds when ``frac_int2`` of its pages are INT2: the most pages n
        with round(frac_int2*n) INT2 and the rest INT4 whose slabs, ceil(n4/a4) + ceil(n2/a2), fit."""
        if not 0.0 <= frac_int2 <= 1.0:
            raise ValueError(f"frac_int2 must be in [0, 1], got {frac_int2}")
        a4, a2, num = self._per[4], self._per[2], self.slabs.num_slabs
        # n4/a4 + n2/a2 is within 1/2 of n * (slabs per page), so no n above this start fits
        n = int((num + 0.5) / (frac_int2 / a2 + (1.0 - frac_int2) / a4)) + 1
        while n > 0:
            n2 = round(frac_int2 * n)
            if -(-(n - n2) // a4) - (-n2 // a2) <= num:
                break
            n -= 1
        return n * self.page_size

    # -- refs: per-slab counts of live and owned pages ------------------------------------------
    def incref(self, page_ids: Iterable[int]) -> None:
        ids = list(page_ids)
        cached = {pid for pid in ids if (page := self._pages.get(pid)) is not None and page.ref_count == 0}
        super().incref(ids)
        for pid in cached:
            self._hold(self.slabs.locate(pid)[0], page_id_bits(pid))

    def free(self, page_ids: Sequence[int]) -> None:
        last = [pid for pid, n in Counter(page_ids).items() if (page := self._pages.get(pid)) is not None and page.ref_count == n]
        super().free(page_ids)  # a page without a hash comes back through ``_slot_released``
        for pid in last:
            if pid in self._pages:  # cached now
                k = self.slabs.locate(pid)[0]
                self._slab_owned[k] -= 1
                self._num_owned[page_id_bits(pid)] -= 1
                self._refile(k)

    def _slot_released(self, page_id: int) -> None:
        """An owned page went without being cached: its slot is free."""
        k, slot = self.slabs.locate(page_id)
        self._slab_owned[k] -= 1
        self._num_owned[page_id_bits(page_id)] -= 1
        self._open_slot(k, slot, page_id_bits(page_id))

    def _open_slot(self, k: int, slot: int, bits: int) -> None:
        self._slab_live[k] -= 1
        self._free_slots[k] |= 1 << slot
        self._num_free_slots[bits] += 1
        self._refile(k)

    def _hold(self, k: int, bits: int) -> None:
        """One more owned page in slab ``k`` (a taken slot or a cached page with a ref again)."""
        self._slab_owned[k] += 1
        self._num_owned[bits] += 1
        self._refile(k)

    def _refile(self, k: int) -> None:
        """File slab ``k`` where its counts say (free again when it holds no live page)."""
        kind = self._kind[k]
        if kind != FREE and not self._slab_live[k]:
            self._num_free_slots[kind] -= self._free_slots[k].bit_count()
            self._kind[k] = kind = FREE
            self._free_slots[k] = 0
        owned = self._slab_owned[k] > 0
        if kind != FREE and not owned:
            pages = (self._pages.get(pid) for pid in self.slabs.page_ids(k, bits=kind))
            self._newest[k] = max(page.last_used for page in pages if page is not None)
        key = (kind, owned, self._free_slots[k] != 0)
        old = self._filed[k]
        if key == old:
            return
        for file, add in ((old, False), (key, True)):
            kind_, owned_, has_free = file
            if kind_ == FREE:
                _sorted_set(self._empty, k, add)
                continue
            if not owned_:
                (self._unowned[kind_].add if add else self._unowned[kind_].remove)(k)
            if has_free:
                _sorted_set(self._open[kind_, owned_], k, add)
        self._filed[k] = key

    # -- age-down: retired pages ----------------------------------------------------
    def retire(self, page_id: int) -> None:
        """Forget ``page_id``'s hashes (no new request matches it) and free it once its last
        ref goes (now, if it has none). Holders keep reading it unchanged meanwhile."""
        page = self._live(page_id)
        if page.hash is not None:
            del self._by_hash[page.hash]
            page.hash = None
        if page.ref_count == 0:  # cached: off the LRU, its slot free
            self._r[page_id_bits(page_id)].lru.pop(page_id)
            del self._pages[page_id]
            k, slot = self.slabs.locate(page_id)
            self._open_slot(k, slot, page_id_bits(page_id))
        # else: with no hash, ``free`` frees its slot when its last ref goes

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, page_bits: Sequence[int]) -> list[int] | None:
        """One page per entry of ``page_bits`` (2 or 4 each), in that order, ref 1 each;
        None, changing nothing, if they do not all fit (policy in the module docstring)."""
        n2 = sum(1 for b in page_bits if _check_bits(b) == 2)
        n4 = len(page_bits) - n2
        if not n2 or not n4:
            bits = 2 if n2 else 4
            if len(page_bits) > self.num_free_pages(bits=bits):
                return None
            return self._own(self._place(len(page_bits), bits))
        spare = len(self._empty) + len(self._unowned[4]) + len(self._unowned[2])
        need4 = self._slabs_needed(n4, 4)
        if need4 + self._slabs_needed(n2, 2) > spare:
            return None
        int2 = self._place(n2, 2, slabs=spare - need4)
        int4 = self._place(n4, 4)
        self._own(int2 + int4)
        by_bits = {2: iter(int2), 4: iter(int4)}
        return [next(by_bits[b]) for b in page_bits]

    def _slabs_needed(self, n: int, bits: int) -> int:
        """Slabs with no owned page that ``n`` pages of ``bits`` need beyond ``O_b`` (docstring)."""
        per = self._per[bits]
        in_owned = self._num_free_slots[bits] + len(self._r[bits].lru) - per * len(self._unowned[bits])
        return -(-max(0, n - in_owned) // per)

    def _place(self, n: int, bits: int, *, slabs: int | None = None) -> list[int]:
        """``n`` slots of ``bits`` (the caller checked they exist), chosen in placement order and returned
        in ascending id order, at most ``slabs`` of them (None: any) in slabs that held no owned page."""
        low = bits == 4  # INT4 takes the lowest slab, INT2 the highest
        other = 6 - bits
        owned_open, spare_open = self._open[bits, True], self._open[bits, False]
        lru = self._r[bits].lru
        convertible: list[tuple[float, int]] | None = None  # (newest, +-slab) of the other precision's
        ids: list[int] = []
        while len(ids) < n:
            if owned_open:  # 1. a free slot in a slab that holds an owned page
                ids.append(self._take_slot(owned_open[0] if low else owned_open[-1], bits))
                continue
            if slabs == 0:  # no slab left to bind: evict in slabs that hold an owned page
                ids.append(self._evict_in_owned_slab(bits))
                continue
            binds = True  # whether this step binds a slab that holds no owned page
            if spare_open:  # 1. a free slot in a slab of ``bits`` with no owned page
                ids.append(self._take_slot(spare_open[0] if low else spare_open[-1], bits))
            elif self._empty:  # 2. a free slab
                ids.append(self._take_slab(self._empty[0] if low else self._empty[-1], bits))
            else:  # 3. by age: own LRU page, or the other precision's stalest slab with no owned page
                if convertible is None:  # ages do not change inside one call: one scan
                    convertible = [(self._newest[k], k if low else -k) for k in self._unowned[other]]
                    heapq.heapify(convertible)
                while convertible and abs(convertible[0][1]) not in self._unowned[other]:
                    heapq.heappop(convertible)  # converted earlier in this call
                head = next(iter(lru), None)
                if convertible and (head is None or convertible[0][0] < self._pages[head].last_used):
                    ids.append(self._convert(abs(heapq.heappop(convertible)[1]), bits))
                else:
                    assert head is not None, "the caller checked the pages fit"
                    k = self.slabs.locate(head)[0]
                    binds = self._slab_owned[k] == 0
                    self._evict(head)
                    self._hold(k, bits)
                    ids.append(head)
            if binds and slabs is not None:
                slabs -= 1
        return sorted(ids)

    def _take_slot(self, k: int, bits: int) -> int:
        """The lowest free slot of slab ``k`` (of ``bits``), owned from now."""
        mask = self._free_slots[k]
        slot = (mask & -mask).bit_length() - 1
        self._free_slots[k] = mask & (mask - 1)
        self._num_free_slots[bits] -= 1
        self._slab_live[k] += 1
        self._hold(k, bits)
        return self.slabs.page_id(k, slot, bits=bits)

    def _take_slab(self, k: int, bits: int) -> int:
        """Slab ``k`` (holding no live page) becomes one of ``bits``; its first slot, owned."""
        self._kind[k] = bits
        self._free_slots[k] = (1 << self._per[bits]) - 1
        self._num_free_slots[bits] += self._per[bits]
        return self._take_slot(k, bits)

    def _convert(self, k: int, bits: int) -> int:
        """Evict every (cached) page of slab ``k``, which holds no owned page, and take it for ``bits``."""
        kind = self._kind[k]
        for pid in self.slabs.page_ids(k, bits=kind):
            if pid in self._pages:
                self._evict(pid)
        self._num_free_slots[kind] -= self._free_slots[k].bit_count()
        self._slab_live[k] = 0
        return self._take_slab(k, bits)

    def _evict_in_owned_slab(self, bits: int) -> int:
        """Evict the least recently used cached page of ``bits`` in a slab that holds an owned page."""
        pid = next(pid for pid in self._r[bits].lru if self._slab_owned[self.slabs.locate(pid)[0]])
        self._evict(pid)
        self._hold(self.slabs.locate(pid)[0], bits)
        return pid


def _sorted_set(items: list[int], k: int, add: bool) -> None:
    """Insert ``k`` into, or remove it from, the sorted list ``items``."""
    if add:
        insort(items, k)
    else:
        del items[bisect_left(items, k)]


def _check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    return bits

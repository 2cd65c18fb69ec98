"""The KV page pool: page ids, ref counts, free list, prefix hashes, LRU eviction
and pins -- the pure-Python bottom layer of the KV cache (STYLE.md item 6:
no torch, no bytes; the storage layer maps page ids to bytes).

A page is in one of three states::

                 allocate                     free (last ref), no hash
      free ───────────────────> owned ──────────────────────────────────> free
       ^                      (ref >= 1) <─┐
       │                           │       │ match_prefix / incref / pin
       │ allocate evicts           │ free (last ref), hashed
       │ (LRU first)               v       │
       └──────────────────────  cached ────┘
                            (ref 0, hashed: evictable)

Policies, exact so tests can assert them (the triaxial pool shares all but
the placement through ``PagePoolBase``; it places pages in slabs of its buffer,
see ``worker/triaxial_pool.py``):

- **Placement: sequences in long runs** (plain pool). A KV READ costs ~7 us
  per contiguous region on GPUs (DESIGN.md "Worker"), and page ids are
  consecutive in memory per layer, so a sequence's pages should be
  consecutive ids. Free pages are kept as maximal runs; ``allocate_next(bits,
  after=t, expect=e)`` (``after``: the sequence's last page, ``expect``: the
  pages it will need for the tokens known so far; ``allocate(bits)`` is
  ``after=None, expect=0``) takes, in order:

  1. **extend in place**: the free run starting at ``t + 1``, from its start;
  2. **best fit**: the smallest free run holding ``max(left, expect left)``
     pages (lowest id on ties) whose page before it is not a *growing tail*,
     from its start;
  3. **else the longest run** (lowest id on ties), from its start, or, when
     a growing tail ends right before it, from its middle (the first half
     stays for that sequence to extend into) or as far forward as needed for
     the pages left to fit; repeat until served.

  A *growing tail* is the last page of an allocation, until a later
  allocation names it in ``after`` or its ref count drops to 0. Concurrent
  sequences thus grow in separate runs instead of interleaving page by page.
- **allocate** is all-or-nothing (None, changing nothing, unless free plus
  cached pages cover it) and evicts cached pages strictly least recently
  used first (their slots join the free runs), then places as above:

  - when free pages are short, as many as that takes;
  - **evicting ahead**: when no free run holds the ``n`` pages asked,
    ``max(n, expect)`` pages (or what being short takes, if more). A
    pool at steady state is full of cached pages, so evicting one chunk's
    worth at a time would place a prefill one chunk per run (behind each
    other's tails in LRU order), and free single pages ("dust": partial
    last pages freed unhashed) would scatter it further. The pages evicted
    early are the ones the sequence's next chunks would evict anyway, in
    the same order; the dust stays free for single-page requests (best fit).

  Capacity (what fits before None) is unchanged; the price is a prefix cache
  smaller by the dust (measured: 22-82 of 1024 pages free under churn,
  0.4-1.7% more evictions; tests/worker/test_page_runs.py). Evicting a page
  removes its hash from the map.
- **LRU order.** A page's clock starts when its last ref goes (``free``) and it
  leaves the LRU when it is matched or ref'd again. ``free(ids)`` treats ``ids``
  as one sequence's page list in order and queues them for eviction *last page
  first*: a chained hash is useless once its prefix is gone, so the tail of a
  conversation should go before its head.
- **register** keeps the first page registered under a hash: a second page with
  the same content (two sequences computed the same prefix at once) stays
  unhashed and returns to the free list when freed.
- **Pins** take one ref per page, so a pinned page is never evicted; a pin
  is valid while ``clock() < expires_at``. ``expire_pins`` releases the rest
  (earliest expiry first) and the engine calls it every step. The pool's pin
  table is the only one: a pin's ``record`` is what the layer that made it
  keeps with it (``kv/leases.py``: a lease, a hold, an admission pin); the
  pool never reads it.
- **Reclaimable pins yield to live requests.** A pin made with
  ``reclaim=RECLAIM_FIRST`` (a decode worker's retained conversation) or
  ``RECLAIM_LAST`` (pulled pages waiting for their request's admission) may
  yield before it expires: when an allocation fails, ``allocate_reclaiming``
  (the KV manager's, before it gives up or preempts) takes the reclaimable
  pin of the lowest class, earliest expiry first (the least recently active
  conversation), and retries, until the pages fit or no pin is left. A
  ``RECLAIM_FIRST`` pin is released whole (``reclaim_one``); a ``RECLAIM_LAST``
  pin gives up only the pages the allocation still lacks, from its tail
  (``trim_pin``; one page at a time where a page's room is not one page:
  the triaxial pool), and is released once trimmed to nothing: its request
  still matches the pinned prefix, and the pages a chained hash needs last
  are the ones it loses. Retained KV and pulled pages are bets on a next
  step; they must never starve the requests that can run now (else a pool
  full of them admits nothing until they expire). Pulled pages yield to the
  growth of running sequences, never to a pull (``up_to``), and to an
  admission only when nothing runs and no other waiting request fits
  without them (``Scheduler._overtake``): a waiting request's pulled pages
  taken for another request make it compute them again, and running
  sequences free pages as they end. Released and trimmed pages stay in the
  prefix cache (their hashes are kept; trimmed ones are queued tail first,
  as ``free`` does), so a request whose pin went may still match them; a
  peer reading a released lease finds it gone and recomputes.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvserving.kernels.page_ids import page_id_bits
from kvserving.worker.kv.page_runs import FreeRuns, Region

# Which pins ``reclaim_one`` may release before they expire, lowest class first.
RECLAIM_NEVER = 0  # transfer holds a peer is about to READ, tests' pins
RECLAIM_FIRST = 1  # retained conversations (a bet on a next turn)
RECLAIM_LAST = 2  # pulled pages pinned until their request is admitted
RECLAIM_CLASSES = (RECLAIM_NEVER, RECLAIM_FIRST, RECLAIM_LAST)
_PIN_HOLDER = {RECLAIM_NEVER: "pins_never", RECLAIM_FIRST: "pins_retained", RECLAIM_LAST: "pins_pulled"}
HELD_BY = ("requests", *_PIN_HOLDER.values())  # ``page_holders``' keys

# A decode worker's pull that finds no free pages waits for them this share of ``transfer_timeout_s`` (the
# READ keeps the rest: milliseconds at GPU rates), asking again every PAGE_WAIT_POLL_S; a prefill worker's
# does not wait (``KVTransfer``). Here, not in the puller, so that the simulator reads them without torch.
PAGE_WAIT_SHARE = 0.5
PAGE_WAIT_POLL_S = 0.02

HASH_BITS = 63  # hashes fit a signed int64 (tensors, JSON readers) without a sign bit
_HASH_MASK = (1 << HASH_BITS) - 1
_HASH_PERSON = b"kvserving.page1"  # blake2b personalisation: version of the hash recipe


@dataclass(slots=True)
class Page:
    """Bookkeeping of one live (owned or cached) page. Free pages have none."""

    page_id: int
    ref_count: int = 1
    hash: int | None = None
    last_used: float = 0.0
    pins: list[str] = field(default_factory=list)  # pins holding it (each holds one ref), in pin order


@dataclass(slots=True)
class Pin:
    """Refs on pages until ``expires_at``. ``record``: what the pin's maker keeps with it
    (the pool never reads it), so a layer above needs no table of its own."""

    pin_id: str
    page_ids: tuple[int, ...]
    expires_at: float
    reclaim: int = 0  # RECLAIM_*: may be released before expiry when pages run out (and in which order)
    record: object = None
    created_at: float = 0.0  # on the pool's clock


def chain_hashes(
    token_ids: Sequence[int],
    page_size: int,
    tags: Sequence[int] | None = None,
    *,
    parent: int | None = None,
    salt: bytes | None = None,
) -> list[int]:
    """One hash per FULL page of ``token_ids``, each chained on the previous one.

    Page k's hash covers the previous hash (``parent`` for page 0), the page
    size, its token ids and, when given, their tags -- so equal hashes mean an
    equal prefix up to and including that page. blake2b over little-endian
    bytes: the same on every process and machine (Python's ``hash()`` is salted
    per process). Values are in ``[0, 2**63)``. A partial last page gets none.

    ``salt`` (the request's ``cache_salt``: its tenant) goes into the first
    page's hash, so every page of the chain carries it and pages never match
    across salts (vLLM mixes ``cache_salt`` into the first block the same
    way); it is ignored under a ``parent``, which carries it already. No salt
    leaves the hashes as they were: the default tenant's pages match across
    versions.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if tags is not None and len(tags) != len(token_ids):
        raise ValueError(f"tags must have one entry per token: {len(tags)} tags for {len(token_ids)} tokens")
    if parent is not None and not 0 <= parent <= _HASH_MASK:
        raise ValueError(f"parent must be a page hash in [0, 2**{HASH_BITS}), got {parent}")
    hashes: list[int] = []
    prev = parent
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.blake2b(digest_size=8, person=_HASH_PERSON)
        if prev is not None:
            h.update(b"\x01" + prev.to_bytes(8, "little"))
        elif salt:
            h.update(b"\x02" + len(salt).to_bytes(4, "little") + salt)
        else:
            h.update(b"\x00")
        try:
            h.update(struct.pack(f"<I{page_size}q", page_size, *token_ids[start : start + page_size]))
            if tags is not None:
                h.update(b"T" + bytes(tags[start : start + page_size]))  # tags are 0..55: one byte each
        except (struct.error, ValueError, TypeError) as exc:
            raise ValueError(f"bad token ids or tags in page {start // page_size}: {exc}") from exc
        prev = int.from_bytes(h.digest(), "little") & _HASH_MASK
        hashes.append(prev)
    return hashes


class PagePoolBase:
    """Ref counts, prefix hashes, LRU and pins over one or more ``Region``s.

    Subclasses own the regions and allocation; every other operation is here.
    ``precisions`` says which page precisions (bits) a pool stores: callers ask
    ``allocate`` for the precisions they want and never look at the pool's type."""

    precisions: tuple[int, ...] = (4,)

    def __init__(self, *, page_size: int, clock: Callable[[], float]) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._clock = clock
        self._pages: dict[int, Page] = {}  # live pages (owned or cached) by id
        self._by_hash: dict[int, int] = {}  # page hash -> page id
        self._pins: dict[str, Pin] = {}
        self._regions: tuple[Region, ...] = ()
        self.evicted_pages = 0  # cached pages forgotten to make room, ever (a counter)
        self.reclaimed_pins = 0  # reclaimable pins released early to make room, trimmed to nothing included (a counter)
        self.trimmed_pages = 0  # pages RECLAIM_LAST pins gave up from their tails to make room (a counter)
        # called with each pin as it goes (released, reclaimed or expired) and the clock then: for the
        # layer that made it (the pool never reads a pin's record)
        self.on_release: Callable[[Pin, float], None] | None = None

    chain_hashes = staticmethod(chain_hashes)

    # -- subclass hooks ---------------------------------------------------------------------
    def _region_of(self, page_id: int) -> Region:
        raise NotImplementedError

    def _check_id(self, page_id: int) -> None:
        """Raise ValueError unless ``page_id`` names a slot of this pool."""
        raise NotImplementedError

    def allocate(self, page_bits: Sequence[int]) -> list[int] | None:
        """One page per entry of ``page_bits`` (its precision), in that order, ref 1 each;
        all or nothing: None, changing nothing, when they do not all fit."""
        raise NotImplementedError

    def allocate_next(self, page_bits: Sequence[int], *, after: int | None, expect: int = 0) -> list[int] | None:
        """``allocate`` for a sequence whose last page is ``after`` (None: it has none yet) and
        that expects ``expect`` more pages for the tokens known now: a pool that places pages in
        runs uses the hints (``PagePool``); this default ignores them."""
        return self.allocate(page_bits)

    # -- inspection -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out now (free + evictable cached; per subclass)."""
        raise NotImplementedError

    def num_free_pages(self, *, bits: int) -> int:
        """How many pages of precision ``bits`` ``allocate`` can give now."""
        raise NotImplementedError

    def capacity_tokens(self, frac_int2: float = 0.0) -> int:
        """Tokens the pool holds when ``frac_int2`` of its pages are INT2."""
        raise NotImplementedError

    @property
    def num_cached(self) -> int:
        """Pages with ref 0 kept for their hash (evictable)."""
        return sum(len(r.lru) for r in self._regions)

    @property
    def num_owned(self) -> int:
        return len(self._pages) - self.num_cached

    def page_holders(self, kind_of: Callable[[Pin], str] | None = None) -> dict[str, int]:
        """What keeps the referenced pages from being allocated, page by page (``HELD_BY``): ``requests``
        where a request's own ref is among its refs, else the least reclaimable of its pins: ``pins_never``
        (transfer holds, prefixes pinned while a pull runs), ``pins_retained`` (retained conversations),
        ``pins_pulled`` (pulled pages waiting for their request's admission); ``kind_of(pin)`` names a
        never-reclaimed pin's holder instead of ``pins_never`` (the pool never reads a pin's record; its
        caller can). Cached and free pages are not held. O(live pages): for diagnostics, not the hot path."""
        out = dict.fromkeys((n for n in HELD_BY if kind_of is None or n != "pins_never"), 0)
        for page in self._pages.values():
            if page.ref_count == 0:
                continue
            if page.ref_count > len(page.pins):
                out["requests"] += 1
                continue
            pin = min((self._pins[pin_id] for pin_id in page.pins), key=lambda p: p.reclaim)
            name = kind_of(pin) if kind_of is not None and pin.reclaim == RECLAIM_NEVER else _PIN_HOLDER[pin.reclaim]
            out[name] = out.get(name, 0) + 1
        return out

    def firm_refs(self, page_id: int, up_to: int) -> int:
        """Refs on ``page_id`` that no yield to an allocation with ``up_to`` (``allocate_reclaiming``)
        takes away: requests' refs and the pins of a class it may not release."""
        page = self._live(page_id)
        yielding = sum(1 for pin_id in page.pins if RECLAIM_NEVER < self._pins[pin_id].reclaim <= up_to)
        return page.ref_count - yielding

    def ref_count(self, page_id: int) -> int:
        self._check_id(page_id)
        page = self._pages.get(page_id)
        return 0 if page is None else page.ref_count

    def page(self, page_id: int) -> Page | None:
        """The live page's record (read it, don't change it); None when the page is free."""
        self._check_id(page_id)
        return self._pages.get(page_id)

    def live_page_ids(self) -> list[int]:
        """Every owned or cached page id (in no particular order)."""
        return list(self._pages)

    def cached_page_ids(self) -> list[int]:
        """Evictable pages, least recently used first (per region, in region order)."""
        return [pid for r in self._regions for pid in r.lru]

    # -- refs -------------------------------------------------------------------------------
    def _live(self, page_id: int) -> Page:
        self._check_id(page_id)
        page = self._pages.get(page_id)
        if page is None:
            raise ValueError(f"page {page_id} is free")
        return page

    def incref(self, page_ids: Iterable[int]) -> None:
        """Take one more ref on each page (a cached page leaves the LRU). All or nothing."""
        pages = [self._live(pid) for pid in page_ids]
        now = self._clock()
        for page in pages:
            if page.ref_count == 0:
                self._region_of(page.page_id).lru.pop(page.page_id)
            page.ref_count += 1
            page.last_used = now

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one ref per listed page. At ref 0 a hashed page is cached, any other one is free.

        Raises ValueError (and changes nothing) if a page would go below ref 0."""
        for pid, count in Counter(page_ids).items():
            page = self._live(pid)
            if page.ref_count < count:
                raise ValueError(f"double free of page {pid}: ref count {page.ref_count}, freed {count} time(s)")
        now = self._clock()
        for pid in reversed(page_ids):  # tail first into the LRU: see the module docstring
            page = self._pages[pid]
            page.ref_count -= 1
            if page.ref_count:
                continue
            page.last_used = now
            region = self._region_of(pid)
            if page.hash is None:
                del self._pages[pid]
                region.put_free(pid & ~region.flag)
            else:
                region.lru[pid] = None

    def _own(self, page_ids: list[int]) -> list[int]:
        now = self._clock()
        for pid in page_ids:
            self._pages[pid] = Page(pid, ref_count=1, last_used=now)
        return page_ids

    def _evict(self, page_id: int) -> None:
        """Forget a cached page; its slot is the caller's to reuse or give back."""
        page = self._pages.pop(page_id)
        self._region_of(page_id).lru.pop(page_id)
        assert page.hash is not None and page.ref_count == 0
        del self._by_hash[page.hash]
        self.evicted_pages += 1

    # -- prefix cache -----------------------------------------------------------------------
    def register(self, page_id: int, page_hash: int) -> None:
        """Cache a full, owned page under its chained hash (see ``chain_hashes``).

        If another page already holds ``page_hash`` that one stays the cached copy
        and this page stays unhashed. Re-registering the same hash is a no-op."""
        page = self._live(page_id)
        if page.ref_count == 0:
            raise ValueError(f"page {page_id} is not owned (ref 0); register pages you hold")
        if page.hash == page_hash:
            return
        if page.hash is not None:
            raise ValueError(f"page {page_id} is already registered under hash {page.hash}, not {page_hash}")
        if page_hash in self._by_hash:
            return
        page.hash = page_hash
        self._by_hash[page_hash] = page_id

    def lookup(self, page_hash: int) -> int | None:
        """The page cached under ``page_hash``, without taking a ref."""
        return self._by_hash.get(page_hash)

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Pages of the longest run of leading ``hashes`` present; the caller owns one ref on each."""
        matched: list[int] = []
        for h in hashes:
            pid = self._by_hash.get(h)
            if pid is None:
                break
            matched.append(pid)
        self.incref(matched)
        return matched

    # -- pins -----------------------------------------------------------------------------
    def _pin(self, pin_id: str) -> Pin:
        pin = self._pins.get(pin_id)
        if pin is None:
            raise ValueError(f"unknown pin {pin_id!r}")
        return pin

    def pin(
        self,
        pin_id: str,
        page_ids: Sequence[int],
        *,
        ttl_s: float,
        reclaim: int = RECLAIM_NEVER,
        record: object = None,
    ) -> float:
        """Pin ``page_ids`` under a new pin (one ref each) until ``ttl_s`` from now; returns expires_at.
        ``reclaim`` (``RECLAIM_*``): whether and when ``reclaim_one`` may release it early;
        ``record``: kept with the pin for its maker (``Pin.record``)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if reclaim not in RECLAIM_CLASSES:
            raise ValueError(f"reclaim must be one of {RECLAIM_CLASSES}, got {reclaim!r}")
        if pin_id in self._pins:
            raise ValueError(f"pin {pin_id!r} already exists; renew it instead")
        self.incref(page_ids)
        now = self._clock()
        expires_at = now + ttl_s
        self._pins[pin_id] = Pin(pin_id, tuple(page_ids), expires_at, reclaim, record, now)
        for pid in page_ids:
            self._pages[pid].pins.append(pin_id)
        return expires_at

    def renew(self, pin_id: str, *, ttl_s: float) -> float:
        """Move a live pin's expiry to ``ttl_s`` from now; an expired one cannot come back."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        pin = self._pin(pin_id)
        now = self._clock()
        if pin.expires_at <= now:
            raise ValueError(f"pin {pin_id!r} expired at {pin.expires_at}")
        pin.expires_at = now + ttl_s
        return pin.expires_at

    def release(self, pin_id: str) -> None:
        """Drop a pin's refs (its pages become cached or free unless others hold them)."""
        pin = self._pin(pin_id)
        del self._pins[pin_id]
        for pid in pin.page_ids:
            self._pages[pid].pins.remove(pin_id)
        self.free(pin.page_ids)
        if self.on_release is not None:
            self.on_release(pin, self._clock())

    def expire_pins(self) -> list[str]:
        """Release every pin with ``expires_at <= clock()``; their ids, earliest expiry first."""
        now = self._clock()
        expired = sorted((pin for pin in self._pins.values() if pin.expires_at <= now), key=lambda pin: pin.expires_at)
        for pin in expired:
            self.release(pin.pin_id)
        return [pin.pin_id for pin in expired]

    def allocate_reclaiming(self, page_bits: Sequence[int], *, up_to: int, after: int | None = None, expect: int = 0) -> list[int] | None:
        """``allocate_next``; when the pages do not fit, reclaimable pins of a class up to ``up_to``
        yield (``_yield_one``) until they do, none when all of them together would not make room
        (``could_fit_after_reclaim``)."""
        got = self.allocate_next(page_bits, after=after, expect=expect)
        if got is None and self.could_fit_after_reclaim(page_bits, up_to):
            while got is None and self._yield_one(page_bits, up_to):
                got = self.allocate_next(page_bits, after=after, expect=expect)
        return got

    def _yield_one(self, page_bits: Sequence[int], up_to: int) -> bool:
        """One yield for ``allocate(page_bits)``: the next pin ``reclaim_one(up_to)`` would take goes whole,
        or, of class ``RECLAIM_LAST``, gives up the last pages the allocation lacks (``_pages_short``) and
        goes only once none is left (module docstring). False when no pin may yield."""
        pin = self._next_to_reclaim(up_to)
        if pin is None:
            return False
        if pin.reclaim == RECLAIM_LAST:
            k = min(self._pages_short(page_bits), len(pin.page_ids))
            self.trimmed_pages += k
            if k < len(pin.page_ids):
                self.trim_pin(pin.pin_id, k)
                return True
        self._reclaim(pin)
        return True

    def _pages_short(self, page_bits: Sequence[int]) -> int:
        """Pages a pin gives up per yield to ``allocate(page_bits)``: one (a pool whose pages take
        different room); ``PagePool`` counts what the allocation lacks."""
        return 1

    def trim_pin(self, pin_id: str, k: int) -> None:
        """Drop pin ``pin_id``'s refs on its last ``k`` pages (tail first into the LRU, as ``free``);
        ``k`` at least its length releases it (``release``)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        pin = self._pin(pin_id)
        if k >= len(pin.page_ids):
            self.release(pin_id)
            return
        tail = pin.page_ids[-k:]
        pin.page_ids = pin.page_ids[:-k]
        for pid in tail:
            self._pages[pid].pins.remove(pin_id)
        self.free(tail)

    def _reclaimable(self, up_to: int) -> list[Pin]:
        """The pins ``reclaim_one(up_to)`` may release."""
        return [pin for pin in self._pins.values() if pin.reclaim != RECLAIM_NEVER and pin.reclaim <= up_to]

    def could_fit_after_reclaim(self, page_bits: Sequence[int], up_to: int = RECLAIM_LAST) -> bool:
        """Whether ``allocate(page_bits)`` could succeed once every reclaimable pin of a class up to
        ``up_to`` yielded: the room the pages still referenced then leave holds them (a necessary
        condition, exact for ``PagePool``). False means reclaiming would release pins for nothing."""
        yielding = Counter(pid for pin in self._reclaimable(up_to) for pid in pin.page_ids)
        freed = sum(self._room_of(page_id_bits(pid)) for pid, n in yielding.items() if self._pages[pid].ref_count == n)
        return self._room_referenced() - freed + sum(self._room_of(b) for b in page_bits) <= self._room_total()

    def _room_of(self, bits: int) -> int:
        """Room one page of ``bits`` takes (in ``_room_total``'s units)."""
        raise NotImplementedError

    def _room_referenced(self) -> int:
        """Room the pages with a ref (owned or pinned) take now."""
        raise NotImplementedError

    def _room_total(self) -> int:
        raise NotImplementedError

    def _next_to_reclaim(self, up_to: int) -> Pin | None:
        """The reclaimable pin of the lowest ``reclaim`` class (at most ``up_to``), earliest expiry first."""
        candidates = self._reclaimable(up_to)
        return min(candidates, key=lambda pin: (pin.reclaim, pin.expires_at)) if candidates else None

    def reclaim_one(self, up_to: int = RECLAIM_LAST) -> str | None:
        """Release the reclaimable pin of the lowest ``reclaim`` class (at most ``up_to``), earliest
        expiry first, whole; its id, or None if there is none."""
        pin = self._next_to_reclaim(up_to)
        if pin is None:
            return None
        self._reclaim(pin)
        return pin.pin_id

    def _reclaim(self, pin: Pin) -> None:
        """Release ``pin`` before its expiry to make room, counted."""
        self.release(pin.pin_id)
        self.reclaimed_pins += 1

    def get_pin(self, pin_id: str) -> Pin | None:
        """The live pin (read it, don't change it); None when there is none of that id."""
        return self._pins.get(pin_id)

    def pins(self) -> list[Pin]:
        """Every live pin, in the order they were made (read them, don't change them)."""
        return list(self._pins.values())

    def pin_pages(self, pin_id: str) -> list[int]:
        return list(self._pin(pin_id).page_ids)

    def pin_expires_at(self, pin_id: str) -> float:
        return self._pin(pin_id).expires_at

    def pin_ids(self) -> list[str]:
        return list(self._pins)


class PagePool(PagePoolBase):
    """``num_pages`` pages of ``page_size`` tokens, ids ``0..num_pages-1``, placed in runs
    (module docstring). Pure Python."""

    def __init__(self, num_pages: int, *, page_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(page_size=page_size, clock=clock)
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._region = FreeRuns(num_pages)
        self._regions = (self._region,)
        self._tails: set[int] = set()  # growing tails: see the placement policy

    def _region_of(self, page_id: int) -> Region:
        return self._region

    def _check_id(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"page id must be in 0..{self.num_pages - 1}, got {page_id}")

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out now: free ones plus evictable cached ones."""
        return self._region.num_free + len(self._region.lru)

    def num_free_pages(self, *, bits: int) -> int:
        _check_plain_bits([bits])
        return self.num_free

    def _room_of(self, bits: int) -> int:
        return 1  # pages

    def _room_referenced(self) -> int:
        return self.num_pages - self.num_free

    def _pages_short(self, page_bits: Sequence[int]) -> int:
        """What ``allocate(page_bits)`` lacks: it fits once free plus cached pages cover it."""
        return max(1, len(page_bits) - self.num_free)

    def _room_total(self) -> int:
        return self.num_pages

    def free_runs(self) -> list[tuple[int, int]]:
        """Free (never cached) pages as runs ``(start, length)``, by start."""
        return self._region.runs()

    def growing_tails(self) -> list[int]:
        return sorted(self._tails)

    def capacity_tokens(self, frac_int2: float = 0.0) -> int:
        """Tokens of the whole pool (it has no INT2 pages: ``frac_int2`` must be 0)."""
        if frac_int2 != 0.0:
            raise ValueError(f"frac_int2 must be 0 for a pool without INT2 pages, got {frac_int2}")
        return self.num_pages * self.page_size

    def allocate(self, page_bits: Sequence[int]) -> list[int] | None:
        """One page per entry of ``page_bits`` (each must be 4: this pool has one precision),
        ref 1 each, placed as a new sequence's (best fit, see the module docstring); None if
        even evicting every cached page would not give them all (nothing changes then)."""
        return self.allocate_next(page_bits, after=None, expect=0)

    def allocate_next(self, page_bits: Sequence[int], *, after: int | None, expect: int = 0) -> list[int] | None:
        """``allocate`` for a sequence whose last page is ``after`` and that expects ``expect``
        more pages: extend in place, else best fit for ``max(len, expect)``, else the longest
        runs (module docstring)."""
        _check_plain_bits(page_bits)
        if after is not None:
            self._check_id(after)
        n = len(page_bits)
        if n > self.num_free:
            return None
        runs = self._region
        # evict (LRU first; the slots join the free runs) as many pages as are short, or when no
        # run holds the n pages, as many as the sequence expects: "evicting ahead" (docstring)
        goal = max(n, expect)
        short = max(n - runs.num_free, goal if runs.longest < n else 0)
        if short > 0 and runs.lru:
            lru = iter(runs.lru)
            evicted = [next(lru) for _ in range(min(short, len(runs.lru)))]
            for pid in evicted:
                self._evict(pid)
            runs.put_free_many(evicted)
        ids: list[int] = []
        if after is not None:
            self._tails.discard(after)
            if n and (length := runs.run_at(after + 1)):
                ids += runs.take(after + 1, min(n, length), after + 1)
        while len(ids) < n:
            start, k, run_start = runs.place(n - len(ids), max(n, expect) - len(ids), self._tails)
            ids += runs.take(start, k, run_start)
        if ids:
            self._tails.add(ids[-1])
        return self._own(ids)

    def free(self, page_ids: Sequence[int]) -> None:
        super().free(page_ids)
        for pid in page_ids:
            if pid in self._tails and self.ref_count(pid) == 0:
                self._tails.discard(pid)


def _check_plain_bits(page_bits: Sequence[int]) -> None:
    bad = sorted({b for b in page_bits if b != 4})
    if bad:
        raise ValueError(f"page bits must be 4 in a pool without INT2 pages, got {bad}")

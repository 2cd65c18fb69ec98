"""One simulated worker's KV pool and prefix cache, kept as page *runs* per chain
instead of pages (``kvserving simulate``; the policies of ``worker/kv/page_pool.py``).

A *chain* is a token stream whose pages hash in a chain: one conversation's
history, or a system prompt every agent shares. Because the real pool's prefix
match walks pages from the first and stops at the first miss, and ``free``
queues a sequence's pages for eviction *last page first*, what a worker holds of
a chain is always a prefix of it: pages ``[0, present)``. Of those,
``[0, owned)`` have refs (a running request, a lease pin) and ``[owned,
present)`` are cached: ref 0, evictable, in the LRU as one run. So the pool is::

    chains:  key -> (present, holders counted by extent)     owned = the largest extent
    lru:     keys of chains with cached pages, least recently used first
    used:    chain pages + loose pages (owned, unhashed: partial last pages,
             duplicate or garbage pages a holder frees when it lets go)

and every operation costs O(chains it touches), not O(pages).

Policies (as in the real pool, tested by name in tests/test_simulate.py):

- **allocate** is all or nothing: free pages first, then evict cached pages from
  the least recently used chain, its last page first (a chain's tail is useless
  once its head is gone); never an owned page.
- **LRU order.** A chain's cached run moves to the LRU's end when a holder lets
  go of pages (they were just used); taking refs on a chain's pages takes them
  out of its run, which keeps its place.
- **publish** (register): pages a holder computed or pulled join the chain if
  they extend it; pages the chain already has stay loose (the first copy is the
  cached one) and are freed when the holder lets go.
- **Holds** (a request's pages, a lease pin) take refs on leading pages of one
  or more chains; a lease is a hold with an expiry the worker enforces. A hold
  may let go of its tail only (``trim``: an admission pin yielding to a
  running sequence).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

Key = Hashable
Segments = Sequence[tuple[Key, int]]  # a prompt's pages: (chain, pages of it), in order


@dataclass(slots=True)
class _Chain:
    """``extents`` counts holders by how many leading pages they hold; ``owned`` is the largest
    (a shared system prompt has thousands of holders but a few distinct extents)."""

    present: int = 0
    owned: int = 0
    extents: dict[int, int] = field(default_factory=dict)  # extent -> holders

    def add(self, extent: int) -> None:
        self.extents[extent] = self.extents.get(extent, 0) + 1
        if extent > self.owned:
            self.owned = extent

    def remove(self, extent: int) -> None:
        left = self.extents[extent] - 1
        if left:
            self.extents[extent] = left
            return
        del self.extents[extent]
        if extent == self.owned:
            self.owned = max(self.extents) if self.extents else 0


@dataclass(slots=True)
class Hold:
    """Refs one holder has: leading pages of some chains, and loose pages it owns."""

    hold_id: int
    extents: dict[Key, int] = field(default_factory=dict)
    loose: int = 0


class PageCache:
    """``capacity`` pages; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 page, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.cached = 0  # evictable pages (sum of cached runs)
        self.evicted = 0  # pages evicted so far
        self._chains: dict[Key, _Chain] = {}
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._next_hold = 0

    # ------------------------------------------------------------------ inspection
    @property
    def free(self) -> int:
        """Pages ``allocate`` can hand out now: free plus evictable."""
        return self.capacity - self.used + self.cached

    def present(self, key: Key) -> int:
        chain = self._chains.get(key)
        return 0 if chain is None else chain.present

    def owned(self, key: Key) -> int:
        chain = self._chains.get(key)
        return 0 if chain is None else chain.owned

    def lru_keys(self) -> list[Key]:
        return list(self._lru)

    def match(self, segments: Segments, limit: int) -> int:
        """Leading pages of ``segments`` (at most ``limit``) the cache holds: the prefix match."""
        total = 0
        chains = self._chains
        for key, n in segments:
            left = limit - total
            if n > left:
                n = left
            if n <= 0:
                break
            chain = chains.get(key)
            if chain is None:
                break
            have = chain.present
            if have < n:
                return total + have
            total += n
        return total

    # ------------------------------------------------------------------ holds
    def new_hold(self) -> Hold:
        self._next_hold += 1
        return Hold(self._next_hold)

    def _sync(self, key: Key, chain: _Chain, old_cached: int, *, touched: bool) -> None:
        cached = chain.present - chain.owned
        self.cached += cached - old_cached
        if cached <= 0:
            self._lru.pop(key, None)
            if chain.present == 0 and not chain.extents:
                del self._chains[key]
        elif touched or key not in self._lru:
            self._lru[key] = None
            self._lru.move_to_end(key)

    def ref(self, hold: Hold, segments: Segments, pages: int) -> None:
        """``hold`` takes refs on the first ``pages`` pages of ``segments`` (all present)."""
        chains, extents = self._chains, hold.extents
        for key, n in segments:
            if n > pages:
                n = pages
            if n <= 0:
                break
            pages -= n
            chain = chains[key]
            if n > chain.present:
                raise ValueError(f"chain {key!r} has {chain.present} pages, {n} referenced")
            have = extents.get(key, 0)
            if n > have:  # _hold and _sync inlined (the hottest cache path)
                old = chain.present - chain.owned
                if have:
                    chain.remove(have)
                held = chain.extents  # chain.add(n) inlined
                held[n] = held.get(n, 0) + 1
                if n > chain.owned:
                    chain.owned = n
                extents[key] = n
                cached = chain.present - chain.owned
                if cached != old or (cached > 0) != (key in self._lru):  # else _sync is a no-op
                    self._sync(key, chain, old, touched=False)
            else:
                cached = chain.present - chain.owned
                if (cached > 0) != (key in self._lru):
                    self._sync(key, chain, cached, touched=False)

    def allocate(self, hold: Hold, n: int) -> bool:
        """``n`` loose pages for ``hold`` (all or nothing), evicting LRU cached pages as needed."""
        if n <= 0:
            return True
        if n > self.free:
            return False
        need = n - (self.capacity - self.used)
        while need > 0:
            key = next(iter(self._lru))
            chain = self._chains[key]
            k = min(need, chain.present - chain.owned)
            old = chain.present - chain.owned
            chain.present -= k
            self.used -= k
            self.evicted += k
            need -= k
            self._sync(key, chain, old, touched=False)
        self.used += n
        hold.loose += n
        return True

    def could_fit_after_release(self, holds: Sequence[Hold], n: int) -> bool:
        """Whether ``allocate(n)`` could succeed once every hold in ``holds`` let go
        (``PagePoolBase.could_fit_after_reclaim``): their loose pages, and the chain pages no
        other holder keeps, would be free or cached."""
        if n <= self.free:
            return True
        freed = 0
        gone: dict[Key, dict[int, int]] = {}
        for hold in holds:
            freed += hold.loose
            for key, extent in hold.extents.items():
                counts = gone.setdefault(key, {})
                counts[extent] = counts.get(extent, 0) + 1
        for key, counts in gone.items():
            chain = self._chains.get(key)
            if chain is None:
                continue
            kept = [e for e, holders in chain.extents.items() if holders > counts.get(e, 0)]
            freed += chain.owned - (max(kept) if kept else 0)
        return n <= self.free + freed

    @staticmethod
    def holders(classes: Sequence[Sequence[Hold]]) -> list[int]:
        """Pages held, by the first class (in ``classes``' order) whose holds cover them: a page
        of a chain goes to the first class with a hold over it, a hold's loose pages to its own
        class (``PagePoolBase.page_holders``: requests before the pins, the least reclaimable pin
        first). For diagnostics: O(holds x chains they touch)."""
        counts = [0] * len(classes)
        reach: dict[Key, list[int]] = {}  # chain -> the longest extent of each class
        for c, holds in enumerate(classes):
            for hold in holds:
                counts[c] += hold.loose
                for key, extent in hold.extents.items():
                    row = reach.setdefault(key, [0] * len(classes))
                    row[c] = max(row[c], extent)
        for row in reach.values():
            covered = 0
            for c, extent in enumerate(row):
                if extent > covered:
                    counts[c] += extent - covered
                    covered = extent
        return counts

    def publish(self, hold: Hold, segments: Segments, start: int, end: int) -> None:
        """Pages ``[start, end)`` of ``segments``, which ``hold`` owns as loose pages, join their
        chains where they extend them (``hold`` keeps refs on the chain up to ``end``); the
        rest stay loose. ``hold`` must already hold the chain pages before ``start``."""
        pos = 0
        chains, extents = self._chains, hold.extents
        for key, n in segments:
            base = pos
            pos += n
            lo = start if start > base else base
            hi = end if end < pos else pos
            if lo >= hi:
                if pos >= end:
                    break
                continue
            chain = chains.get(key)
            if chain is None:
                chain = chains[key] = _Chain()
            a, b = lo - base, hi - base  # page indices inside this chain
            present = chain.present
            old = present - chain.owned
            if a <= present < b:
                hold.loose -= b - present
                chain.present = present = b
            if present >= b:  # _hold inlined
                have = extents.get(key, 0)
                if b > have:
                    if have:
                        chain.remove(have)
                    chain.add(b)
                    extents[key] = b
            cached = present - chain.owned
            if cached != old or not present or (cached > 0) != (key in self._lru):  # else _sync is a no-op
                self._sync(key, chain, old, touched=False)

    @staticmethod
    def _hold(chain: _Chain, hold: Hold, key: Key, n: int) -> None:
        """``hold`` now holds pages [0, n) of ``chain`` (never fewer than it did)."""
        have = hold.extents.get(key, 0)
        if n > have:
            if have:
                chain.remove(have)
            chain.add(n)
            hold.extents[key] = n

    def release(self, hold: Hold) -> None:
        """``hold`` lets go: its chain pages become cached (or stay owned by others), its loose
        pages free."""
        chains, lru = self._chains, self._lru
        delta = 0
        for key, extent in hold.extents.items():
            chain = chains.get(key)
            if chain is None:
                continue
            old = chain.present - chain.owned
            chain.remove(extent)
            cached = chain.present - chain.owned  # _sync(touched=True) inlined
            delta += cached - old
            if cached <= 0:
                lru.pop(key, None)
                if chain.present == 0 and not chain.extents:
                    del chains[key]
            else:
                lru[key] = None
                lru.move_to_end(key)
        self.cached += delta
        hold.extents.clear()
        self.used -= hold.loose
        hold.loose = 0

    @staticmethod
    def held(hold: Hold) -> int:
        """Pages ``hold`` has refs on: its chains' leading pages and its loose pages."""
        return sum(hold.extents.values()) + hold.loose

    def trim(self, hold: Hold, k: int) -> int:
        """``hold`` lets go of its last ``k`` pages (``PagePoolBase.trim_pin``): its last chain's
        (in the order it took them) from the end, then the chain before, and its loose pages
        last (duplicates of chain pages, with no place in the order here); chain pages become
        cached (or stay owned by others), the chain newest in the LRU. How many it let go."""
        chains, extents = self._chains, hold.extents
        left = k
        for key in reversed(list(extents)):
            if left <= 0:
                break
            extent = extents[key]
            n = min(left, extent)
            left -= n
            chain = chains[key]
            old = chain.present - chain.owned
            chain.remove(extent)
            if extent > n:
                chain.add(extent - n)
                extents[key] = extent - n
            else:
                del extents[key]
            self._sync(key, chain, old, touched=True)
        n = min(max(left, 0), hold.loose)
        hold.loose -= n
        self.used -= n
        return k - left + n

    def drop_tail(self, key: Key, keep: int) -> int:
        """Forget cached pages of ``key`` past ``keep`` (content no future prompt has: a stream
        that diverged there); returns how many went. Owned pages stay."""
        chain = self._chains.get(key)
        if chain is None or chain.present <= keep:
            return 0
        old = chain.present - chain.owned
        k = chain.present - max(keep, chain.owned)
        if k <= 0:
            return 0
        chain.present -= k
        self.used -= k
        self._sync(key, chain, old, touched=False)
        return k

"""The page-id regions under the KV page pool (``page_pool.PagePoolBase``): what the pool keeps per region of
page ids, and the plain pool's free slots as maximal runs of consecutive ids (``FreeRuns``: best fit and the
longest run by bisection, a freed page merged with its neighbours). Pure Python, no torch, as the pool above it;
the triaxial pool's per-precision regions (``triaxial_pool``) subclass ``Region`` too.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict


class Region:
    """What ``PagePoolBase`` keeps per region of page ids: the flag or'ed into an index to make
    a page id, the LRU of the region's cached pages, and ``put_free`` (an owned page's slot is
    free again). The plain pool's is ``FreeRuns``; the triaxial pool has one per precision."""

    __slots__ = ("flag", "lru")

    def __init__(self, flag: int) -> None:
        self.flag = flag  # or'ed into an index to make a page id
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached page ids, least recently used first

    def put_free(self, index: int) -> None:
        raise NotImplementedError


class FreeRuns(Region):
    """The plain pool's one region: every slot ``0..num_pages-1`` exists and the free ones are kept as maximal runs of consecutive ids::

        ids   0 1 2 3 4 5 6 7 8 9
              # # . . . # . . # #     # live, . free
        runs  start 2 len 3, start 6 len 2   (_len / _end by start / end, _by_len sorted)

    ``_by_len`` holds ``(length, start)`` sorted, so best fit and longest run are a bisect;
    freeing a page merges it with the runs either side (two dict look-ups)."""

    __slots__ = ("_len", "_end", "_by_len", "_num_free")

    def __init__(self, num_pages: int) -> None:
        super().__init__(flag=0)
        self._len: dict[int, int] = {}  # run start -> length
        self._end: dict[int, int] = {}  # run end (exclusive) -> start
        self._by_len: list[tuple[int, int]] = []  # (length, start), sorted
        self._num_free = 0
        self._add(0, num_pages)

    @property
    def num_free(self) -> int:
        return self._num_free

    def _add(self, start: int, n: int) -> None:
        self._len[start] = n
        self._end[start + n] = start
        insort(self._by_len, (n, start))
        self._num_free += n

    def _remove(self, start: int) -> int:
        n = self._len.pop(start)
        del self._end[start + n]
        del self._by_len[bisect_left(self._by_len, (n, start))]
        self._num_free -= n
        return n

    @property
    def longest(self) -> int:
        return self._by_len[-1][0] if self._by_len else 0

    def run_at(self, start: int) -> int:
        """Length of the free run starting at ``start`` (0 if none does)."""
        return self._len.get(start, 0)

    def runs(self) -> list[tuple[int, int]]:
        """Free runs as ``(start, length)``, by start."""
        return sorted(self._len.items())

    def put_free(self, index: int) -> None:
        self._free_span(index, index + 1)

    def _free_span(self, start: int, end: int) -> None:
        """Free ``start..end-1``, merged with the free runs that touch it on either side."""
        if (left := self._end.get(start)) is not None:
            self._remove(left)
            start = left
        if end in self._len:
            end += self._remove(end)
        self._add(start, end - start)

    def put_free_many(self, indices: list[int]) -> None:
        """``put_free`` each, one merge per group of consecutive indices."""
        indices.sort()
        i = 0
        while i < len(indices):
            j = i + 1
            while j < len(indices) and indices[j] == indices[j - 1] + 1:
                j += 1
            self._free_span(indices[i], indices[j - 1] + 1)
            i = j

    def take(self, start: int, k: int, run_start: int) -> list[int]:
        """Slots ``start..start+k-1`` out of the free run that starts at ``run_start``."""
        n = self._remove(run_start)
        assert run_start <= start and start + k <= run_start + n
        if start > run_start:
            self._add(run_start, start - run_start)
        if start + k < run_start + n:
            self._add(start + k, run_start + n - start - k)
        return list(range(start, start + k))

    def place(self, n: int, goal: int, tails: set[int]) -> tuple[int, int, int]:
        """Where the next ``n`` pages of a sequence that expects ``goal`` go: ``(start, count,
        run_start)``; steps 2 and 3 of the placement policy (``page_pool``'s docstring)."""
        by_len = self._by_len
        for i in range(bisect_left(by_len, (goal, -1)), len(by_len)):
            length, start = by_len[i]
            if start - 1 not in tails:  # best fit nobody is growing into
                return start, min(n, length), start
            # else skip it: at most one run per growing tail is skipped
        length, run_start = by_len[bisect_left(by_len, (by_len[-1][0], -1))]
        # a growing tail ends right before it: leave it the first half, less if that makes
        # the n pages fit in one piece
        start = run_start + (min(length // 2, length - min(n, length)) if run_start - 1 in tails else 0)
        return start, min(n, run_start + length - start), run_start

"""The bit-budget controller: holds a triaxial pool's stored bits at ``bit_budget``
on the traffic it serves, by moving the cut along a fixed class ranking
(docs/kv-cache.md, Holding the bit budget). Pure Python.

The ranking is the greedy gain-per-bit order of the calibrated or default table
(``kvserving.bits.greedy_order``); it never changes. The cut ``x`` (a real
number in [0, 56]) says which pages are INT4:

    rank:   0   1   2  ...  n-1 | n (boundary) | n+1 ... 55        n = floor(x)
            '-- classes at 4 --'   4 on a share  '-- at 2 bits --'
                                   x - n of its
                                   pages

A full prompt page is INT4 when the best-ranked class among its tokens ranks
below ``n``, or ranks ``n`` and the page is one of the share ``x - n`` its
position picks (``dither``: the page's index and first token, so every worker
gives the same tokens the same precision at the same cut); else INT2. Partial
pages and generated tokens are INT4, as with a table. An integer cut is exactly
the bits table with the first ``x`` ranked classes at 4 bits.

Two inputs set the cut:
- feed-forward: the class mix of the pages this worker stores (each full page
  reduced to its best rank, plus the pages that are INT4 anyway), over a
  window of ``WINDOW_PAGES`` recent pages: for any cut it gives the bits new
  pages would average;
- feedback: the stored average of the pages owned now (running requests and
  retained leases; aged-down, pulled and generated pages included), against what
  the mix predicts at the cut in force. New pages aim at ``budget + offset``; the
  offset follows the pool's gap from the mix (``predicted - held``, a moving
  average of ``FEEDBACK_WEIGHT`` per look, clamped to ``MAX_CORRECTION``): what the
  mix does not see (residency: a pool of conversations that start together holds
  their system prompts' pages longer than the traffic counts them; eviction;
  age-down that found no INT2 room). A gap, not a sum of the pool's error: after
  the cut moves the pool keeps pages of the old cut for a while; a sum of that
  transient would aim off the budget long after the pool turned over, the gap's
  average forgets it.

What was learnt on pages that left goes with them: when the pool owns fewer
pages at a look than at the one before (leases released, conversations done),
the mix's counts and the offset keep the share still owned. Otherwise a new set
of conversations is stored at a cut aimed off the budget by the pool that just
left (the P/D replay's warm start stored 2.59 bits at budget 2.7; 2.73 with it).

The first look comes as soon as the mix has counted ``WARM_PAGES`` pages (the
first request's), the next every ``UPDATE_PAGES``: the starting cut is the
reference pages', and the pages a conversation stores at its first turn stay at
that precision for as long as its lease keeps them (a page another holder keeps
is never aged), so a cut that waits to see the traffic stores its first
conversations at the reference traffic's bits.

One cut per deployment: the decode workers lead, the prefill workers follow. A
leader moves its cut as below; a follower (``leader = False``) stores at the cut
the last ``kv_transfer_params`` it pulled from carried (``adopt``), so the pages
a conversation's two workers store for the same tokens have the same precision
(docs/kv-cache.md, Where it lives). ``ranking_id`` names the ranking a carried
cut is a position on: a cut on another ranking means nothing here.

Hysteresis: the controller moves the cut only when the mix's prediction is more
than ``DEADBAND`` from its aim, and then only if the new cut differs by at least
``MIN_STEP``. Inside the band nothing moves, so steady traffic leaves the table
alone and reuse keeps matching the precisions it stored.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from kvserving.tags import NUM_TAGS

WINDOW_PAGES = 4096  # the class mix halves its counts past this many pages
UPDATE_PAGES = 32  # stored pages between two looks at the pool
WARM_PAGES = 8  # the first look: once the class mix has counted this many pages (a first request)
DEADBAND = 0.03  # bits: a prediction inside the aim +- this leaves the cut
MIN_STEP = 0.1  # classes: a smaller move of the cut is not made
MAX_CORRECTION = 0.5  # bits: new pages aim at most this far from the budget
FEEDBACK_WEIGHT = 0.1  # weight of the newest look in the offset: the pool's gap from the mix
_PHI = (math.sqrt(5.0) - 1.0) / 2.0
_MIX, _MOD = 2654435761, 1 << 32  # Knuth's multiplicative hash of a token id


def dither(page_index: int, first_token: int) -> float:
    """A value in [0, 1) per page, from its index in the sequence and its first token id:
    the boundary class's pages with a value below ``x - floor(x)`` are INT4. The golden-ratio
    step spreads one sequence's pages evenly; the token id decorrelates sequences whose
    boundary pages sit at the same indices (same template, same tool schemas)."""
    return ((page_index + 1) * _PHI + (first_token * _MIX % _MOD) / _MOD) % 1.0


def ranking_id(order: Sequence[int]) -> str:
    """Short hex digest of a ranking: a carried cut is honoured only on the same ranking."""
    return hashlib.sha256(",".join(str(int(k)) for k in order).encode()).hexdigest()[:16]


def rank_of(order: Sequence[int]) -> tuple[int, ...]:
    """Class -> position in ``order`` (a permutation of the 56 classes)."""
    if sorted(order) != list(range(NUM_TAGS)):
        raise ValueError(f"order must be a permutation of 0..{NUM_TAGS - 1}")
    rank = [0] * NUM_TAGS
    for i, k in enumerate(order):
        rank[k] = i
    return tuple(rank)


def page_ranks(tags: Sequence[int], rank: Sequence[int], page_size: int) -> list[int]:
    """Best (lowest) class rank of each FULL page of ``tags``; a trailing partial page is left out."""
    full = len(tags) - len(tags) % page_size
    return [min(rank[t] for t in tags[s : s + page_size]) for s in range(0, full, page_size)]


def class_bits_at_cut(rank: int, cut: float) -> int:
    """Precision of every full page whose best class rank is ``rank`` at cut ``cut``: 4 below the cut's class, 2 above
    it, 0 at it (that class's pages are dithered between the two, page by page)."""
    n = math.floor(cut)
    return 4 if rank < n else 2 if rank > n else 0


def bits_at_cut(best_rank: int, page_index: int, first_token: int, cut: float) -> int:
    """Precision of a full page whose best class rank is ``best_rank`` at cut ``cut``."""
    fixed = class_bits_at_cut(best_rank, cut)
    if fixed:
        return fixed
    return 4 if dither(page_index, first_token) < cut - math.floor(cut) else 2


def mix_bits(hist: Sequence[float], forced: float, cut: float, *, fixed2: float = 0.0) -> float | None:
    """Average nominal bits of pages whose best ranks are counted in ``hist`` (by rank),
    ``forced`` pages INT4 and ``fixed2`` pages INT2 whatever the cut, at cut ``cut`` (the
    boundary rank at its share); None if empty."""
    total = forced + fixed2 + sum(hist)
    if total <= 0:
        return None
    n = math.floor(cut)
    four = forced + sum(hist[:n]) + (hist[n] * (cut - n) if n < len(hist) else 0.0)
    return (4.0 * four + 2.0 * (total - four)) / total


def cut_for(hist: Sequence[float], forced: float, target: float, *, fixed2: float = 0.0) -> float:
    """The largest cut whose ``mix_bits`` stays <= ``target`` (mix_bits grows with the cut;
    linear within one rank). 0 when even cut 0 is above the target, 56 when all fit."""
    total = forced + fixed2 + sum(hist)
    if total <= 0:
        return 0.0
    room = (target - 2.0) * total / 2.0 - forced  # pages that may still be INT4
    if room < 0:
        return 0.0
    for n, h in enumerate(hist):
        if h > room:
            return n + room / h
        room -= h
    return float(len(hist))


class BitBudgetController:
    """The cut of one worker's pool (module docstring). ``order``: the ranking;
    ``cut``: where it starts (``cut_for`` on the table's reference pages)."""

    def __init__(self, budget: float, order: Sequence[int], *, cut: float, page_size: int) -> None:
        if not 2.0 <= budget <= 4.0:
            raise ValueError(f"bit_budget must be in [2, 4], got {budget}")
        if not 0.0 <= cut <= NUM_TAGS:
            raise ValueError(f"cut must be in [0, {NUM_TAGS}], got {cut}")
        self.budget = budget
        self.order = tuple(order)
        self.rank = rank_of(self.order)
        self.ranking = ranking_id(self.order)
        self.leader = True  # False: the cut is only ever set by ``adopt`` (a prefill worker)
        self.adopted = 0  # carried cuts taken, since start
        self.cut = cut
        self.page_size = page_size
        self.hist = [0.0] * NUM_TAGS  # recent full pages by best rank
        self.forced = 0.0  # recent pages INT4 whatever the cut (partial, generated)
        self.fixed2 = 0.0  # recent pages INT2 whatever the cut (reused as stored at 2 bits)
        self.offset = 0.0  # bits: the pool's gap from the mix, averaged over looks (FEEDBACK_WEIGHT)
        self.moves = 0  # times the cut moved, since start
        self.looks = 0  # looks at the pool (``update``), since start
        self._since = 0  # pages stored since the last look
        self._pages = 0  # owned pages at the last look

    # -- precision -------------------------------------------------------------------------
    def page_bits(self, tags: Sequence[int], token_ids: Sequence[int], first_page: int) -> list[int]:
        """Bits of the full pages of ``tags`` / ``token_ids`` (page ``first_page`` onward of a
        sequence) at the cut."""
        ranks = page_ranks(tags, self.rank, self.page_size)
        p = self.page_size
        return [bits_at_cut(r, first_page + i, token_ids[i * p], self.cut) for i, r in enumerate(ranks)]

    def table(self) -> tuple[int, ...]:
        """The bits table of the whole classes above the cut (the boundary class at 2)."""
        n = math.floor(self.cut)
        return tuple(4 if self.rank[k] < n else 2 for k in range(NUM_TAGS))

    # -- observation -----------------------------------------------------------------------
    def observe(self, full_page_tags: Sequence[int], *, forced: int, fixed2: int = 0) -> bool:
        """Count pages a request holds: the tags of the full pages whose precision follows the
        cut (computed now, or held at 4 bits and aged down if the cut says 2), how many are
        INT4 anyway (partial, generated) and how many it reuses as stored at 2 bits. True when
        it is time to ``update``."""
        for r in page_ranks(full_page_tags, self.rank, self.page_size):
            self.hist[r] += 1.0
        self.forced += forced
        self.fixed2 += fixed2
        self._since += len(full_page_tags) // self.page_size + forced + fixed2
        if self.window > WINDOW_PAGES:
            self.hist = [h / 2.0 for h in self.hist]
            self.forced /= 2.0
            self.fixed2 /= 2.0
        return self._since >= (UPDATE_PAGES if self.looks else WARM_PAGES)

    @property
    def window(self) -> float:
        """Pages the class mix counts now."""
        return self.forced + self.fixed2 + sum(self.hist)

    def predicted(self) -> float | None:
        """Bits the pages requests hold average at the current cut on the recent class mix."""
        return mix_bits(self.hist, self.forced, self.cut, fixed2=self.fixed2)

    def adopt(self, cut: float, ranking: str) -> None:
        """Take the deployment's cut as carried in ``kv_transfer_params`` (``bits_cut`` on
        ``bits_ranking``); ValueError for a cut out of range or on another ranking (the
        caller recomputes and counts it). A leader keeps its own cut."""
        if ranking != self.ranking:
            raise ValueError(f"bits_ranking {ranking!r} is not this worker's ranking {self.ranking!r}")
        if not (math.isfinite(cut) and 0.0 <= cut <= NUM_TAGS):
            raise ValueError(f"bits_cut must be in [0, {NUM_TAGS}], got {cut}")
        if self.leader:
            return
        if cut != self.cut:
            self.moves += 1
        self.cut = cut
        self.adopted += 1

    def update(self, held: float | None, *, pages: int | None = None) -> bool:
        """Look at the pool (``held``: its stored average over the ``pages`` it owns, None when it owns
        none; ``pages`` None: not counted, nothing forgotten); True if the cut moved. A follower never
        moves its own cut."""
        self._since = 0
        if not self.leader:
            return False
        if pages is not None:
            self._forget(pages)
        predicted = self.predicted()
        if predicted is None or self.window < WARM_PAGES:  # the starting cut stands until the mix is known
            return False
        self.looks += 1
        if held is not None:  # what the mix does not see: new pages aim off the budget by the pool's gap from it
            self.offset = _clamp(self.offset + FEEDBACK_WEIGHT * (predicted - held - self.offset), MAX_CORRECTION)
        target = min(4.0, max(2.0, self.budget + self.offset))
        if abs(predicted - target) <= DEADBAND:
            return False
        cut = cut_for(self.hist, self.forced, target, fixed2=self.fixed2)
        if abs(cut - self.cut) < MIN_STEP:
            return False
        self.cut = cut
        self.moves += 1
        return True

    def _forget(self, pages: int) -> None:
        """What was learnt on owned pages that left goes with them: when the pool owns fewer pages than
        at the last look (leases released, conversations done), the mix's counts and the offset keep
        the share ``pages / pages at the last look``. The mix's proportions stay; the pages counted
        from now on weigh more in it."""
        last, self._pages = self._pages, pages
        if pages >= last:
            return
        keep = pages / last
        self.hist = [h * keep for h in self.hist]
        self.forced *= keep
        self.fixed2 *= keep
        self.offset *= keep


def _clamp(value: float, limit: float) -> float:
    return max(-limit, min(limit, value))

"""PagePool placement under churn: a long conversation computed after many others of varied
lengths lands in few runs of consecutive page ids, and the pool holds as many tokens as before.

The churn drives the real ``KVCacheManager`` (chunked prefill, one page per decode step,
published pages cached and evicted LRU) with a seeded random mix; the previous policy
(lowest free id first, then LRU evictions in LRU order) is reproduced below as the reference."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence as Seq

import torch

from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.kv.page_pool import PagePool
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.sequence import Sequence

PAGE = 4  # tokens per page
NUM_PAGES = 1024
CHUNK = 16  # pages of prompt per prefill step


def lowest_id_first(pool: PagePool, page_bits: Seq[int], *, after: int | None, expect: int = 0) -> list[int] | None:
    """The previous placement, for reference: lowest free ids, then evict LRU (in LRU order)."""
    n = len(page_bits)
    if n > pool.num_free:
        return None
    free = sorted(i for start, length in pool.free_runs() for i in range(start, start + length))[:n]
    for pid in free:
        run_start = max(s for s, _ in pool.free_runs() if s <= pid)
        pool._region.take(pid, 1, run_start)
    while len(free) < n:
        pid = pool.cached_page_ids()[0]
        pool._evict(pid)
        free.append(pid)
    return pool._own(free)


def runs(page_ids: list[int]) -> int:
    """Runs of consecutive ascending ids: NIXL regions per layer when the peer's pages are contiguous."""
    return 1 + sum(1 for a, b in zip(page_ids, page_ids[1:]) if b != a + 1) if page_ids else 0


class Churn:
    """Up to ``width`` conversations at once, each step one prefill chunk or one decode page each."""

    def __init__(self, *, old: bool, seed: int, width: int = 4) -> None:
        self.pool = PagePool(NUM_PAGES, page_size=PAGE, clock=lambda: float(self.steps))
        if old:
            self.pool.allocate_next = functools.partial(lowest_id_first, self.pool)  # type: ignore[method-assign]
        self.kv = KVCacheManager(self.pool, page_size=PAGE)
        self.rng = random.Random(seed)
        self.width = width
        self.steps = 0
        self.active: list[tuple[Sequence, int]] = []  # (sequence, pages to generate)
        self.n = 0

    def start(self, prompt_pages: int, gen_pages: int) -> Sequence:
        self.n += 1
        prompt = [self.rng.randrange(1000) for _ in range(prompt_pages * PAGE)]
        seq = Sequence(f"c{self.n}", prompt, SamplingParams(max_tokens=1), torch.Generator())
        self.kv.match_prefix(seq)
        self.active.append((seq, gen_pages))
        return seq

    def step(self) -> None:
        self.steps += 1
        for seq, gen in list(self.active):
            if seq.in_prefill:
                upto = min(len(seq.prompt_ids), seq.num_computed + CHUNK * PAGE)
            elif len(seq.output_ids) < gen * PAGE:
                seq.output_ids += [self.rng.randrange(1000) for _ in range(PAGE)]
                upto = seq.num_tokens
            else:
                self.kv.free(seq)
                self.active.remove((seq, gen))
                continue
            assert self.kv.allocate_until(seq, upto)
            seq.num_computed = upto
            self.kv.publish_full_pages(seq)

    def churn(self, conversations: int) -> None:
        for _ in range(conversations):
            while len(self.active) >= self.width:
                self.step()
            self.start(self.rng.randint(4, 120), self.rng.randint(0, 30))
            self.step()

    def long_conversation(self, prompt_pages: int) -> list[int]:
        """A long conversation computed while the churn goes on; its page ids when done."""
        seq = self.start(prompt_pages, 8)
        while (seq, 8) in self.active:
            while len(self.active) < self.width:
                self.start(self.rng.randint(4, 120), self.rng.randint(0, 30))
            self.step()
            if len(seq.output_ids) == 8 * PAGE:
                return list(seq.page_ids)
        raise AssertionError("unreachable")


def test_long_conversation_after_churn_lands_in_few_runs() -> None:
    result = {}
    for old in (True, False):
        c = Churn(old=old, seed=7)
        c.churn(80)
        assert c.pool.evicted_pages > 0  # the churn filled the pool and evicted cached pages
        pages = c.long_conversation(300)
        assert len(pages) == 308
        result[old] = runs(pages)
    # 308 pages: lowest id first scatters them (294 runs); runs placement keeps 14
    assert result == {True: 294, False: 14}


def test_capacity_is_unchanged_after_churn() -> None:
    """Tokens that fit before an allocation fails: every page not owned, under either policy."""
    fit = {}
    for old in (True, False):
        c = Churn(old=old, seed=11)
        c.churn(60)
        owned = c.pool.num_owned
        seq = c.start(1, 0)
        n = 0
        while c.kv.allocate_until(seq, (len(seq.page_ids) + 1) * PAGE):
            n += 1
        assert c.pool.num_owned == NUM_PAGES and c.pool.num_free == 0
        fit[old] = n * PAGE
        assert n == NUM_PAGES - owned
    assert fit[True] == fit[False]

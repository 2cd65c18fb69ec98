"""The search that follows the page-counted walk (``kvserving.page_search``): constructed
cases where the walk and the one-for-one swap pass stop short of the budget and the
search spends it with more gain; the best set against brute force on small random page
mixes (classes coupled by shared pages); never less gain than the start, the budget
held, the same answer every time; complete on the engine's agent pages."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from kvserving import agent_pages_data
from kvserving.bits import default_sensitivity, page_greedy_table, pages_stored_bits
from kvserving.page_search import MAX_NODES, best_classes, swap_pass
from kvserving.tags import NUM_TAGS, encode_tag

A, B, C, D = (encode_tag("current", "text", s) for s in ("user", "tool_call", "obs", "delim"))
Pages = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]


def _per_token(**gains: float) -> list[float]:
    per = [0.0] * NUM_TAGS
    for name, g in gains.items():
        per[{"a": A, "b": B, "c": C, "d": D}[name]] = g
    return per


def _int4_gain(table: Sequence[int], pages: Pages, per_token: Sequence[float]) -> float:
    """Summed per-token gain of the pages ``table`` stores INT4 (any 4-bit class on them)."""
    return sum(n * sum(per_token[k] * t for k, t in mix) for n, mix in pages if any(table[k] == 4 for k, _ in mix))


def _arrays(
    pages: Pages, per_token: Sequence[float], page_size: int = 32, residual: int = 0
) -> tuple[list[list[int]], list[float], list[float], list[int]]:
    """pages_of, gain_of, bits_of, weight_of as ``page_greedy_table`` builds them."""
    total = residual + page_size * sum(n for n, _ in pages)
    pages_of: list[list[int]] = [[] for _ in range(NUM_TAGS)]
    for i, (_, mix) in enumerate(pages):
        for c, _ in mix:
            pages_of[c].append(i)
    gain_of = [n * sum(max(0.0, per_token[c]) * t for c, t in mix) for n, mix in pages]
    return pages_of, gain_of, [2.0 * n * page_size / total for n, _ in pages], [n for n, _ in pages]


def test_two_bought_classes_give_way_to_one_large_one() -> None:
    # a: 1 page at 10 per token, b: 1 page at 9.5, c: 3 pages at 9 (gain per page 10 > 9.5 > 9).
    # Budget 2 + 2 * 3/5: the walk buys a and b (2 of the 3 pages the budget allows), then c needs 3;
    # no one-for-one swap frees 3 pages. The search buys c alone: 3 x 9 > 10 + 9.5.
    pages: Pages = ((1, ((A, 32),)), (1, ((B, 32),)), (3, ((C, 32),)))
    per = _per_token(a=10.0, b=9.5, c=9.0)
    budget = 2.0 + 2 * 3 / 5
    walk = page_greedy_table(budget, per, pages, page_size=32, residual=0, improve=False)
    best = page_greedy_table(budget, per, pages, page_size=32, residual=0)
    assert (walk[A], walk[B], walk[C]) == (4, 4, 2)
    assert pages_stored_bits(walk, pages, page_size=32, residual=0) == pytest.approx(2.8)
    pages_of, gain_of, bits_of, _ = _arrays(pages, per)
    assert swap_pass({A, B}, pages_of, gain_of, bits_of, room=budget - 2.8 + 1e-9) == {A, B}  # stuck
    assert (best[A], best[B], best[C]) == (2, 2, 4)
    assert pages_stored_bits(best, pages, page_size=32, residual=0) == pytest.approx(budget)
    assert _int4_gain(best, pages, per) == 3 * 32 * 9.0 > _int4_gain(walk, pages, per) == 32 * 19.5


def test_one_bought_class_gives_way_to_two() -> None:
    # a: 3 pages at 10, b and c: 2 pages at 9 each; 4 of the 7 pages may be INT4. The walk buys a
    # (best gain per page) and nothing else fits; swapping a for b loses gain; b and c together win.
    pages: Pages = ((3, ((A, 32),)), (2, ((B, 32),)), (2, ((C, 32),)))
    per = _per_token(a=10.0, b=9.0, c=9.0)
    budget = 2.0 + 2 * 4 / 7
    walk = page_greedy_table(budget, per, pages, page_size=32, residual=0, improve=False)
    best = page_greedy_table(budget, per, pages, page_size=32, residual=0)
    pages_of, gain_of, bits_of, _ = _arrays(pages, per)
    assert (walk[A], walk[B], walk[C]) == (4, 2, 2)
    assert swap_pass({A}, pages_of, gain_of, bits_of, room=2 / 7 + 1e-9) == {A}
    assert (best[A], best[B], best[C]) == (2, 4, 4)
    assert pages_stored_bits(best, pages, page_size=32, residual=0) == pytest.approx(budget)
    assert _int4_gain(best, pages, per) == 4 * 32 * 9.0 > _int4_gain(walk, pages, per) == 3 * 32 * 10.0


def test_a_class_on_shared_pages_comes_free_with_the_classes_it_shares_them_with() -> None:
    # d (a delimiter) has 1 token on each of a's 2 pages and b's 2 pages and is worth the most per
    # token; c: 3 pages of its own at 6. 4 of the 7 pages may be INT4. Buying a and b turns d's
    # pages INT4 too (d then costs nothing); buying c leaves one page of room that nothing fits.
    pages: Pages = ((2, ((A, 31), (D, 1))), (2, ((B, 31), (D, 1))), (3, ((C, 32),)))
    per = _per_token(a=5.0, b=5.0, c=6.0, d=100.0)
    budget = 2.0 + 2 * 4 / 7
    best = page_greedy_table(budget, per, pages, page_size=32, residual=0)
    assert (best[A], best[B], best[C], best[D]) == (4, 4, 2, 4)
    assert pages_stored_bits(best, pages, page_size=32, residual=0) == pytest.approx(budget)


def _brute_force_gain(budget: float, per: Sequence[float], pages: Pages, residual: int) -> float:
    present = sorted({c for _, mix in pages for c, _ in mix})
    best = 0.0
    for r in range(len(present) + 1):
        for bought in itertools.combinations(present, r):
            table = [4 if k in bought else 2 for k in range(NUM_TAGS)]
            if pages_stored_bits(table, pages, page_size=32, residual=residual) <= budget + 1e-9:
                best = max(best, _int4_gain(table, pages, per))
    return best


def _random_pages(rng: random.Random, classes: Sequence[int]) -> Pages:
    records = []
    for _ in range(rng.randint(3, 12)):
        mix = sorted(rng.sample(list(classes), min(len(classes), rng.choice((1, 1, 2, 3)))))
        cuts = sorted(rng.sample(range(1, 32), len(mix) - 1))
        tokens = [b - a for a, b in zip([0, *cuts], [*cuts, 32])]
        records.append((rng.randint(1, 20), tuple(zip(mix, tokens))))
    return tuple(records)


def test_the_search_finds_the_best_set_never_loses_gain_and_holds_the_budget() -> None:
    rng = random.Random(11)
    improved = 0
    for _ in range(60):
        classes = rng.sample(range(NUM_TAGS), rng.randint(2, 7))
        pages = _random_pages(rng, classes)
        residual = rng.randint(0, 40)
        per = [rng.choice((rng.random() * 10, float(rng.randint(0, 3)))) for _ in range(NUM_TAGS)]
        for budget in (2.2, 2.5, 2.8, 3.1, 3.5):
            kw = dict(page_size=32, residual=residual)
            walk = page_greedy_table(budget, per, pages, improve=False, **kw)
            best = page_greedy_table(budget, per, pages, **kw)
            assert pages_stored_bits(best, pages, **kw) <= budget + 1e-9
            gain, walk_gain = _int4_gain(best, pages, per), _int4_gain(walk, pages, per)
            assert gain >= walk_gain - 1e-9
            assert gain == pytest.approx(_brute_force_gain(budget, per, pages, residual), rel=1e-9, abs=1e-9)
            assert page_greedy_table(budget, per, pages, **kw) == best  # the same answer again
            improved += gain > walk_gain + 1e-9
    assert improved > 10  # the walk often stops short on these mixes


def test_the_answer_does_not_depend_on_the_order_of_the_page_records() -> None:
    rng = random.Random(4)
    for _ in range(20):
        pages = _random_pages(rng, rng.sample(range(NUM_TAGS), 6))
        per = [rng.random() * 10 for _ in range(NUM_TAGS)]
        shuffled = list(pages)
        rng.shuffle(shuffled)
        for budget in (2.4, 3.0, 3.6):
            assert page_greedy_table(budget, per, pages, page_size=32, residual=5) == page_greedy_table(
                budget, per, tuple(shuffled), page_size=32, residual=5
            )


def test_a_node_cap_returns_the_best_set_found_never_less_than_the_start() -> None:
    pages: Pages = ((3, ((A, 32),)), (2, ((B, 32),)), (2, ((C, 32),)))
    pages_of, gain_of, _, weight_of = _arrays(pages, _per_token(a=10.0, b=9.0, c=9.0))
    capped = best_classes({A}, pages_of, gain_of, weight_of, capacity=4, max_nodes=1)
    assert (capped.chosen, capped.gain, capped.weight, capped.exact) == (frozenset({A}), 3 * 320.0, 3, False)
    full = best_classes({A}, pages_of, gain_of, weight_of, capacity=4)
    assert (full.chosen, full.gain, full.weight, full.exact) == (frozenset({B, C}), 4 * 288.0, 4, True)
    with pytest.raises(ValueError, match="max_nodes must be >= 1"):
        best_classes((), pages_of, gain_of, weight_of, capacity=4, max_nodes=0)
    with pytest.raises(ValueError, match="page weights must be >= 1"):
        best_classes((), pages_of, gain_of, [0, 1, 1], capacity=4)


def test_the_search_is_complete_and_quick_on_the_agent_pages() -> None:
    d = agent_pages_data
    pages_of, gain_of, _, weight_of = _arrays(d.PAGES, default_sensitivity(), d.PAGE_SIZE, d.RESIDUAL)
    n_pages = sum(weight_of)
    for i in range(0, 41, 4):  # capacities across the whole range of budgets
        found = best_classes((), pages_of, gain_of, weight_of, capacity=n_pages * i // 40)
        assert found.exact and found.nodes < MAX_NODES // 100, i

"""Which classes to store at 4 bits under a budget counted in stored pages: the
swap pass and the exact search that follow ``kvserving.bits``' greedy walk.

The problem. Classes are bought (stored at 4 bits) or not; a page is INT4 when
any bought class has a token on it (DESIGN.md: INT2 only when every token is
2-bit). Each page record ``i`` (``n`` pages of one class mix) has a weight (its
``n`` pages) and a gain (the summed per-token gains of its tokens, counted when
the page is INT4). Choose the bought set whose INT4 pages have the most gain
with their weight within a capacity. Pages couple the classes: a page shared
by two bought classes is paid once, so this is a knapsack over classes whose
costs overlap (a set-union knapsack), not one over independent items.

The greedy walk buys the best gain per page first and stops when no single
class fits: with large classes left (tool results of 11-16 % of the tokens) it
can leave a twentieth of a bit unused (docs/performance-log/fidelity.md). ``swap_pass``
tries one-for-one swaps; ``best_classes`` searches the subsets exactly, by
branch and bound, starting from the set it is given:

- classes are decided in order of their weight, largest first (the decisions
  that move the most pages come first, so bounds tighten early: on the
  fidelity and agent pages this needs ~20x fewer nodes than gain-per-page
  order);
- a node's bound is its gain plus a fractional knapsack over the pages not yet
  INT4 that an undecided class could still turn INT4, densest pages first
  (every completion's new INT4 pages are such pages within the room left);
- only a strictly larger gain replaces the best set, so the result never has
  less gain than the start and is the start when that is already optimal;
- at most ``max_nodes`` nodes: past that the best set found so far is
  returned with ``exact=False`` (deterministic: nodes, not time).

Pure Python; imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_NODES = 200_000  # the fidelity and agent pages need < 1,000 (22 classes); a cap, not a target
_REL = 1e-12  # gains are float sums: a set must beat the best by more than this share to replace it


@dataclass(slots=True, frozen=True)
class Search:
    """``best_classes``' answer: the bought classes, their INT4 pages' summed gain and weight,
    nodes visited, and whether the search was complete (the set is then optimal)."""

    chosen: frozenset[int]
    gain: float
    weight: int
    nodes: int
    exact: bool


def swap_pass(
    bought: Iterable[int],
    pages_of: Sequence[Sequence[int]],
    gain_of: Sequence[float],
    bits_of: Sequence[float],
    *,
    room: float,
    rounds: int | None = None,
) -> set[int]:
    """Improve a bought set of classes: repeatedly apply the one change -- add a class,
    or swap a bought class for one not bought -- that raises the summed gain of the INT4
    pages most while the added stored bits fit in ``room``; stop when none does.

    A page is INT4 while any bought class is on it (``count`` of them per page), so a
    change's cost and gain are the pages that cross zero: O(pages of the two classes).
    At most ``rounds`` changes (default: 4 per class)."""
    chosen = set(bought)
    count = [0] * len(gain_of)
    for k in chosen:
        for i in pages_of[k]:
            count[i] += 1
    candidates = [k for k in range(len(pages_of)) if pages_of[k]]
    for _ in range(4 * len(pages_of) if rounds is None else rounds):
        best: tuple[float, float, int | None, int] | None = None  # (gain, bits, out, in)
        for out in [None, *sorted(chosen)]:
            d_bits = d_gain = 0.0
            if out is not None:
                for i in pages_of[out]:
                    count[i] -= 1
                    if count[i] == 0:
                        d_bits -= bits_of[i]
                        d_gain -= gain_of[i]
            for k in candidates:
                if k in chosen:
                    continue
                add_bits = add_gain = 0.0
                for i in pages_of[k]:
                    if count[i] == 0:
                        add_bits += bits_of[i]
                        add_gain += gain_of[i]
                gain, bits = d_gain + add_gain, d_bits + add_bits
                if gain > 1e-12 * (1.0 + abs(add_gain)) and bits <= room and (best is None or gain > best[0]):
                    best = (gain, bits, out, k)
            if out is not None:
                for i in pages_of[out]:
                    count[i] += 1
        if best is None:
            break
        _, bits, out, k = best
        if out is not None:
            chosen.discard(out)
            for i in pages_of[out]:
                count[i] -= 1
        chosen.add(k)
        for i in pages_of[k]:
            count[i] += 1
        room -= bits
    return chosen


def best_classes(
    start: Iterable[int],
    pages_of: Sequence[Sequence[int]],
    gain_of: Sequence[float],
    weight_of: Sequence[int],
    *,
    capacity: int,
    max_nodes: int = MAX_NODES,
) -> Search:
    """The bought set with the most INT4-page gain whose INT4 pages weigh <= ``capacity``
    (module docstring). ``pages_of[k]``: the page records class k has tokens on;
    ``gain_of[i]`` >= 0 and ``weight_of[i]`` >= 1 per page record. ``start`` (assumed
    to fit) is the set to beat."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if any(w < 1 for w in weight_of) or any(g < 0 for g in gain_of):
        raise ValueError("page weights must be >= 1 and page gains >= 0")
    n_pages = len(gain_of)
    count = [0] * n_pages  # bought classes on each page record: INT4 while > 0

    def covered_gain_weight() -> tuple[float, int]:
        hot = [i for i in range(n_pages) if count[i]]
        return sum(gain_of[i] for i in hot), sum(weight_of[i] for i in hot)

    best_set = frozenset(start)
    for k in best_set:
        for i in pages_of[k]:
            count[i] += 1
    best_gain, best_weight = covered_gain_weight()
    count = [0] * n_pages

    classes = [k for k in range(len(pages_of)) if pages_of[k]]
    weight = {k: sum(weight_of[i] for i in pages_of[k]) for k in classes}
    order = sorted(classes, key=lambda k: (-weight[k], k))
    position = {k: j for j, k in enumerate(order)}
    # page record i can still turn INT4 at depth j while one of its classes is undecided: last[i] >= j
    last = [-1] * n_pages
    for k in classes:
        for i in pages_of[k]:
            last[i] = max(last[i], position[k])
    densest = sorted(range(n_pages), key=lambda i: (-gain_of[i] / weight_of[i], i))
    chosen: list[int] = []
    nodes = 0
    cut = False

    def bound(depth: int, gain: float, room: int) -> float:
        for i in densest:
            if count[i] or last[i] < depth:
                continue
            if weight_of[i] <= room:
                room -= weight_of[i]
                gain += gain_of[i]
            else:
                return gain + gain_of[i] * room / weight_of[i]
        return gain

    def visit(depth: int, gain: float, used: int) -> None:
        nonlocal nodes, cut, best_set, best_gain, best_weight
        nodes += 1
        if gain > best_gain * (1.0 + _REL) and gain > 0.0:
            best_set, best_gain, best_weight = frozenset(chosen), gain, used
        if depth == len(order):
            return
        if nodes >= max_nodes:
            cut = True
            return
        if bound(depth, gain, capacity - used) <= best_gain * (1.0 + _REL):
            return
        k = order[depth]
        add_gain, add_weight = 0.0, 0
        for i in pages_of[k]:
            if count[i] == 0:
                add_gain += gain_of[i]
                add_weight += weight_of[i]
        if add_weight and used + add_weight <= capacity:  # buy k (a class whose pages are all INT4 changes nothing)
            for i in pages_of[k]:
                count[i] += 1
            chosen.append(k)
            visit(depth + 1, gain + add_gain, used + add_weight)
            chosen.pop()
            for i in pages_of[k]:
                count[i] -= 1
        visit(depth + 1, gain, used)  # leave k at 2 bits

    visit(0, 0.0, 0)
    return Search(best_set, best_gain, best_weight, nodes, not cut)

"""The triaxial bits table from a bit budget: DESIGN.md's greedy rule, over
default class sensitivities and the page mix of agent contexts until
calibration measures a model.

The rule (DESIGN.md, Token tags): start every class k at 2 bits and upgrade
classes to 4 bits in order of ``(D_k(2) - D_k(4)) / (2 N_k)`` -- fidelity
gained per extra bit spent -- until the average bits reach the budget B. B is
a ceiling: a class whose upgrade would pass it stays at 2 bits and the walk
goes on to the next ones (rarer classes may still fit).

The average is counted the way the engine stores KV (``page_greedy_table``): a
page is INT2 only when it is full and all 32 of its tokens are 2-bit, so a
class spread thinly over many pages (delimiters, tool-call JSON, short user
messages) costs the pages it turns INT4, not its token share. Counted by token
shares, a budget of 2.7 stored ~3.5 bits on agent contexts (docs/performance-log/fidelity.md).
Each step upgrades the class whose upgrade turns INT4 the pages with the most
summed per-token gain per stored bit added; with pages that each hold one class
this is exactly the order above (a test holds it).

Until calibration measures ``D_k`` for a model, the per-token gain of class k
(``D_k(2) - D_k(4)) / N_k``) is modelled as a sensitivity ``s_k``, the product
of one weight per tag axis:

- temporal: current 8, turn_m1 4, turn_m2 2, older 1. An agent acts on the
  latest request and the latest tool result; attention to a turn fades with
  its age, so halve the cost per turn back.
- semantic: inst 8 and delim 8 (the system prompt and tool schemas steer every
  turn; template delimiters are attention sinks, so an error there shifts the
  whole softmax -- both are few tokens), user 4 and tool_call 4 (the request,
  and call arguments the model copies later), assistant 2, reasoning 1 and
  obs 1 (finished thoughts are rarely re-read; tool observations -- files,
  logs, search results -- are long, redundant and looked up sparsely).
- modal: text 1, image 0.5 (image placeholder tokens are many and redundant).

The pages are those of ``kvserving.agents.pages``: agent conversations at
production-shaped lengths, rendered, tokenized and tagged by the gateway, cut
into pages (``agent_pages_data``, generated). Classes those pages never show
(image tokens: the built-in template has one placeholder per image) are placed
by their sensitivity: 4 bits only when it is above that of every class the
walk left at 2 bits.

``default_frequency`` (token shares per axis: temporal current 0.10, turn_m1
0.15, turn_m2 0.15, older 0.60; semantic inst 0.10, user 0.05, assistant 0.10,
reasoning 0.10, tool_call 0.05, obs 0.55, delim 0.05; modal text 0.95, image
0.05) remains the token-share model a calibration file may ask for
(``frequency_source: agent``).

Pure Python; imports no component.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from kvserving import agent_pages_data
from kvserving.page_search import best_classes, swap_pass
from kvserving.tags import MODAL, NUM_TAGS, SEMANTIC, TEMPORAL, decode_tag, validate_bits_table

TEMPORAL_SENSITIVITY = {"current": 8.0, "turn_m1": 4.0, "turn_m2": 2.0, "older": 1.0}
SEMANTIC_SENSITIVITY = {
    "inst": 8.0,
    "user": 4.0,
    "assistant": 2.0,
    "reasoning": 1.0,
    "tool_call": 4.0,
    "obs": 1.0,
    "delim": 8.0,
}
MODAL_SENSITIVITY = {"text": 1.0, "image": 0.5}

TEMPORAL_SHARE = {"current": 0.10, "turn_m1": 0.15, "turn_m2": 0.15, "older": 0.60}
SEMANTIC_SHARE = {
    "inst": 0.10,
    "user": 0.05,
    "assistant": 0.10,
    "reasoning": 0.10,
    "tool_call": 0.05,
    "obs": 0.55,
    "delim": 0.05,
}
MODAL_SHARE = {"text": 0.95, "image": 0.05}

# One letter per semantic class, in SEMANTIC order, for the one-line table.
_LETTERS = "IUARCOD"
_EPS = 1e-9  # budgets are decimals like 2.7: compare averages with a little slack


def default_sensitivity() -> tuple[float, ...]:
    """``s_k`` of each of the 56 classes (module docstring)."""
    return tuple(
        TEMPORAL_SENSITIVITY[t] * MODAL_SENSITIVITY[m] * SEMANTIC_SENSITIVITY[s] for t, m, s in (decode_tag(k) for k in range(NUM_TAGS))
    )


def default_frequency() -> tuple[float, ...]:
    """``N_k`` of each class as a share of the tokens (sums to 1)."""
    return tuple(TEMPORAL_SHARE[t] * MODAL_SHARE[m] * SEMANTIC_SHARE[s] for t, m, s in (decode_tag(k) for k in range(NUM_TAGS)))


def greedy_bits_table(budget: float, *, gain: Sequence[float], frequency: Sequence[float]) -> tuple[int, ...]:
    """DESIGN.md's greedy rule: ``gain[k] = D_k(2) - D_k(4)``, ``frequency[k] = N_k`` (> 0).

    Ties in ``gain / (2 N)`` go to the lower tag id, so the table is deterministic."""
    if not 2.0 <= budget <= 4.0:
        raise ValueError(f"bit_budget must be in [2, 4], got {budget}")
    if len(gain) != NUM_TAGS or len(frequency) != NUM_TAGS:
        raise ValueError(f"gain and frequency must have {NUM_TAGS} entries, got {len(gain)} and {len(frequency)}")
    if any(not n > 0 for n in frequency):
        raise ValueError("frequency entries must be > 0 (a class that never occurs has no priority)")
    total = sum(frequency)
    order = sorted(range(NUM_TAGS), key=lambda k: (-gain[k] / (2 * frequency[k]), k))
    table = [2] * NUM_TAGS
    average = 2.0
    for k in order:
        upgraded = average + 2 * frequency[k] / total
        if upgraded <= budget + _EPS:
            table[k] = 4
            average = upgraded
    return tuple(table)


# A page's class mix: ((tag, tokens), ...) sorted by tag; a page record: (number of pages, mix).
PageMix = tuple[tuple[int, int], ...]


def count_page_mixes(counts: Counter[PageMix], tags: Sequence[int], page_size: int) -> int:
    """Add the class mix of every full page of one prompt (pages from position 0) to
    ``counts``; return the tokens of its partial last page (stored INT4)."""
    full = len(tags) - len(tags) % page_size
    for s in range(0, full, page_size):
        counts[tuple(sorted(Counter(tags[s : s + page_size]).items()))] += 1
    return len(tags) - full


def page_records(counts: Counter[PageMix]) -> tuple[tuple[int, PageMix], ...]:
    """``counts`` as (number of pages, mix) records, most common first, ties by mix."""
    return tuple(sorted(((n, mix) for mix, n in counts.items()), key=lambda e: (-e[0], e[1])))


def pages_stored_bits(
    table: Sequence[int], pages: Sequence[tuple[int, Sequence[tuple[int, int]]]], *, page_size: int, residual: int
) -> float:
    """Average stored bits per token: a full page is INT2 when every class in it is 2-bit, else INT4;
    residual tokens (partial pages) INT4."""
    total = residual + page_size * sum(n for n, _ in pages)
    if total == 0:
        raise ValueError("no pages and no residual tokens")
    bits = 4 * residual + sum(n * page_size * (2 if all(table[c] == 2 for c, _ in mix) else 4) for n, mix in pages)
    return bits / total


def page_greedy_table(
    budget: float,
    per_token: Sequence[float],
    pages: Sequence[tuple[int, Sequence[tuple[int, int]]]],
    *,
    page_size: int,
    residual: int,
    absent: str = "free",
    improve: bool = True,
) -> tuple[int, ...]:
    """The greedy rule with the budget counted in stored pages (module docstring).

    Start every class at 2 bits; repeatedly upgrade the class whose upgrade turns
    INT4 the pages with the most summed per-token gain per stored bit added, among
    those that keep the stored average <= ``budget`` (a ceiling; ties to the lower
    tag). Classes whose every page ended INT4 anyway cost nothing and get 4 bits. Classes
    absent from the pages: ``absent="free"`` gives them 4 bits (they cost nothing on this
    data); ``absent="rank"`` gives them 4 only when their per-token gain is above that of
    every present class the walk left at 2 bits (the pages are a model of other traffic,
    where they do occur). Per-token gains < 0 count 0.

    With ``improve`` (``kvserving.page_search``) the walk's set is improved: the
    walk buys the best gain per bit first and can then stop well below the budget
    when every class left is large. A swap pass (add a class, or swap one bought
    class for one that was not, while the total gain rises and the budget holds),
    then an exact branch-and-bound search over the bought sets (two-for-one swaps
    and the like) from there: the INT4 pages' summed gain never falls below the
    walk's, the budget holds, and the set is the best one whenever the search
    completes (``page_search.MAX_NODES``; at most ~1,100 nodes on the agent pages)."""
    if absent not in ("free", "rank"):
        raise ValueError(f"absent must be 'free' or 'rank', got {absent!r}")
    if not 2.0 <= budget <= 4.0:
        raise ValueError(f"bit_budget must be in [2, 4], got {budget}")
    if len(per_token) != NUM_TAGS:
        raise ValueError(f"per_token must have {NUM_TAGS} entries, got {len(per_token)}")
    n_pages = sum(n for n, _ in pages)
    total = residual + page_size * n_pages
    if total == 0:
        raise ValueError("no pages and no residual tokens")
    gain_of = [n * sum(max(0.0, per_token[c]) * t for c, t in mix) for n, mix in pages]
    bits_of = [2.0 * n * page_size / total for n, _ in pages]
    pages_of: list[list[int]] = [[] for _ in range(NUM_TAGS)]
    for i, (_, mix) in enumerate(pages):
        for c, _ in mix:
            pages_of[c].append(i)
    hot = [False] * len(pages)
    table = [2] * NUM_TAGS
    average = (4.0 * residual + 2.0 * page_size * n_pages) / total
    while True:
        best, best_ratio, best_bits = -1, -1.0, 0.0
        for k in range(NUM_TAGS):
            flips = [i for i in pages_of[k] if not hot[i]]
            if table[k] == 4 or not flips:
                continue
            add = sum(bits_of[i] for i in flips)
            if average + add > budget + _EPS:
                continue
            ratio = sum(gain_of[i] for i in flips) / add
            if ratio > best_ratio:
                best, best_ratio, best_bits = k, ratio, add
        if best < 0:
            break
        table[best] = 4
        average += best_bits
        for i in pages_of[best]:
            hot[i] = True
    if improve:
        bought = swap_pass([k for k in range(NUM_TAGS) if table[k] == 4], pages_of, gain_of, bits_of, room=budget + _EPS - average)
        # the most full pages that may be INT4: (4 r + 2 P s + 2 s W) / total <= budget
        capacity = math.floor(((budget + _EPS) * total - 4.0 * residual - 2.0 * page_size * n_pages) / (2.0 * page_size))
        bought = set(best_classes(bought, pages_of, gain_of, [n for n, _ in pages], capacity=capacity).chosen)
        table = [4 if k in bought else 2 for k in range(NUM_TAGS)]
        hot = [False] * len(pages)
        for k in bought:
            for i in pages_of[k]:
                hot[i] = True
    for k in range(NUM_TAGS):
        if pages_of[k] and all(hot[i] for i in pages_of[k]):
            table[k] = 4
    ceiling = max((max(0.0, per_token[k]) for k in range(NUM_TAGS) if pages_of[k] and table[k] == 2), default=-math.inf)
    for k in range(NUM_TAGS):
        if not pages_of[k] and (absent == "free" or max(0.0, per_token[k]) > ceiling):
            table[k] = 4
    return tuple(table)


def greedy_order(per_token: Sequence[float], pages: Sequence[tuple[int, Sequence[tuple[int, int]]]], *, page_size: int) -> tuple[int, ...]:
    """All 56 classes in the order ``page_greedy_table``'s walk upgrades them with no budget
    to stop it: the ranking a cut moves along (``worker/bit_budget.py``). Classes 4-bit to the
    walk are a prefix of it up to the first class the budget skips.

    A class whose pages all turned INT4 with earlier classes follows the class that finished
    them; a class absent from the pages comes in where every class after it has a lower
    per-token gain (``absent="rank"``). Ties go to the lower tag."""
    if len(per_token) != NUM_TAGS:
        raise ValueError(f"per_token must have {NUM_TAGS} entries, got {len(per_token)}")
    gain = [max(0.0, g) for g in per_token]
    gain_of = [n * sum(gain[c] * t for c, t in mix) for n, mix in pages]
    size_of = [n * page_size for n, _ in pages]
    pages_of: list[list[int]] = [[] for _ in range(NUM_TAGS)]
    for i, (_, mix) in enumerate(pages):
        for c, _ in mix:
            pages_of[c].append(i)
    hot = [False] * len(pages)
    order: list[int] = []
    present = [k for k in range(NUM_TAGS) if pages_of[k]]
    while len(order) < len(present):
        best, best_ratio = -1, -1.0
        for k in present:
            flips = [i for i in pages_of[k] if not hot[i]]
            if k in order or not flips:
                continue
            ratio = sum(gain_of[i] for i in flips) / sum(size_of[i] for i in flips)
            if ratio > best_ratio:
                best, best_ratio = k, ratio
        if best < 0:
            break
        order.append(best)
        for i in pages_of[best]:
            hot[i] = True
        order += [k for k in present if k not in order and all(hot[i] for i in pages_of[k])]
    for k in sorted((k for k in range(NUM_TAGS) if not pages_of[k]), key=lambda k: (-gain[k], k)):
        after = [i for i, c in enumerate(order) if gain[c] >= gain[k]]
        order.insert(after[-1] + 1 if after else 0, k)
    return tuple(order)


def default_order() -> tuple[int, ...]:
    """``greedy_order`` under the default sensitivities, on the agent pages."""
    d = agent_pages_data
    return greedy_order(default_sensitivity(), d.PAGES, page_size=d.PAGE_SIZE)


def bits_table_for_budget(budget: float) -> tuple[int, ...]:
    """The bits table for ``budget`` under the default sensitivities, counted on the agent pages."""
    d = agent_pages_data
    return page_greedy_table(budget, default_sensitivity(), d.PAGES, page_size=d.PAGE_SIZE, residual=d.RESIDUAL, absent="rank")


def default_stored_bits(table: Sequence[int]) -> float:
    """Average bits per token ``table`` stores on the agent pages (partial pages INT4)."""
    d = agent_pages_data
    return pages_stored_bits(validate_bits_table(list(table)), d.PAGES, page_size=d.PAGE_SIZE, residual=d.RESIDUAL)


def average_bits(table: Sequence[int], frequency: Sequence[float] | None = None) -> float:
    """Average bits per token of ``table`` when classes occur at ``frequency`` (default shares)."""
    table = validate_bits_table(list(table))
    freq = default_frequency() if frequency is None else tuple(frequency)
    return sum(b * n for b, n in zip(table, freq)) / sum(freq)


def int2_share(table: Sequence[int], frequency: Sequence[float] | None = None) -> float:
    """Share of tokens stored at 2 bits under ``table`` at ``frequency`` (default shares)."""
    return (4.0 - average_bits(table, frequency)) / 2.0


def format_bits_table(table: Sequence[int]) -> str:
    """One line: per turn age and modality, the semantic classes at 4 bits as letters
    (I inst, U user, A assistant, R reasoning, C tool_call, O obs, D delim; '.' is 2 bits)."""
    table = validate_bits_table(list(table))
    parts = []
    for t, temporal in enumerate(TEMPORAL):
        cells = []
        for m, modal in enumerate(MODAL):
            first = (t * len(MODAL) + m) * len(SEMANTIC)
            cells.append(modal + " " + "".join(_LETTERS[s] if table[first + s] == 4 else "." for s in range(len(SEMANTIC))))
        parts.append(f"{temporal} " + " ".join(cells))
    return "; ".join(parts)

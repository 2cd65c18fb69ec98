"""Which precision each triaxial page gets, and the page order decode wants
(DESIGN.md, KV formats: triaxial). Pure Python.

A page is INT2 only when it is FULL and every token in it maps to 2 bits in the
bits table; a partial page (the residual tokens, and the page decode is filling)
is INT4, because INT2 keys are quantized per channel over all 32 tokens of a page.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.tags import validate_bits_table


def page_bits(tags: Sequence[int], bits_table: Sequence[int], page_size: int = 32) -> list[int]:
    """Bits (2 or 4) of each page of a sequence whose tokens carry ``tags``; the last page may be partial."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    table = validate_bits_table(list(bits_table))
    try:
        token_bits = [table[t] if t >= 0 else -1 for t in tags]
    except IndexError as exc:
        raise ValueError(f"tags must be in 0..{len(table) - 1}: {exc}") from exc
    if -1 in token_bits:
        raise ValueError(f"tags must be in 0..{len(table) - 1}, got a negative tag")
    out = []
    for start in range(0, len(token_bits), page_size):
        chunk = token_bits[start : start + page_size]
        out.append(2 if len(chunk) == page_size and all(b == 2 for b in chunk) else 4)
    return out


def order_pages_int2_first(page_ids: Sequence[int]) -> tuple[list[int], int]:
    """(INT2 pages, then INT4 pages, each in their original order; the number of INT2 pages).

    The decode kernel splits a sequence into a pure-INT2 and a pure-INT4 chunk
    and merges their partial softmaxes by log-sum-exp, which does not depend on
    page order: RoPE is applied before K is cached, so a page carries its
    positions with it and the kernel needs no position from the page's slot.
    """
    int2 = [pid for pid in page_ids if pid & INT2_PAGE_FLAG]
    int4 = [pid for pid in page_ids if not pid & INT2_PAGE_FLAG]
    return int2 + int4, len(int2)


def average_bits(page_bits: Sequence[int], page_size: int, num_tokens: int) -> float:
    """Nominal bits per KV value over ``num_tokens`` tokens laid out in ``page_bits`` pages
    (the last page holds the remainder). Metadata is not counted (INT4 costs 5 bits and
    INT2 3 with fp16 scales and zeros; calibration counts that, this reports the 2/4 mix)."""
    if page_size < 1 or num_tokens < 1:
        raise ValueError(f"page_size and num_tokens must be >= 1, got {page_size}, {num_tokens}")
    expected = -(-num_tokens // page_size)
    if len(page_bits) != expected:
        raise ValueError(f"{num_tokens} tokens fill {expected} pages of {page_size}, got {len(page_bits)} page bits")
    if any(b not in (2, 4) for b in page_bits):
        raise ValueError(f"page bits must be 2 or 4, got {sorted(set(page_bits))}")
    last = num_tokens - (expected - 1) * page_size
    total = sum(page_bits[:-1]) * page_size + page_bits[-1] * last
    return total / num_tokens


def stored_bits(pages: dict[int, int], bits_per_value: dict[int, float]) -> float | None:
    """Average bits per KV value over stored pages: ``pages`` counts the pages held per
    precision (2 or 4), ``bits_per_value`` what one value of a page of that precision costs
    (nominal 2 / 4, or the page's bytes over its values with scales and zeros: 3 / 5 for
    triaxial). Every page counts whole, a partial one too: it takes a whole page's bytes.
    None when no page is held."""
    n = sum(pages.values())
    if n == 0:
        return None
    return sum(count * bits_per_value[bits] for bits, count in pages.items()) / n

"""Token tags shared by the gateway's tagger and the worker's triaxial pool
(DESIGN.md, Token tags): 4 temporal x 2 modal x 7 semantic = 56 classes.

    tag = (temporal * 2 + modal) * 7 + semantic

A bits table maps each tag to 2 or 4 bits; ``kvserving.bits`` derives one
from a bit budget.
"""

from __future__ import annotations

TEMPORAL = ("current", "turn_m1", "turn_m2", "older")
MODAL = ("text", "image")
SEMANTIC = ("inst", "user", "assistant", "reasoning", "tool_call", "obs", "delim")
NUM_TAGS = len(TEMPORAL) * len(MODAL) * len(SEMANTIC)  # 56


def encode_tag(temporal: str, modal: str, semantic: str) -> int:
    try:
        t, m, s = TEMPORAL.index(temporal), MODAL.index(modal), SEMANTIC.index(semantic)
    except ValueError as exc:
        raise ValueError(f"unknown tag part in ({temporal!r}, {modal!r}, {semantic!r}): {exc}") from exc
    return (t * len(MODAL) + m) * len(SEMANTIC) + s


def decode_tag(tag: int) -> tuple[str, str, str]:
    if not 0 <= tag < NUM_TAGS:
        raise ValueError(f"tag must be in 0..{NUM_TAGS - 1}, got {tag}")
    tm, s = divmod(tag, len(SEMANTIC))
    t, m = divmod(tm, len(MODAL))
    return TEMPORAL[t], MODAL[m], SEMANTIC[s]


def validate_bits_table(table: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """``table`` as a tuple of 56 entries, each 2 or 4; ValueError otherwise."""
    if len(table) != NUM_TAGS:
        raise ValueError(f"bits table must have {NUM_TAGS} entries, got {len(table)}")
    bad = [b for b in table if b not in (2, 4)]
    if bad:
        raise ValueError(f"bits table entries must be 2 or 4, got {sorted(set(bad))}")
    return tuple(int(b) for b in table)

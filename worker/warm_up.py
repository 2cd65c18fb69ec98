"""The requests a worker runs once before it says ready, so that no kernel compiles in a served turn.

Triton compiles a kernel for each new specialization (``compiles.py``): its
constexprs, and whether each integer argument is 1, a multiple of 16 or
neither. The engine's launches take as such integers the step's row count
(GEMMs, norms, the KV write), a prompt chunk's length beside its cached prefix
(the extend kernels; the prefix is a whole number of pages, the scheduler ends
every non-final chunk on a page boundary), the decode rows' page-table width
and split plan; they pick constexpr tiles by row-count classes (powers of two,
the FP8 GEMM's 16 / 64 / 128 / 256 / 512 bounds). The warm-up meets each class with
requests of its own, run through ``LLMEngine.step`` as any request is, so what
compiles is exactly what a served step of that shape would compile
(``LLMEngine.warm_up`` runs the plan made here):

1. **fresh** -- prompts whose chunks fill one step with each row count of
   ``row_counts(max_num_batched_tokens)``: 1, 2, 3 and, per power of two
   ``2^k``, ``2^k``, ``2^k + 1`` and ``3 * 2^(k-1)`` (per class: one, a multiple
   of 16, neither);
2. **extend** -- the same totals as chunks after a cached prefix (a prompt of
   the first group extended), chunk lengths of 1, page multiples and others;
   and the longest prompt, chunk after chunk (prefixes of every length class
   the kernels size their launches by, up to the context length);
3. **decode** (workers that decode) -- for each batch size of
   ``row_counts(max_num_seqs)``, that many sequences decoding beside a new
   prompt's chunk (a mixed step: decode rows run eagerly, outside the CUDA
   graphs), with one-page contexts and with contexts of many pages and splits.

Triaxial prompts carry a 2-bit tag on their tokens but the last page's, so INT2
pages are written, read by decode and extended too; with age-down one prompt's
4-bit pages are wanted at 2 bits by the next (the re-store's kernels). Prompts are random ids from
a fixed seed: they never match a served prompt (a page's hash chains over its
tokens), and the engine is put back afterwards anyway (``LLMEngine.warm_up``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

SEED = 7919  # any fixed seed: the same warm-up prompts on every start
LONG_DECODE = 16384  # the long-context decode rows' prompts (at most): pages for several splits
FIRST_TOKEN = 10  # ids below are left out (a tokenizer's special and control ids sit low)


def row_counts(limit: int) -> list[int]:
    """1, 2, 3 and per power of two 2^k: 2^k, 2^k + 1, 3 * 2^(k-1), up to ``limit`` (included), ascending."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    out = {1, limit}
    k = 1
    while k <= limit:
        out.update(n for n in (k, k + 1, k + k // 2) if n <= limit)
        k *= 2
    return sorted(out)


@dataclass(frozen=True, slots=True)
class Turn:
    """One warm-up request: a fresh prompt, or one that extends an earlier turn's prompt (its cached pages)."""

    prompt_len: int  # tokens of the prompt, the extended turn's included
    max_tokens: int = 1
    extends: int | None = None  # index (in its group) of the turn whose prompt this one's starts with
    waits: bool = False  # added once every earlier turn of its group that does not wait has its first token
    four_bit: bool = False  # triaxial: every token at a 4-bit tag (else 2-bit but the last page's, ``tags_of``)


@dataclass(frozen=True, slots=True)
class Group:
    """Turns run together to completion before the next group starts."""

    name: str
    turns: tuple[Turn, ...]


@dataclass(slots=True)
class WarmUpPlan:
    groups: list[Group] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return sum(len(g.turns) for g in self.groups)


def split_rows(total: int, chunk: int) -> list[int]:
    """``total`` prompt tokens as one step's chunks of at most ``chunk`` each: full chunks, then the rest."""
    full, rest = divmod(total, chunk)
    return [chunk] * full + ([rest] if rest else [])


def plan_warm_up(
    *,
    max_num_batched_tokens: int,
    chunk_size: int,
    max_num_seqs: int,
    page_size: int,
    max_prompt: int,
    decode: bool,
    age_down: bool = False,
    longest: int | None = None,
) -> WarmUpPlan:
    """The groups for an engine with these limits. ``max_prompt``: the longest prompt the warm-up sends beside
    others (the context length and a share of the pool, less the tokens it generates); ``longest``: the one long
    prompt, alone in the pool (default ``max_prompt``); ``decode``: the worker runs decode steps (roles
    decode and both); ``age_down``: its triaxial pool re-stores 4-bit pages at 2 bits for a request that wants 2
    (one group: a 4-bit prompt, then the same tokens wanted at 2 bits)."""
    if min(max_num_batched_tokens, chunk_size, max_num_seqs, page_size, max_prompt) < 1:
        raise ValueError("every limit must be >= 1")
    out = WarmUpPlan()
    chunk = min(chunk_size, max_prompt)
    budget = min(max_num_batched_tokens, chunk * max_num_seqs)
    # 1. fresh prompts filling one step with each row count
    for rows in row_counts(budget):
        out.groups.append(Group(f"fresh {rows}", tuple(Turn(n) for n in split_rows(rows, chunk))))
    # 2. chunks after a cached prefix of `base` tokens (whole pages): the base prompt first, then the extensions
    # (none where a prompt cannot hold a page and a token after it)
    base = page_size * max(1, min(4, (max_prompt - chunk) // page_size))
    room = min(chunk, max_prompt - base)
    for rows in row_counts(min(budget, room * max_num_seqs)) if room >= 1 else []:
        parts = split_rows(rows, room)
        turns = (Turn(base + 1), *(Turn(base + n, extends=0, waits=True) for n in parts))
        out.groups.append(Group(f"extend {rows}", turns))
    longest = max(max_prompt, longest or 0)
    if longest > chunk:  # a long prompt, chunk after chunk: prefixes of every page count class up to the longest
        out.groups.append(Group(f"long {longest}", (Turn(longest),)))
    if age_down and room >= 1:
        out.groups.append(Group("age down", (Turn(base + 1, four_bit=True), Turn(base + room, extends=0, waits=True))))
    if not decode:
        return out
    # 3. decode rows beside a new prompt's chunk: short contexts (one page) at every batch size, then a few rows with
    # contexts of many pages (a page table of 17 columns, and the longest prompt: several splits)
    gen = 4
    joiner = Turn(min(page_size + 5, max_prompt), waits=True)
    for batch in row_counts(max_num_seqs - 1) if max_num_seqs > 1 else []:
        turns = (*(Turn(min(3, max_prompt), max_tokens=gen) for _ in range(batch)), joiner)
        out.groups.append(Group(f"decode {batch} short", turns))
    longest = min(max_prompt, LONG_DECODE) - gen
    for length in sorted({min(17 * page_size + 1, longest), longest}):
        if length <= page_size:
            continue  # no longer than the short contexts above
        for batch in (1, 2, 3):
            if batch < max_num_seqs:
                turns = (*(Turn(length, max_tokens=gen) for _ in range(batch)), joiner)
                out.groups.append(Group(f"decode {batch} x {length}", turns))
    return out


def prompts_of(warm: WarmUpPlan, *, vocab_size: int) -> list[list[list[int]]]:
    """Token ids of every turn, group by group: random ids from ``SEED`` (in [FIRST_TOKEN, vocab_size)), a turn that
    extends another starting with that turn's ids."""
    if vocab_size <= FIRST_TOKEN:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids at or above {FIRST_TOKEN}")
    rng = random.Random(SEED)
    out: list[list[list[int]]] = []
    for group in warm.groups:
        ids: list[list[int]] = []
        for turn in group.turns:
            head = ids[turn.extends] if turn.extends is not None else []
            tail = [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(turn.prompt_len - len(head))]
            ids.append(head[: turn.prompt_len] + tail)
        out.append(ids)
    return out


def tags_of(prompt_len: int, *, page_size: int, bits_table: Seq[int] | None, four_bit: bool = False) -> list[int] | None:
    """Triaxial (``bits_table``: tag -> 2 or 4 bits, 0 where either): a 2-bit tag on every token but the last
    page's (INT2 pages, then INT4), or a 4-bit tag on every token (``four_bit``), where the table has a 2-bit and a
    4-bit tag; None (untagged) otherwise."""
    if bits_table is None:
        return None
    two = next((t for t, b in enumerate(bits_table) if b == 2), None)
    four = next((t for t, b in enumerate(bits_table) if b == 4), None)
    if two is None or four is None:
        return None
    cut = 0 if four_bit else max(0, prompt_len - page_size)
    return [two] * cut + [four] * (prompt_len - cut)


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    groups: int
    requests: int
    steps: int
    seconds: float
    decode_shapes: int = 0  # decode attention launches at every (rows, page-table width) of an eager step


def due(group: Group, added: int, started: Seq[bool]) -> bool:
    """Whether turn ``added`` of ``group`` joins now (the turns before it added; ``started[i]``: turn i has its first
    token): a turn that does not wait joins at once, a waiting one once every earlier turn that does not wait started."""
    if added >= len(group.turns):
        return False
    return not group.turns[added].waits or all(started[i] for i in range(added) if not group.turns[i].waits)

"""From labelled character chunks of the prompt text to one tag per token.

The rules (which role template text takes, where one turn's delimiters end
and the next one's begin, how image placeholders are matched) are stated in
`tagger`'s module docstring; this module applies them to the chunks that
`tag_markers` reads back, using the control tokens' positions from the
tokenizer. Pure: lists in, lists out.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from kvserving.tags import SEMANTIC, encode_tag

from .chat_template import Message
from .tag_markers import Chunk, Piece


@dataclass(frozen=True, slots=True)
class Controls:
    """Character spans of the control tokens (added tokens) in the text, in order."""

    spans: list[tuple[int, int]]
    starts: list[int]
    image: frozenset[int]  # starts of image placeholder tokens
    special: frozenset[int]  # starts of special tokens (`<|im_start|>`, not `<think>`)

    def within(self, start: int, end: int) -> list[tuple[int, int]]:
        k = bisect.bisect_left(self.starts, start)
        out = []
        while k < len(self.spans) and self.spans[k][0] < end:
            out.append(self.spans[k])
            k += 1
        return out


def label(
    chunks: list[Chunk], pieces: list[Piece], text: str, controls: Controls, temporals: list[str]
) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
    """(start, end, tag) spans covering `text`, and where each message's header
    begins (the character where the template text before its first piece, or
    before its place when it rendered no piece, takes its turn)."""
    spans: list[tuple[int, int, int]] = []
    headers: dict[int, int] = {}
    # Merge neighbouring template-text chunks into one gap each.
    merged: list[Chunk] = []
    for c in chunks:
        if merged and c[2] == -1 and merged[-1][2] == -1 and merged[-1][1] == c[0]:
            merged[-1] = (merged[-1][0], c[1], -1)
        else:
            merged.append(c)
    # The next piece after each chunk (one backward pass).
    following: list[Piece | None] = [None] * len(merged)
    nxt: Piece | None = None
    for idx in range(len(merged) - 1, -1, -1):
        following[idx] = nxt
        if merged[idx][2] >= 0:
            nxt = pieces[merged[idx][2]]
    rendered = {pieces[c[2]].message for c in merged if c[2] >= 0}
    prev: Piece | None = None
    header = 0
    for idx, (start, end, pid) in enumerate(merged):
        if pid >= 0:
            piece = pieces[pid]
            if piece.message >= 0:
                headers.setdefault(piece.message, min(header, start))
            header = end
            spans.append((start, end, encode_tag(piece.temporal, "text", piece.semantic)))
            prev = piece
            continue
        after = following[idx]
        lo = prev.message + 1 if prev is not None else 0
        hi = after.message if after is not None else len(temporals)
        skipped = [i for i in range(max(lo, 0), hi) if i not in rendered]
        gap, header, skipped_headers = _gap_spans(start, end, prev, after, text, controls, [(i, temporals[i]) for i in skipped])
        spans.extend(gap)
        for i, char in skipped_headers.items():
            headers.setdefault(i, char)
    return spans, headers


def _gap_spans(
    start: int,
    end: int,
    prev: Piece | None,
    nxt: Piece | None,
    text: str,
    controls: Controls,
    skipped: list[tuple[int, str]],
) -> tuple[list[tuple[int, int, int]], int, dict[int, int]]:
    """Template text between two pieces (rule in the module doc): its spans,
    where the next piece's header begins, and the headers of the messages in
    between that rendered no piece (`skipped`: index and turn, e.g. an empty
    user message).

    The delimiter part switches from the turn of the piece before to the turn
    of the piece after at the last opener: a control token that begins a line
    (after a line break, another control token or the gap's start) and is
    followed by text on that line (`<|im_start|>user`, not `<|im_end|>` at a line end;
    image tokens do not count), a special one rather than markup where there
    is one: `<|im_end|>` and its line break close the previous message,
    `<|im_start|>user` opens the next one. When the gap holds one such opener
    per skipped message plus the next piece's, each skipped message takes the
    stretch from its opener.
    """
    if prev is not None and nxt is not None and prev.region == nxt.region:
        return [(start, end, encode_tag(prev.temporal, "text", prev.semantic))], start, {}
    inside = controls.within(start, end)
    first = text.find("\n", start, end)
    first = end if first < 0 else first
    last = text.rfind("\n", start, end)
    last = start if last < 0 else last + 1
    if inside:
        first = min(first, inside[0][0])
        last = max(last, min(inside[-1][1], end))
    if prev is None:
        first = start
    if nxt is None:
        last = end
    if first >= last:  # no boundary at all: the gap follows the piece before
        owner = prev if prev is not None else nxt
        if owner is None:
            return [(start, end, encode_tag("current", "text", "delim"))], start, {}
        return [(start, end, encode_tag(owner.temporal, "text", owner.semantic))], start, {}
    ends = {b for _, b in inside}
    begins = {a for a, _ in inside}
    openers = [
        a
        for a, b in inside
        if first <= a < last
        and a not in controls.image
        and (a == first or text[a - 1] == "\n" or a in ends)  # begins a line
        and (b >= end or (text[b] != "\n" and b not in begins))  # and names something: `<|im_start|>user`
    ]
    special = [a for a in openers if a in controls.special]
    candidates = special or openers
    before = prev.temporal if prev is not None else "current"
    after = nxt.temporal if nxt is not None else "current"
    # Owners of the delimiter stretches that start at each cut.
    if skipped and len(candidates) == len(skipped) + 1:
        cuts, owners = candidates, [t for _, t in skipped] + [after]
    elif skipped and nxt is None and len(candidates) == len(skipped):
        cuts, owners = candidates, [t for _, t in skipped]
    else:
        cuts, owners, skipped = [candidates[-1] if candidates else first], [after], []
    # The system block's own prose is instruction too: after its last piece up
    # to the first special token (tool-use instructions before `<|im_end|>`),
    # and before its first piece from the line after its opener's header
    # ("# Tools ..." after `<|im_start|>system`).
    if prev is not None and prev.semantic == "inst":
        stop = next((a for a, _ in inside if a >= first and a in controls.special), cuts[0])
        first = max(first, min(stop, cuts[0]))
    if nxt is not None and nxt.semantic == "inst" and candidates:
        body = text.find("\n", cuts[-1], last)
        if body >= 0:
            while body < last and text[body] == "\n":
                body += 1
            last = body
    spans = []
    if prev is not None and first > start:
        spans.append((start, first, encode_tag(prev.temporal, "text", prev.semantic)))
    if cuts[0] > first:
        spans.append((first, cuts[0], encode_tag(before, "text", "delim")))
    for j, (cut, turn) in enumerate(zip(cuts, owners, strict=True)):
        stop = cuts[j + 1] if j + 1 < len(cuts) else last
        spans.append((cut, stop, encode_tag(turn, "text", "delim")))
    if nxt is not None and last < end:
        spans.append((last, end, encode_tag(nxt.temporal, "text", nxt.semantic)))
    return spans, cuts[-1], {i: cuts[j] for j, (i, _) in enumerate(skipped)}


def token_tags(spans: list[tuple[int, int, int]], starts: Sequence[int]) -> list[int]:
    """Each token (given by its first character, ``starts``) takes the tag of the span holding it."""
    tags = [encode_tag("current", "text", "delim")] * len(starts)
    for start, end, tag in spans:
        # Tokens are in text order, so those starting in [start, end) are one slice.
        lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
        if hi > lo:
            tags[lo:hi] = [tag] * (hi - lo)
    return tags


# -- images and turns ---------------------------------------------------------


def image_runs(ids: list[int], image_ids: frozenset[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    if image_ids.isdisjoint(ids):
        return runs
    start = -1
    for k, t in enumerate(ids):
        if t in image_ids:
            if start < 0:
                start = k
        elif start >= 0:
            runs.append((start, k))
            start = -1
    if start >= 0:
        runs.append((start, len(ids)))
    return runs


def insert_images(
    chunks: list[Chunk],
    runs: list[tuple[int, int]],
    images: list[int],
    offsets: list[tuple[int, int]],
    pieces: list[Piece],
    msgs: list[Message],
    temporals: list[str],
) -> list[Chunk]:
    """Image placeholder runs as pieces of their message (matched in order to
    the request's image parts), cut out of the template text around them."""
    spans: list[tuple[int, int, int]] = []
    for (a, b), i in zip(runs, images, strict=True):
        semantic = "obs" if msgs[i]["role"] == "tool" else "user"
        spans.append((offsets[a][0], offsets[b - 1][1], len(pieces)))
        pieces.append(Piece(semantic, temporals[i], ("msg", i), i))
    out: list[Chunk] = []
    k = 0
    for start, end, pid in chunks:
        if pid >= 0:
            out.append((start, end, pid))
            continue
        pos = start
        while k < len(spans) and spans[k][0] < end:
            a, b, image_pid = spans[k]
            if a < pos:  # inside a content piece: not a template placeholder
                k += 1
                continue
            if a > pos:
                out.append((pos, a, -1))
            out.append((a, min(b, end), image_pid))
            pos = min(b, end)
            k += 1
        if pos < end:
            out.append((pos, end, -1))
    return out


def tag_images(tags: list[int], runs: list[tuple[int, int]]) -> None:
    """Image placeholder tokens keep their role and turn, with the image modality."""
    width = len(SEMANTIC)
    for a, b in runs:
        for k in range(a, b):
            tm, s = divmod(tags[k], width)
            tags[k] = ((tm // 2) * 2 + 1) * width + s


def turn_starts(msgs: list[Message], headers: dict[int, int], token_starts: Sequence[int]) -> tuple[int, ...]:
    """Token index where each user turn begins: its message's header (e.g.
    `<|im_start|>user`), found before its first piece (text or image); ``token_starts``:
    each token's first character."""
    return tuple(
        max(0, bisect.bisect_right(token_starts, headers[i]) - 1)
        for i, m in enumerate(msgs)
        if m["role"] == "user" and i in headers
    )

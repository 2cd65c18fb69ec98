"""Tag every prompt token with one of the 56 classes of `kvserving.tags`,
from the structure of the model's own chat template.

How (for any template, without parsing its strings): every content string of
the request — message text, reasoning, tool-call names and arguments, tool
results, the system prompt, tool names and descriptions — is wrapped in
invisible private-use markers that carry a piece id, the template is rendered
once with markers and once without, and the marker positions become character
spans of the real text (the marked render minus its markers equals the real
render; when a template edits content so that they differ, the spans are
aligned by searching each marked chunk in the real text). Markers sit inside
a piece's leading/trailing whitespace, so templates that `strip()` content
still render the same text. Character spans become token spans through the
tokenizer's offsets; a token straddling a boundary takes the tag of its first
character.

Semantic role of each character:

- content pieces: system prompt and tool schemas -> inst; user text -> user;
  assistant text -> assistant; reasoning (`reasoning_content`, or
  `<think>...</think>` inside the content) -> reasoning; tool-call names and
  arguments (and `<tool_call>...</tool_call>` inside assistant content) ->
  tool_call; tool results -> obs;
- template text between two pieces of the same block (one system block of
  system prompt + tools, one message body, one tool call) -> that block's
  role (the "# Tools" prose between system prompt and schemas, the JSON glue
  between a tool's name and its arguments);
- other template text -> delim, except its part on the same line as a piece
  (no line break or control token in between: `{"name": "` before a tool
  name, `}` after the arguments), which joins that piece. So `<|im_start|>`,
  role names, `<|im_end|>`, `<think>` markers and the newlines the template
  adds are delim.

Modality: image placeholder tokens (added tokens named like image / vision /
video) -> image; each run of them is matched, in order, to the request's
image parts and takes that message's role and turn.

Temporal: user turns back from the current one. The last user message and
everything after it is `current`, the turn before it `turn_m1`, then
`turn_m2`, then `older`; template text takes the turn of the piece it
introduces (the generation prompt is `current`). The system prompt and tool
schemas are always `current`: they govern every turn, so their tag never ages
(their pages keep one precision and one prefix-cache identity across turns,
and a bits table can keep instructions precise without also keeping old
chatter precise).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserving.tags import SEMANTIC, TEMPORAL, encode_tag

from .chat_template import ChatTemplate, Message, normalize_messages, normalize_tools
from .errors import GatewayError
from .tokenizer import TextTokenizer

INLINE_MARKUP = re.compile(r"<think>|</think>|<tool_call>|</tool_call>")
SYSTEM_REGION: tuple[object, ...] = ("system",)
# Marker alphabets (private-use planes); the first whose characters do not
# occur in the real render is used.
MARKER_BASES = (0xF0000, 0x100000, 0xE000)
DELIM = SEMANTIC.index("delim")


@dataclass(frozen=True, slots=True)
class TaggedPrompt:
    """The prompt as the worker receives it: text, token ids, one tag per token.

    `turn_starts` holds the token index where each user turn begins (the
    template header of its user message), oldest first; the last one starts
    the current turn.
    """

    text: str
    input_ids: list[int]
    tags: list[int]
    turn_starts: tuple[int, ...] = ()
    # How the tags were found (a metric label): "markers" (exact spans),
    # "aligned" (the template edited content; spans re-anchored by search),
    # "coarse" (no structure: control tokens delim, the rest user), "text"
    # (a raw completion prompt).
    method: str = "markers"

    @property
    def current_turn_start(self) -> int:
        return self.turn_starts[-1] if self.turn_starts else 0


@dataclass(frozen=True, slots=True)
class _Piece:
    semantic: str
    temporal: str
    region: tuple[object, ...]
    message: int  # index in messages; tool schemas: the system message's, or -1


@dataclass(slots=True)
class _Marks:
    """Pieces found while marking, and the image parts in request order."""

    pieces: list[_Piece] = field(default_factory=list)
    images: list[int] = field(default_factory=list)  # message index of each image part


class _MarkerCodec:
    """open(id) = OPEN + hex digits + SEP, close = CLOSE (one private-use plane)."""

    def __init__(self, base: int) -> None:
        self.open_char, self.sep, self.close = chr(base), chr(base + 1), chr(base + 2)
        self.digits = "".join(chr(base + 16 + d) for d in range(16))
        d = re.escape(self.digits[0]) + "-" + re.escape(self.digits[-1])
        self.pattern = re.compile(f"{re.escape(self.open_char)}([{d}]+){re.escape(self.sep)}|{re.escape(self.close)}")
        self.any_char = re.compile(f"[{re.escape(chr(base))}-{re.escape(chr(base + 31))}]")

    def open(self, piece_id: int) -> str:
        return self.open_char + "".join(self.digits[int(c, 16)] for c in format(piece_id, "x")) + self.sep

    def piece_id(self, digits: str) -> int:
        return int("".join(format(self.digits.index(c), "x") for c in digits), 16)


class ChatTagger:
    """Render, tokenize and tag chat requests for one model."""

    def __init__(self, tokenizer: TextTokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self._control_ids = frozenset(tokenizer.added_tokens)

    def build(
        self,
        messages: object,
        *,
        tools: object = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TaggedPrompt:
        """Check (400 `GatewayError` on bad input), render, tokenize and tag a chat request."""
        msgs = normalize_messages(messages)
        tool_list = normalize_tools(tools)
        text = self.template.render(msgs, tools=tool_list, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
        enc = self.tokenizer.encode(text)
        codec = _pick_codec(text)
        if codec is None:  # the request itself uses every marker alphabet
            return self._coarse(text, enc.ids, enc.offsets)
        marks = _Marks()
        temporals = message_temporals(msgs)
        marked_msgs = [_mark_message(m, i, temporals[i], codec, marks) for i, m in enumerate(msgs)]
        # Tool schemas join the system message's block (its index, when there is one).
        owner = 0 if msgs[0]["role"] == "system" else -1
        marked_tools = None if tool_list is None else [_mark_tool(t, codec, marks, message=owner) for t in tool_list]
        try:
            marked_text = self.template.render(
                marked_msgs, tools=marked_tools, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
            )
        except GatewayError:  # the template refused marked content it accepts plain
            return self._coarse(text, enc.ids, enc.offsets)
        plain, chunks = _parse_marked(marked_text, codec)
        method = "markers"
        if plain != text:
            chunks, method = _align(chunks, plain, text), "aligned"
        pieces = list(marks.pieces)
        image_runs = _image_runs(enc.ids, self.tokenizer.image_token_ids)
        if image_runs and len(image_runs) == len(marks.images):
            chunks = _insert_images(chunks, image_runs, marks.images, enc.offsets, pieces, msgs, temporals)
        spans, headers = _label(chunks, pieces, text, self._controls(enc.ids, enc.offsets), temporals)
        tags = _token_tags(spans, enc.offsets)
        _tag_images(tags, image_runs)
        turn_starts = _turn_starts(msgs, headers, enc.offsets)
        return TaggedPrompt(text=text, input_ids=enc.ids, tags=tags, turn_starts=turn_starts, method=method)

    def _coarse(self, text: str, ids: list[int], offsets: list[tuple[int, int]]) -> TaggedPrompt:
        """Tags without the template's structure: control tokens are current
        delimiters, image tokens current user image, the rest current user text."""
        delim, image, user = (encode_tag("current", m, s) for m, s in (("text", "delim"), ("image", "user"), ("text", "user")))
        images, controls = self.tokenizer.image_token_ids, self._control_ids
        tags = [image if t in images else delim if t in controls else user for t in ids]
        return TaggedPrompt(text=text, input_ids=ids, tags=tags, method="coarse")

    def _controls(self, ids: list[int], offsets: list[tuple[int, int]]) -> _Controls:
        control, images, specials = self._control_ids, self.tokenizer.image_token_ids, self.tokenizer.special_ids
        found = [k for k, t in enumerate(ids) if t in control]
        spans = [offsets[k] for k in found if offsets[k][1] > offsets[k][0]]
        image = frozenset(offsets[k][0] for k in found if ids[k] in images)
        special = frozenset(offsets[k][0] for k in found if ids[k] in specials)
        return _Controls(spans=spans, starts=[a for a, _ in spans], image=image, special=special)

    def tag_text(self, text: str) -> TaggedPrompt:
        """A raw completion prompt: no structure, so every token is current user text
        (image placeholder tokens are current user image)."""
        enc = self.tokenizer.encode(text)
        return TaggedPrompt(text=text, input_ids=enc.ids, tags=self.tag_ids(enc.ids), method="text")

    def tag_ids(self, ids: Sequence[int]) -> list[int]:
        """Tags for a prompt given as token ids (`/v1/completions` with ids)."""
        user, image = encode_tag("current", "text", "user"), encode_tag("current", "image", "user")
        return [image if t in self.tokenizer.image_token_ids else user for t in ids]


def message_temporals(messages: Sequence[Message]) -> list[str]:
    """Each message's turn: user turns back from the last user message (system: current)."""
    out = ["current"] * len(messages)
    users_after = 0
    for i in range(len(messages) - 1, -1, -1):
        role = messages[i].get("role")
        if role == "system":
            out[i] = "current"
        else:
            out[i] = TEMPORAL[min(users_after, len(TEMPORAL) - 1)]
        if role == "user":
            users_after += 1
    return out


# -- marking ------------------------------------------------------------------


def _pick_codec(text: str) -> _MarkerCodec | None:
    for base in MARKER_BASES:
        codec = _MarkerCodec(base)
        if not codec.any_char.search(text):
            return codec
    return None


def _wrap(text: str, piece: _Piece, codec: _MarkerCodec, marks: _Marks, *, piece_id: int | None = None) -> str:
    """`text` with markers inside its leading/trailing whitespace (unchanged if blank)."""
    core = text.strip()
    if not core:
        return text
    if piece_id is None:
        piece_id = len(marks.pieces)
        marks.pieces.append(piece)
    lead = len(text) - len(text.lstrip())
    end = lead + len(core)
    return text[:lead] + codec.open(piece_id) + core + codec.close + text[end:]


def _mark_message(message: Message, i: int, temporal: str, codec: _MarkerCodec, marks: _Marks) -> Message:
    role = message["role"]
    out = dict(message)
    if role == "system":
        piece = _Piece("inst", "current", SYSTEM_REGION, i)
        out["content"] = _mark_content(message.get("content"), piece, codec, marks)
    elif role == "user":
        piece = _Piece("user", temporal, ("msg", i), i)
        out["content"] = _mark_content(message.get("content"), piece, codec, marks, images=True, message_index=i)
    elif role == "tool":
        piece = _Piece("obs", temporal, ("msg", i), i)
        out["content"] = _mark_content(message.get("content"), piece, codec, marks)
    elif role == "assistant":
        _mark_assistant(message, out, i, temporal, codec, marks)
    return {k: v for k, v in out.items() if v is not None}


def _mark_content(
    content: object,
    piece: _Piece,
    codec: _MarkerCodec,
    marks: _Marks,
    *,
    images: bool = False,
    message_index: int = -1,
) -> object:
    if isinstance(content, str):
        return _wrap(content, piece, codec, marks)
    if not isinstance(content, list):
        return content
    parts: list[object] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({**part, "text": _wrap(part["text"], piece, codec, marks)})
        else:
            if images and isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part):
                marks.images.append(message_index)
            parts.append(part)
    return parts


def _mark_assistant(message: Message, out: Message, i: int, temporal: str, codec: _MarkerCodec, marks: _Marks) -> None:
    reasoning = _Piece("reasoning", temporal, ("reason", i), i)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = _mark_inline(content, i, temporal, codec, marks)
    elif isinstance(content, list):
        out["content"] = [
            {**p, "text": _mark_inline(p["text"], i, temporal, codec, marks)}
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
    # The aliases of one reasoning string share one piece id.
    shared: int | None = None
    for name in ("reasoning_content", "thinking", "reasoning"):
        value = message.get(name)
        if isinstance(value, str) and value.strip():
            if shared is None:
                shared = len(marks.pieces)
                marks.pieces.append(reasoning)
            out[name] = _wrap(value, reasoning, codec, marks, piece_id=shared)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_mark_call(call, i, k, temporal, codec, marks) for k, call in enumerate(calls)]


def _mark_inline(text: str, i: int, temporal: str, codec: _MarkerCodec, marks: _Marks) -> str:
    """Assistant text with `<think>` / `<tool_call>` blocks marked as their own pieces.

    A `</think>` without an opening `<think>` before it closes reasoning that
    began at the start (templates that open the think block in the prompt).
    """
    found = list(INLINE_MARKUP.finditer(text))
    first_think = next((m.group() for m in found if m.group() in ("<think>", "</think>")), None)
    state = "reasoning" if first_think == "</think>" else "assistant"
    out: list[str] = []
    pos, calls = 0, 0
    for m in found:
        out.append(_wrap(text[pos : m.start()], _inline_piece(state, i, temporal, calls), codec, marks))
        out.append(m.group())
        tag = m.group()
        if tag == "<think>":
            state = "reasoning"
        elif tag == "<tool_call>":
            state, calls = "tool_call", calls + 1
        else:
            state = "assistant"
        pos = m.end()
    out.append(_wrap(text[pos:], _inline_piece(state, i, temporal, calls), codec, marks))
    return "".join(out)


def _inline_piece(state: str, i: int, temporal: str, calls: int) -> _Piece:
    region: tuple[object, ...]
    if state == "reasoning":
        region = ("reason", i)
    elif state == "tool_call":
        region = ("inline_call", i, calls)
    else:
        region = ("msg", i)
    return _Piece(state, temporal, region, i)


def _mark_call(call: object, i: int, k: int, temporal: str, codec: _MarkerCodec, marks: _Marks) -> object:
    if not isinstance(call, dict):
        return call
    piece = _Piece("tool_call", temporal, ("call", i, k), i)
    out = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict):
        out["function"] = _mark_call_fields(fn, piece, codec, marks)
    else:  # some clients put name/arguments at the top level
        out = _mark_call_fields(out, piece, codec, marks)
    return out


def _mark_call_fields(fn: dict[str, Any], piece: _Piece, codec: _MarkerCodec, marks: _Marks) -> dict[str, Any]:
    out = dict(fn)
    if isinstance(fn.get("name"), str):
        out["name"] = _wrap(fn["name"], piece, codec, marks)
    args = fn.get("arguments")
    if isinstance(args, str):
        out["arguments"] = _wrap(args, piece, codec, marks)
    elif isinstance(args, dict):
        out["arguments"] = _mark_leaves(args, piece, codec, marks)
    return out


def _mark_leaves(obj: object, piece: _Piece, codec: _MarkerCodec, marks: _Marks) -> object:
    if isinstance(obj, str):
        return _wrap(obj, piece, codec, marks)
    if isinstance(obj, dict):
        return {k: _mark_leaves(v, piece, codec, marks) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mark_leaves(v, piece, codec, marks) for v in obj]
    return obj


def _mark_tool(tool: dict[str, Any], codec: _MarkerCodec, marks: _Marks, *, message: int) -> dict[str, Any]:
    """Mark a tool's name and description strings (any depth); templates may
    compare `type` or enum values, so those stay untouched."""
    piece = _Piece("inst", "current", SYSTEM_REGION, message)

    def walk(obj: object, key: str | None) -> object:
        if isinstance(obj, str):
            return _wrap(obj, piece, codec, marks) if key in ("name", "description") else obj
        if isinstance(obj, dict):
            return {k: walk(v, k) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v, None) for v in obj]
        return obj

    result = walk(tool, None)
    assert isinstance(result, dict)
    return result


# -- from markers to character spans -------------------------------------------

# A chunk: (start, end, piece id or -1 for template text) over the plain text.
Chunk = tuple[int, int, int]


def _parse_marked(marked: str, codec: _MarkerCodec) -> tuple[str, list[Chunk]]:
    """Strip the markers; chunks of the plain text labelled with the open piece.

    Flat, not nested: an open marker ends any piece still open (pieces never
    contain each other; a template that cut off a close marker loses nothing
    more than that piece's end)."""
    out: list[str] = []
    chunks: list[Chunk] = []
    pos = 0
    length = 0
    current = -1
    for m in codec.pattern.finditer(marked):
        if m.start() > pos:
            seg = marked[pos : m.start()]
            out.append(seg)
            chunks.append((length, length + len(seg), current))
            length += len(seg)
        current = codec.piece_id(m.group(1)) if m.group(1) is not None else -1
        pos = m.end()
    if pos < len(marked):
        seg = marked[pos:]
        out.append(seg)
        chunks.append((length, length + len(seg), current))
    return "".join(out), chunks


def _align(chunks: list[Chunk], plain: str, text: str) -> list[Chunk]:
    """Chunks of `plain` re-anchored in `text` when the template edited content
    (the marked render minus markers differs from the real render): each chunk
    is searched in order; text skipped over joins the chunk before; a chunk
    not found is dropped."""
    out: list[Chunk] = []
    cursor = 0
    for start, end, piece in chunks:
        seg = plain[start:end]
        found = cursor if text.startswith(seg, cursor) else text.find(seg, cursor)
        if found < 0:
            continue
        if found > cursor:
            if out:
                a, _, p = out[-1]
                out[-1] = (a, found, p)
            else:
                out.append((cursor, found, -1))
        out.append((found, found + len(seg), piece))
        cursor = found + len(seg)
    if cursor < len(text):
        out.append((cursor, len(text), -1))
    return out


@dataclass(frozen=True, slots=True)
class _Controls:
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


def _label(
    chunks: list[Chunk], pieces: list[_Piece], text: str, controls: _Controls, temporals: list[str]
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
    following: list[_Piece | None] = [None] * len(merged)
    nxt: _Piece | None = None
    for idx in range(len(merged) - 1, -1, -1):
        following[idx] = nxt
        if merged[idx][2] >= 0:
            nxt = pieces[merged[idx][2]]
    rendered = {pieces[c[2]].message for c in merged if c[2] >= 0}
    prev: _Piece | None = None
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
    prev: _Piece | None,
    nxt: _Piece | None,
    text: str,
    controls: _Controls,
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


def _token_tags(spans: list[tuple[int, int, int]], offsets: list[tuple[int, int]]) -> list[int]:
    """Each token takes the tag of the span holding its first character."""
    starts = [a for a, _ in offsets]
    tags = [encode_tag("current", "text", "delim")] * len(starts)
    for start, end, tag in spans:
        # Tokens are in text order, so those starting in [start, end) are one slice.
        lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
        if hi > lo:
            tags[lo:hi] = [tag] * (hi - lo)
    return tags


# -- images and turns ---------------------------------------------------------


def _image_runs(ids: list[int], image_ids: frozenset[int]) -> list[tuple[int, int]]:
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


def _insert_images(
    chunks: list[Chunk],
    runs: list[tuple[int, int]],
    images: list[int],
    offsets: list[tuple[int, int]],
    pieces: list[_Piece],
    msgs: list[Message],
    temporals: list[str],
) -> list[Chunk]:
    """Image placeholder runs as pieces of their message (matched in order to
    the request's image parts), cut out of the template text around them."""
    spans: list[tuple[int, int, int]] = []
    for (a, b), i in zip(runs, images, strict=True):
        semantic = "obs" if msgs[i]["role"] == "tool" else "user"
        spans.append((offsets[a][0], offsets[b - 1][1], len(pieces)))
        pieces.append(_Piece(semantic, temporals[i], ("msg", i), i))
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


def _tag_images(tags: list[int], runs: list[tuple[int, int]]) -> None:
    """Image placeholder tokens keep their role and turn, with the image modality."""
    width = len(SEMANTIC)
    for a, b in runs:
        for k in range(a, b):
            tm, s = divmod(tags[k], width)
            tags[k] = ((tm // 2) * 2 + 1) * width + s


def _turn_starts(msgs: list[Message], headers: dict[int, int], offsets: list[tuple[int, int]]) -> tuple[int, ...]:
    """Token index where each user turn begins: its message's header (e.g.
    `<|im_start|>user`), found before its first piece (text or image)."""
    token_starts = [a for a, _ in offsets]
    return tuple(
        max(0, bisect.bisect_right(token_starts, headers[i]) - 1)
        for i, m in enumerate(msgs)
        if m["role"] == "user" and i in headers
    )

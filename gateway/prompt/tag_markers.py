"""Content pieces of a chat request wrapped in invisible markers, and read back.

Every content string (message text, reasoning, tool-call names and arguments,
tool results, system prompt, tool names and descriptions) is wrapped in
private-use characters that carry a piece id; rendering the marked request
through the chat template and stripping the markers again gives each piece's
character span in the real render (`tagger` explains why and how the spans
become tags). Pure string work: no template, no tokenizer.

    open(id) = OPEN + hex digits (16 private-use characters) + SEP
    close    = CLOSE

Markers go inside a string's leading/trailing whitespace, so templates that
`strip()` content render the same characters; blank strings stay unmarked,
so `{% if content %}` still sees them empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from .chat_template import Message

INLINE_MARKUP = re.compile(r"<think>|</think>|<tool_call>|</tool_call>")
# Marker alphabets (private-use planes); the first whose characters do not
# occur in the real render is used.
MARKER_BASES = (0xF0000, 0x100000, 0xE000)


@dataclass(frozen=True, slots=True)
class Piece:
    """One marked content string: its role, the block it belongs to (template text
    between two pieces of one block takes the block's role) and its message (whose
    place in the request gives its turn)."""

    semantic: str
    region: tuple[object, ...]
    message: int  # index in messages; tool schemas: the system message's, or -1


@dataclass(slots=True)
class Marks:
    """Pieces found while marking, and the image parts in request order."""

    pieces: list[Piece] = field(default_factory=list)
    images: list[int] = field(default_factory=list)  # message index of each image part


class MarkerCodec:
    """open(id) = OPEN + hex digits + SEP, close = CLOSE (one private-use plane)."""

    def __init__(self, base: int) -> None:
        self.open_char, self.sep, self.close = chr(base), chr(base + 1), chr(base + 2)
        self.digits = "".join(chr(base + 16 + d) for d in range(16))
        d = re.escape(self.digits[0]) + "-" + re.escape(self.digits[-1])
        self.pattern = re.compile(f"{re.escape(self.open_char)}([{d}]+){re.escape(self.sep)}|{re.escape(self.close)}")
        self.any_char = re.compile(f"[{re.escape(chr(base))}-{re.escape(chr(base + 31))}]")

    def strip(self, marked: str) -> str:
        """``marked`` without this alphabet's characters."""
        return self.any_char.sub("", marked)

    def open(self, piece_id: int) -> str:
        return self.open_char + "".join(self.digits[int(c, 16)] for c in format(piece_id, "x")) + self.sep

    def piece_id(self, digits: str) -> int:
        return int("".join(format(self.digits.index(c), "x") for c in digits), 16)


def pick_codec(text: str) -> MarkerCodec | None:
    """A marker alphabet that `text` (the real render) does not use, or None."""
    if _no_private_use(text):
        return _codec(MARKER_BASES[0])
    for base in MARKER_BASES:
        codec = _codec(base)
        if not codec.any_char.search(text):
            return codec
    return None


def first_codec() -> MarkerCodec:
    """The alphabet kept renders mark with (an appended turn is marked before the real render is known; `ChatTagger.build`)."""
    return _codec(MARKER_BASES[0])


def _no_private_use(text: str) -> bool:
    """No character at or above the lowest marker alphabet (a C scan: the common case)."""
    return text.isascii() or max(text) < _LOWEST_MARKER


@lru_cache(maxsize=len(MARKER_BASES))
def _codec(base: int) -> MarkerCodec:
    return MarkerCodec(base)


_LOWEST_MARKER = chr(min(MARKER_BASES))


def _wrap(text: str, piece: Piece, codec: MarkerCodec, marks: Marks, *, piece_id: int | None = None) -> str:
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


def mark_message(message: Message, i: int, codec: MarkerCodec, marks: Marks) -> Message:
    role = message["role"]
    out = dict(message)
    if role == "system":
        piece = Piece("inst", ("msg", i), i)
        out["content"] = _mark_content(message.get("content"), piece, codec, marks)
    elif role == "user":
        piece = Piece("user", ("msg", i), i)
        out["content"] = _mark_content(message.get("content"), piece, codec, marks, images=True, message_index=i)
    elif role == "tool":
        piece = Piece("obs", ("msg", i), i)
        out["content"] = _mark_content(message.get("content"), piece, codec, marks)
    elif role == "assistant":
        _mark_assistant(message, out, i, codec, marks)
    return {k: v for k, v in out.items() if v is not None}


def _mark_content(
    content: object,
    piece: Piece,
    codec: MarkerCodec,
    marks: Marks,
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


def _mark_assistant(message: Message, out: Message, i: int, codec: MarkerCodec, marks: Marks) -> None:
    reasoning = Piece("reasoning", ("reason", i), i)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = _mark_inline(content, i, codec, marks)
    elif isinstance(content, list):
        out["content"] = [
            {**p, "text": _mark_inline(p["text"], i, codec, marks)}
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
        out["tool_calls"] = [_mark_call(call, i, k, codec, marks) for k, call in enumerate(calls)]


def _mark_inline(text: str, i: int, codec: MarkerCodec, marks: Marks) -> str:
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
        out.append(_wrap(text[pos : m.start()], _inline_piece(state, i, calls), codec, marks))
        out.append(m.group())
        tag = m.group()
        if tag == "<think>":
            state = "reasoning"
        elif tag == "<tool_call>":
            state, calls = "tool_call", calls + 1
        else:
            state = "assistant"
        pos = m.end()
    out.append(_wrap(text[pos:], _inline_piece(state, i, calls), codec, marks))
    return "".join(out)


def _inline_piece(state: str, i: int, calls: int) -> Piece:
    region: tuple[object, ...]
    if state == "reasoning":
        region = ("reason", i)
    elif state == "tool_call":
        region = ("inline_call", i, calls)
    else:
        region = ("msg", i)
    return Piece(state, region, i)


def _mark_call(call: object, i: int, k: int, codec: MarkerCodec, marks: Marks) -> object:
    if not isinstance(call, dict):
        return call
    piece = Piece("tool_call", ("call", i, k), i)
    out = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict):
        out["function"] = _mark_call_fields(fn, piece, codec, marks)
    else:  # some clients put name/arguments at the top level
        out = _mark_call_fields(out, piece, codec, marks)
    return out


def _mark_call_fields(fn: dict[str, Any], piece: Piece, codec: MarkerCodec, marks: Marks) -> dict[str, Any]:
    out = dict(fn)
    if isinstance(fn.get("name"), str):
        out["name"] = _wrap(fn["name"], piece, codec, marks)
    args = fn.get("arguments")
    if isinstance(args, str):
        out["arguments"] = _wrap(args, piece, codec, marks)
    elif isinstance(args, dict):
        out["arguments"] = _mark_leaves(args, piece, codec, marks)
    return out


def _mark_leaves(obj: object, piece: Piece, codec: MarkerCodec, marks: Marks) -> object:
    if isinstance(obj, str):
        return _wrap(obj, piece, codec, marks)
    if isinstance(obj, dict):
        return {k: _mark_leaves(v, piece, codec, marks) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mark_leaves(v, piece, codec, marks) for v in obj]
    return obj


def mark_tool(tool: dict[str, Any], codec: MarkerCodec, marks: Marks, *, message: int) -> dict[str, Any]:
    """Mark a tool's name and description strings (any depth); templates may
    compare `type` or enum values, so those stay untouched."""
    # One block with the system message the schemas are rendered with.
    piece = Piece("inst", ("msg", message), message)

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


@dataclass(frozen=True, slots=True)
class ParseState:
    """Where parsing resumes: a marked-text position just after a marker, the plain
    characters before it, and the piece open there (-1: template text)."""

    marked: int = 0
    plain: int = 0
    current: int = -1


@dataclass(frozen=True, slots=True)
class Parsed:
    plain: str  # the plain text from the start state on
    chunks: list[Chunk]  # in plain-text positions counted from the text's start
    after: list[ParseState]  # per chunk: the state just after the marker that ends it


def parse_marked_from(marked: str, codec: MarkerCodec, state: ParseState) -> Parsed:
    """Strip the markers of ``marked`` from ``state`` on (``ParseState()``: the whole
    text); chunks of the plain text labelled with the open piece.

    Flat, not nested: an open marker ends any piece still open (pieces never
    contain each other; a template that cut off a close marker loses nothing
    more than that piece's end). Each marker is read on its own, so the text
    before a marker's end decides nothing after it: parsing from a state gives
    the chunks that parsing the whole text would give from there."""
    out: list[str] = []
    chunks: list[Chunk] = []
    after: list[ParseState] = []
    pos, length, current = state.marked, state.plain, state.current
    for m in codec.pattern.finditer(marked, pos):
        if m.start() > pos:
            seg = marked[pos : m.start()]
            out.append(seg)
            chunks.append((length, length + len(seg), current))
            length += len(seg)
        current = codec.piece_id(m.group(1)) if m.group(1) is not None else -1
        pos = m.end()
        if chunks and len(after) < len(chunks):
            after.append(ParseState(pos, length, current))
    if pos < len(marked):
        seg = marked[pos:]
        out.append(seg)
        chunks.append((length, length + len(seg), current))
        after.append(ParseState(len(marked), length + len(seg), current))
    return Parsed("".join(out), chunks, after)


def align(chunks: list[Chunk], plain: str, text: str) -> list[Chunk]:
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

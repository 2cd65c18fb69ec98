"""Generated text -> OpenAI message parts: stop strings, reasoning, tool calls.

- ``StopMatcher`` finds the first stop string in a stream of text pieces; it
  holds back a tail that could still become a stop string, and never emits
  the stop string itself (OpenAI's behaviour).
- ``OutputParser`` splits Qwen/Hermes-style output into OpenAI deltas:
  ``<think>...</think>`` -> ``reasoning_content``; with tools in the request,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` -> ``tool_calls``
  (a body that is not such JSON stays content); the rest -> ``content``.
  With ``max_calls`` (``parallel_tool_calls: false``) the calls past the limit
  are dropped: the client asked for at most that many, and a call is not
  content.
  Markers split across pieces are handled by holding back a possible prefix.

Pure: no I/O.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def _held_prefix(text: str, markers: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class StopMatcher:
    """First match of any stop string over a stream of text pieces."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched)."""
        if not self.stops:
            return piece, False
        self.pending += piece
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            index = min(i for i, _ in hits)
            out, self.pending = self.pending[:index], ""
            return out, True
        keep = _held_prefix(self.pending, self.stops)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self, piece: str = "") -> str:
        out, self.pending = self.pending + piece, ""
        return out


@dataclass(slots=True)
class Parsed:
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class OutputParser:
    """Streaming split of generated text into content / reasoning / tool-call deltas."""

    def __init__(self, *, tools: bool, max_calls: int | None = None) -> None:
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be >= 1 or None, got {max_calls}")
        self.tools = tools
        self.max_calls = max_calls
        self.buffer = ""
        self.mode = "content"  # "content" | "reasoning" | "call"
        self.call_text = ""
        self.calls: list[dict[str, Any]] = []
        self.strip_newline = False

    @property
    def saw_tool_calls(self) -> bool:
        return bool(self.calls)

    def _markers(self) -> list[str]:
        if self.mode == "reasoning":
            return [THINK_CLOSE]
        if self.mode == "call":
            return [CALL_CLOSE]
        return [THINK_OPEN] + ([CALL_OPEN] if self.tools else [])

    def feed(self, piece: str, *, final: bool = False) -> list[dict[str, Any]]:
        self.buffer += piece
        deltas: list[dict[str, Any]] = []
        if "<" not in self.buffer:  # every marker starts with "<": none here, nor the start of one
            text, self.buffer = self.buffer, ""
            self._emit(text, deltas)
            return deltas
        while True:
            markers = self._markers()
            hits = [(i, m) for m in markers if (i := self.buffer.find(m)) >= 0]
            if not hits:
                keep = 0 if final else _held_prefix(self.buffer, markers)
                text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                self._emit(text, deltas)
                return deltas
            index, marker = min(hits)
            self._emit(self.buffer[:index], deltas)
            self.buffer = self.buffer[index + len(marker) :]
            self._switch(marker, deltas)

    def finish(self) -> list[dict[str, Any]]:
        deltas = self.feed("", final=True)
        if self.mode == "call":  # an unterminated call: what was generated is content
            self._add(deltas, "content", CALL_OPEN + self.call_text)
            self.call_text, self.mode = "", "content"
        return deltas

    def parse(self, text: str) -> Parsed:
        deltas = self.feed(text) + self.finish()
        content = "".join(d.get("content", "") for d in deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas if "reasoning_content" in d)
        has_reasoning = any("reasoning_content" in d for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        for call in calls:
            call.pop("index", None)
        if calls:
            content = content.strip()
        return Parsed(content=content or (None if calls else ""), reasoning=reasoning if has_reasoning else None, tool_calls=calls)

    def _emit(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if self.strip_newline and text:  # the newlines the template puts after <think> and </think>
            text = text.lstrip("\n")
            self.strip_newline = not text
        if not text:
            return
        if self.mode == "call":
            self.call_text += text
        else:
            self._add(deltas, "reasoning_content" if self.mode == "reasoning" else "content", text)

    def _switch(self, marker: str, deltas: list[dict[str, Any]]) -> None:
        if marker == THINK_OPEN:
            self.mode = "reasoning"
            self.strip_newline = True
        elif marker == CALL_OPEN:
            self.mode, self.call_text = "call", ""
        elif marker == THINK_CLOSE:
            self.mode = "content"
            self.strip_newline = True
        elif marker == CALL_CLOSE:
            self.mode = "content"
            call = _tool_call(self.call_text, index=len(self.calls))
            if call is None:
                self._add(deltas, "content", CALL_OPEN + self.call_text + CALL_CLOSE)
            elif self.max_calls is not None and len(self.calls) >= self.max_calls:
                return  # past the client's limit: dropped
            else:
                self.calls.append(call)
                deltas.append({"tool_calls": [call]})

    @staticmethod
    def _add(deltas: list[dict[str, Any]], key: str, text: str) -> None:
        if deltas and list(deltas[-1]) == [key]:
            deltas[-1][key] += text
        else:
            deltas.append({key: text})


def _tool_call(body: str, *, index: int) -> dict[str, Any] | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
    }

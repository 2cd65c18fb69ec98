"""Streamed chat chunks: each ``ChatFrames`` frame is one SSE event whose JSON is the
``oa.chat_chunk`` (every kind of escape, lone surrogates included)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvserving.gateway import openai_types as oa
from kvserving.gateway.relay import ChatFrames
from kvserving.gateway.relay import sse as _sse

DELTAS: list[dict[str, Any]] = [
    {"role": "assistant", "content": ""},
    {"content": "plain text"},
    {"content": 'quotes " and \\ and \n newlines, é 日本 😀 \x00 \u2028'},
    {"reasoning_content": "thinking <think> & </think>"},
    {"content": "".join(map(chr, range(0, 0x3000, 7))) + "\udc80 \ud83d"},  # every kind of escape, lone surrogates
    {
        "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]
    },
    {},
]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("finish", [None, "stop", "length", "tool_calls"])
def test_frames_equal_whole_chunks(include_usage: bool, finish: str | None) -> None:
    frames = ChatFrames(id='chatcmpl-abc"def', created=1_700_000_000, model="tiny/é", include_usage=include_usage)
    for delta in DELTAS:
        chunk = oa.chat_chunk(
            id='chatcmpl-abc"def', created=1_700_000_000, model="tiny/é", delta=delta, finish_reason=finish, include_usage=include_usage
        )
        frame = frames.chunk(delta, finish)
        assert frame == _sse(chunk) and frame.startswith(b"data: ") and frame.endswith(b"\n\n")
        assert json.loads(frame[len(b"data: ") :]) == chunk and b"\n" not in frame[:-2]


def test_usage_frame_equals_the_usage_chunk() -> None:
    frames = ChatFrames(id="chatcmpl-1", created=5, model="m", include_usage=True)
    usage = oa.usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    assert frames.usage(usage) == _sse(oa.chat_chunk(id="chatcmpl-1", created=5, model="m", delta=None, usage=usage, include_usage=True))

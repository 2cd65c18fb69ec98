"""OutputParser streamed in arbitrary pieces gives what parsing the whole text
gives: content, reasoning and tool calls, whatever the split points (pieces
without any "<" take the fast path, pieces with a marker's start are held back)."""

from __future__ import annotations

import random
from typing import Any

from kvserving.gateway.output import OutputParser

TEXTS = [
    "plain answer with no markup at all",
    "<think>\nlet me think < about > it\n</think>\n\nThe answer is 4 < 5.",
    'Sure.\n<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>',
    "<think>a</think>b<tool_call>not json</tool_call> tail <thin",
    "x < y and <tool_c but no call, then </think> stray",
]


def streamed(text: str, rng: random.Random, *, max_calls: int | None = None, max_step: int = 6) -> dict[str, Any]:
    parser = OutputParser(tools=True, max_calls=max_calls)
    deltas: list[dict[str, Any]] = []
    pos = 0
    while pos < len(text):
        step = rng.randint(1, max_step)
        deltas += parser.feed(text[pos : pos + step])
        pos += step
    deltas += parser.finish()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])]
    return {
        "content": "".join(d.get("content", "") for d in deltas),
        "reasoning": "".join(d.get("reasoning_content", "") for d in deltas),
        "calls": calls,
    }


def test_any_split_streams_what_the_whole_text_parses_to() -> None:
    rng = random.Random(5)
    for text in TEXTS:
        whole = OutputParser(tools=True).parse(text)
        expected_content = whole.content or ""
        for _ in range(30):
            got = streamed(text, rng)
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
            assert got["calls"] == calls
            assert got["reasoning"] == (whole.reasoning or "")
            # parse() strips content around tool calls; streaming sends it as it comes
            assert (got["content"].strip() if calls else got["content"]) == expected_content


def test_max_calls_drops_the_calls_past_the_limit_whatever_the_split() -> None:
    two = (
        '<tool_call>\n{"name": "ls", "arguments": {"path": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "cat", "arguments": {"path": "b"}}\n</tool_call>'
    )
    parsed = OutputParser(tools=True, max_calls=1).parse(two)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == [("ls", '{"path": "a"}')]
    assert parsed.content is None
    assert len(OutputParser(tools=True).parse(two).tool_calls) == 2
    rng = random.Random(7)
    for _ in range(20):
        got = streamed(two, rng, max_calls=1, max_step=9)
        assert got["calls"] == [("ls", '{"path": "a"}')] and got["content"].strip() == ""

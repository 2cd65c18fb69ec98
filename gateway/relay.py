"""The relay stage: a turn's token batches become the client's response.

    Relay.items        token batches -> ("first", seconds to the first token),
                       ("text", [str, ...]) per batch, ("end", Ended): detokenized,
                       cut at stop strings, inter-token latency observed
                       (once, when the response ends)
    chat_whole,        items -> the OpenAI body, or its SSE frames (``EventStream``)
    chat_stream, ...

A streaming response's first frame is produced only once the first token has
arrived, so every failure before it is an HTTP error status; a failure after
it is an ``error`` event, then the stream closes. Stop strings are matched on
the detokenized text (text held back while it could still be the start of a
stop string); a match ends the response with ``finish_reason`` "stop" and
closes the worker stream (an abort upstream).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson

from . import openai_types as oa
from .detokenize import IncrementalDetokenizer
from .errors import GatewayError, upstream_error
from .metrics import GatewayMetrics
from .output import OutputParser, StopMatcher
from .prompt.tokenizer import TextTokenizer
from .turn import Turn, TurnResult

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True, frozen=True)
class Ended:
    """The turn's end: its finish reason, its result, and the reply as the client got it
    (text) and as the model sampled it (ids)."""

    finish: str
    result: TurnResult
    text: str
    ids: list[int]


# ("first", float) | ("text", list[str]) | ("end", Ended): tuples, built once per batch of tokens
Item = tuple[str, Any]


class Relay:
    """Token batches of a turn -> text items for the response (module docstring)."""

    def __init__(self, tokenizer: TextTokenizer, *, stop_token_ids: Sequence[int], metrics: GatewayMetrics) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.metrics = metrics

    async def items(self, turn: Turn, stops: list[str], started: float) -> AsyncGenerator[Item, None]:
        """The turn's items (module docstring)."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_ids=self.stop_token_ids)
        matcher = StopMatcher(stops)
        last = None
        finish: str | None = None
        # Inter-token gaps, observed when the response ends (one call, not one per token).
        gaps: list[float] = []
        zeros = 0
        try:
            async with aclosing(turn.tokens()) as batches:
                async for batch in batches:
                    now = time.perf_counter()
                    if last is None:
                        yield "first", now - started
                    else:
                        gaps.append(now - last)
                    zeros += len(batch) - 1  # the events of one batch arrived together
                    last = now
                    if not matcher.stops:
                        # No stop string can cut the batch: its ids are detokenized in one step
                        # (a batch is what queued while the gateway was busy: the cost per batch,
                        # not per token, is what keeps it from falling further behind).
                        text = detok.add([t for token_ids in batch for t in token_ids])
                        if text:
                            yield "text", [text]
                        continue
                    pieces: list[str] = []
                    for token_ids in batch:
                        emit, stopped = matcher.feed(detok.add(token_ids))
                        if emit:
                            pieces.append(emit)
                        if stopped:
                            finish = "stop"
                            break
                    if pieces:
                        yield "text", pieces
                    if finish is not None:
                        break  # leaving the `async with` closes the worker stream: abort upstream
            if finish is None:
                rest = matcher.flush(detok.flush())
                if rest:
                    yield "text", [rest]
                result = turn.result
                if result is None or result.finish_reason not in ("stop", "length"):
                    raise upstream_error(f"worker ended the request with finish_reason={getattr(result, 'finish_reason', None)!r}")
                finish = result.finish_reason
                completion_tokens = result.completion_tokens
            else:
                completion_tokens = detok.count
            final = turn.result or turn.ended_early()
            final.completion_tokens = completion_tokens
            self.metrics.prompt_tokens.inc(final.prompt_tokens)
            self.metrics.completion_tokens.inc(completion_tokens)
            yield "end", Ended(finish, final, detok.text, detok.ids)
        finally:
            self.metrics.itl.observe_many(gaps, zeros=zeros)


# ----------------------------------------------------------------- bodies
def usage_body(result: TurnResult) -> dict[str, Any]:
    body = oa.usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens, cached_tokens=result.cached_tokens)
    # kvserving's own breakdown (clients ignore unknown usage fields; the demo prints it)
    body["kvserving"] = {
        "local_cached_tokens": result.local_cached_tokens,
        "remote_pulled_tokens": result.remote_pulled_tokens,
        "computed_prompt_tokens": result.computed_prompt_tokens,
        "kv_bytes_moved": result.kv_bytes_moved,
        "reuse_fallback": result.reuse_fallback,
    }
    return body


async def _collect(items: AsyncIterator[Item]) -> tuple[str, Ended]:
    pieces: list[str] = []
    ended = None
    async for kind, value in items:
        if kind == "text":
            pieces += value
        else:
            ended = value
    assert ended is not None
    return "".join(pieces), ended


async def chat_whole(
    items: AsyncIterator[Item],
    *,
    id: str,
    model: str,  # noqa: A002
    request: oa.ChatCompletionRequest,
) -> dict[str, Any]:
    text, ended = await _collect(items)
    parsed = OutputParser(tools=request.parses_tool_calls, max_calls=request.max_tool_calls).parse(text)
    finish = "tool_calls" if parsed.tool_calls and ended.finish == "stop" else ended.finish
    message = oa.chat_message(content=parsed.content, reasoning=parsed.reasoning, tool_calls=parsed.tool_calls)
    return oa.chat_completion(
        id=id, created=int(time.time()), model=model, message=message, finish_reason=finish, usage=usage_body(ended.result)
    )


async def text_whole(items: AsyncIterator[Item], *, id: str, model: str) -> dict[str, Any]:  # noqa: A002
    text, ended = await _collect(items)
    return oa.completion(
        id=id, created=int(time.time()), model=model, text=text, finish_reason=ended.finish, usage=usage_body(ended.result)
    )


async def chat_stream(
    items: AsyncIterator[Item],
    *,
    id: str,
    model: str,  # noqa: A002
    request: oa.ChatCompletionRequest,
) -> AsyncGenerator[bytes, None]:
    """SSE frames; the frames of one batch of tokens go out as one write (the role frame
    with the first text; the last text with the finish and usage frames and ``[DONE]``,
    written once the turn's metrics are recorded)."""
    frames = ChatFrames(id=id, created=int(time.time()), model=model, include_usage=request.include_usage)
    parser = OutputParser(tools=request.parses_tool_calls, max_calls=request.max_tool_calls)
    first = True
    tail = b""
    try:
        async for kind, value in items:
            out: list[bytes] = []
            if first:
                first = False
                out.append(frames.chunk({"role": "assistant", "content": ""}))
            if kind == "text":
                for text in value:
                    out += [frames.chunk(delta) for delta in parser.feed(text)]
            else:
                out += [frames.chunk(delta) for delta in parser.finish()]
                finish = "tool_calls" if parser.saw_tool_calls and value.finish == "stop" else value.finish
                out.append(frames.chunk({}, finish))
                if request.include_usage:
                    out.append(frames.usage(usage_body(value.result)))
                tail = b"".join(out)
                continue
            if out:
                yield b"".join(out)
        yield tail + SSE_DONE
    except GatewayError as exc:
        if first:
            raise
        yield sse(exc.to_body())


async def text_stream(
    items: AsyncIterator[Item],
    *,
    id: str,
    model: str,  # noqa: A002
    request: oa.CompletionRequest,
) -> AsyncGenerator[bytes, None]:
    created, usage_on = int(time.time()), request.include_usage

    def chunk(text: str | None, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
        return sse(
            oa.completion_chunk(id=id, created=created, model=model, text=text, finish_reason=finish, usage=usage, include_usage=usage_on)
        )

    first = True
    tail = b""
    try:
        async for kind, value in items:
            first = False
            if kind == "text":
                yield b"".join(chunk(text) for text in value)
                continue
            tail = chunk("", value.finish) + (chunk(None, usage=usage_body(value.result)) if usage_on else b"")
        yield tail + SSE_DONE
    except GatewayError as exc:
        if first:
            raise
        yield sse(exc.to_body())


# ------------------------------------------------------------------ SSE
@dataclass(slots=True)
class EventStream:
    """A streamed response: its first SSE frame, already produced, and the generator of the rest
    (the sender iterates it and closes it, which closes the worker request). A frame that ends
    with ``SSE_DONE`` is the last."""

    first: bytes
    rest: AsyncGenerator[bytes, None]


async def first_then_rest(frames: AsyncGenerator[bytes, None]) -> EventStream:
    """Pull the first frame now (errors before it stay HTTP errors); the rest is pulled as it is sent."""
    return EventStream(first=await anext(frames), rest=frames)


class ChatFrames:
    """The SSE chunks of one streamed chat response (its id, creation time and model)."""

    def __init__(self, *, id: str, created: int, model: str, include_usage: bool) -> None:  # noqa: A002
        self.id, self.created, self.model, self.include_usage = id, created, model, include_usage

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(
            oa.chat_chunk(
                id=self.id, created=self.created, model=self.model, delta=delta, finish_reason=finish, include_usage=self.include_usage
            )
        )

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The usage-only chunk (no choices)."""
        return sse(
            oa.chat_chunk(id=self.id, created=self.created, model=self.model, delta=None, usage=usage, include_usage=self.include_usage)
        )


def sse(obj: dict[str, Any]) -> bytes:
    """One SSE event of a JSON object (orjson: a streamed chunk whole in the time the standard
    encoder took for a pre-encoded template's delta; docs/performance-log/gateway.md)."""
    try:
        return b"data: " + orjson.dumps(obj) + b"\n\n"
    except TypeError:  # a lone surrogate has no UTF-8 form: the standard encoder's \u escape
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

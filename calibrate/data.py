"""Calibration text as tagged chat prompts, for ``kvserving calibrate`` and the fidelity bench.

A ``.jsonl`` file holds one chat request per line (``{"messages": [...], "tools": [...]}`` or a bare
message list); any other file is plain text, wrapped as chat requests: ``agent`` (``iter_agent_wrap``:
conversations of ``kvserving.agents.load``'s shape with the text standing in for every message) or
``pieces`` (``wrap_text``: 17 equal pieces of system prompt, user turns, reasoning, tool calls and
results). Every request is rendered by the gateway's chat template and tagged by its tagger, so the
tags are the real 56 classes; ``load_data`` does both lazily, in order, up to a token cap (a cap far
below a file's text stops early).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserving.agents.load import Dist, LoadSpec, agent
from kvserving.gateway.errors import GatewayError
from kvserving.gateway.prompt.tagger import ChatTagger

WRAPS = ("agent", "pieces")
READ_FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read part of a text file of the project.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}},
            "required": ["path"],
        },
    },
}
SYSTEM_PROMPT = "You are a careful engineer. Read the files you are given, reason about them and answer precisely.\n\n"


@dataclass(slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def wrap_text(text: str, *, name: str, piece_chars: int) -> list[ChatRequest]:
    """Plain text as agent conversations of 17 pieces of ``piece_chars`` characters each
    (the last conversation may be shorter); every piece of the text is used once."""
    if piece_chars < 1:
        raise ValueError(f"piece_chars must be >= 1, got {piece_chars}")
    pieces = [text[i : i + piece_chars] for i in range(0, len(text), piece_chars)]
    pieces = [p for p in pieces if p.strip()]
    out = []
    for start in range(0, len(pieces), 17):
        chunk = iter(pieces[start : start + 17])
        system = next(chunk, None)
        if system is None:
            break
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT + system}]
        offset = start * piece_chars
        for turn in range(4):
            parts = [next(chunk, None) for _ in range(4)]
            if parts[0] is None:
                break
            messages.append({"role": "user", "content": parts[0]})
            if parts[1] is None:
                break
            call = {"type": "function", "function": {"name": "read_file", "arguments": {"path": name, "offset": offset + turn}}}
            messages.append({"role": "assistant", "reasoning_content": parts[1], "content": "", "tool_calls": [call]})
            if parts[2] is None:
                break
            messages.append({"role": "tool", "content": parts[2]})
            if parts[3] is None:
                break
            messages.append({"role": "assistant", "content": parts[3]})
        out.append(ChatRequest(messages, [READ_FILE_TOOL]))
    return out


def agent_wrap(text: str, *, name: str, chars_per_token: float, context_tokens: int, seed: int = 0) -> list[ChatRequest]:
    """Every conversation ``iter_agent_wrap`` gives, as a list."""
    return list(iter_agent_wrap(text, name=name, chars_per_token=chars_per_token, context_tokens=context_tokens, seed=seed))


def iter_agent_wrap(text: str, *, name: str, chars_per_token: float, context_tokens: int, seed: int = 0) -> Iterator[ChatRequest]:
    """Plain text as agent conversations of ``kvserving.agents.load``'s shape (module docstring),
    each planned to fill about 85% of ``context_tokens``; the text is used once, in order.

    Agent ``i`` is ``agent_load.agent(LoadSpec(seed, long_context=True), i)`` with every
    message's words replaced by as many tokens' worth of the text (``chars_per_token``): the
    system prompt, user messages and tool results; the reply quotes a span of the latest tool
    result or user message (an agent copying what it read) and calls the turn's tool with the
    file name and offset as its argument. Conversations stop when the text runs out."""
    if chars_per_token <= 0 or context_tokens < 64:
        raise ValueError(f"chars_per_token must be > 0 and context_tokens >= 64, got {chars_per_token}, {context_tokens}")
    # the checks above at the call, the conversations as they are asked for (load_data stops at its token cap)
    return _agent_conversations(text, name=name, chars_per_token=chars_per_token, context_tokens=context_tokens, seed=seed)


def _agent_conversations(text: str, *, name: str, chars_per_token: float, context_tokens: int, seed: int) -> Iterator[ChatRequest]:
    ctx = max(64, int(context_tokens * 0.85))
    # agent_load's default lengths (made for 4K+ contexts), scaled down for shorter ones
    f = min(1.0, ctx / 4096)
    spec = LoadSpec(
        seed=seed,
        long_context=True,
        max_context_tokens=ctx,
        system_tokens=Dist("uniform", 300 * f, 100 * f, 1),
        num_tools=Dist("uniform", 4, 2, 1, max(1, round(6 * f))),
        tool_description_tokens=Dist("uniform", 20 * f, 10 * f, 1),
        user_tokens=Dist("lognormal", 60, 0.6, 4, 600 * f),
        tool_result_tokens=Dist("lognormal", 150, 0.8, 4, 2000 * f),
    )
    rng = random.Random(f"kvserving-calibrate:{seed}:{name}")
    pos = 0

    def take(tokens: int) -> str | None:
        nonlocal pos
        n = max(1, round(tokens * chars_per_token))
        if pos >= len(text):
            return None
        piece, pos = text[pos : pos + n], pos + n
        return piece if piece.strip() else piece + "."

    given = 0
    i = 0
    while pos < len(text):
        a = agent(spec, i)
        i += 1
        if not a.turns:
            if i >= 20 and (not given or i > 100 * given):
                break  # the context is too short for this shape's system prompt and tool schemas
            continue
        system = take(len(a.system.split()))
        if system is None:
            break
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        call_id = ""
        for turn in a.turns:
            words = turn.user if turn.user is not None else turn.tool_result
            new = take(len((words or "x").split()))
            if new is None:
                break
            if turn.tool_result is not None:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": new})
            else:
                messages.append({"role": "user", "content": new})
            n = min(len(new), max(1, round(turn.output_tokens * chars_per_token)))
            start = rng.randrange(0, len(new) - n + 1)
            reply: dict[str, Any] = {"role": "assistant", "content": new[start : start + n]}
            if turn.tool_call is not None:
                call_id = turn.tool_call.id
                args = json.dumps({"arg": f"{name}:{pos}"})
                reply["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": turn.tool_call.name, "arguments": args}}]
            messages.append(reply)
        if len(messages) > 1:
            given += 1
            yield ChatRequest(messages, list(a.tools))


def read_requests(
    path: Path, *, piece_chars: int, wrap: str = "pieces", chars_per_token: float = 3.0, context_tokens: int = 2048
) -> list[ChatRequest]:
    """The chat requests of one data file (module docstring). OSError if unreadable; ValueError on bad JSONL."""
    return list(iter_requests(path, piece_chars=piece_chars, wrap=wrap, chars_per_token=chars_per_token, context_tokens=context_tokens))


def iter_requests(
    path: Path, *, piece_chars: int, wrap: str = "pieces", chars_per_token: float = 3.0, context_tokens: int = 2048
) -> Iterator[ChatRequest]:
    """``read_requests``' requests; agent-wrapped text is wrapped as the requests are asked for."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        if not text.strip():
            raise ValueError(f"data file {path} is empty")
        if wrap == "agent":
            return iter_agent_wrap(text, name=path.name, chars_per_token=chars_per_token, context_tokens=context_tokens)
        return iter(wrap_text(text, name=path.name, piece_chars=piece_chars))
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON: {exc.msg}") from None
        if isinstance(obj, list):
            obj = {"messages": obj}
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            raise ValueError(f'{path}:{n}: expected {{"messages": [...]}} or a list of messages')
        out.append(ChatRequest(obj["messages"], obj.get("tools")))
    if not out:
        raise ValueError(f"data file {path} holds no chat requests")
    return iter(out)


@dataclass(slots=True)
class TaggedSeq:
    ids: list[int]
    tags: list[int]


def iter_tagged(tagger: ChatTagger, requests: Iterable[ChatRequest], *, max_tokens: int, where: str) -> Iterator[TaggedSeq]:
    """Render and tag each request, one at a time (the caller may stop early); a prompt longer than
    ``max_tokens`` keeps its last ``max_tokens`` tokens (the current turn, which a long context ends with)."""
    for i, req in enumerate(requests):
        try:
            prompt = tagger.build(req.messages, tools=req.tools, add_generation_prompt=False)
        except GatewayError as exc:
            raise ValueError(f"{where} request {i}: {exc.message}") from None
        ids, tags = prompt.input_ids[-max_tokens:], prompt.tags[-max_tokens:]
        if len(ids) >= 2:
            yield TaggedSeq(ids, tags)


def chars_per_token(tagger: ChatTagger, sample: str) -> float:
    probe = sample[:20_000] or "x"
    return len(probe) / max(1, len(tagger.tokenizer.encode_ids(probe)))


def piece_chars_for(tagger: ChatTagger, sample: str, max_tokens: int) -> int:
    """Characters per piece so that a wrapped conversation (17 pieces plus template) fits ``max_tokens``."""
    return max(8, int(max_tokens * 0.85 / 17 * chars_per_token(tagger, sample)))


def load_data(paths: Sequence[Path], tagger: ChatTagger, *, seq_len: int, max_tokens: int, wrap: str = "agent") -> list[TaggedSeq]:
    """Tagged prompts from ``paths``, in order, until ``max_tokens`` tokens. Plain text is
    wrapped (``wrap``: "agent" or "pieces", module docstring) so that a whole conversation
    fits ``seq_len`` tokens."""
    if wrap not in WRAPS:
        raise ValueError(f"wrap must be one of {WRAPS}, got {wrap!r}")
    for path in paths:
        if not path.is_file():
            raise ValueError(f"data file {path} does not exist" if not path.exists() else f"data file {path} is not a file")
    seqs: list[TaggedSeq] = []
    total = 0
    for path in paths:
        sample = path.read_text(encoding="utf-8", errors="replace")[:20_000]
        piece = piece_chars_for(tagger, sample, seq_len)
        cpt = chars_per_token(tagger, sample)
        # requests are wrapped and tagged as they are needed: a cap far below the file's text stops early
        head: ChatRequest | None = None
        requests: Iterator[ChatRequest] = iter(())
        if wrap == "agent" or path.suffix == ".jsonl":
            given = iter_requests(path, piece_chars=piece, wrap=wrap, chars_per_token=cpt, context_tokens=seq_len)
            head = next(given, None)
            requests = itertools.chain([head], given) if head is not None else iter(())
        if path.suffix != ".jsonl" and (wrap == "pieces" or head is None):
            # pieces (asked for, or a context too short for an agent's system prompt and tool schemas):
            # shrink them until the first conversation fits
            listed = read_requests(path, piece_chars=piece)
            for _ in range(6):
                first = tagger.build(listed[0].messages, tools=listed[0].tools, add_generation_prompt=False)
                if len(first.input_ids) <= seq_len or piece <= 8:
                    break
                piece = max(8, int(piece * seq_len / len(first.input_ids) * 0.95))
                listed = read_requests(path, piece_chars=piece)
            requests = iter(listed)
        for seq in iter_tagged(tagger, requests, max_tokens=seq_len, where=str(path)):
            if total >= max_tokens:
                return seqs
            seqs.append(seq)
            total += len(seq.ids)
    return seqs

"""Agent shapes for ``kvserving simulate``: ``agent_load.agent``'s lengths and think times
without its text.

The simulator reads only an agent's token counts and think times, but ``agent_load.agent``
draws every word of it (1-15 ms per agent: ~3-4 s of a 10K-agent hour, per format).
``agent_shape(spec, i)`` consumes agent ``i``'s random stream exactly as ``agent`` does,
draw for draw and in the same order; only the words are skipped in bulk: ``random.choice``
over ``WORDS`` takes the top ``k`` bits of one 32-bit Mersenne Twister output per try and
retries while they index past the list, so ``n`` words are replayed on the raw outputs
(``getrandbits(32 m)`` hands out ``m`` of them at once) until ``n`` tries have landed. Every
length, think time and later draw is therefore ``agent``'s; the text fields stay empty
(``user``/``tool_result`` "" for the kind of message, ``tool_call`` None, ``system`` "",
``tools`` ()). tests/test_simulate.py holds it equal to ``agent`` field by field.
"""

from __future__ import annotations

import random

from kvserving.agents.load import (
    CALL_TOKENS,
    GENERATION_PROMPT_TOKENS,
    REPLY_TOKENS,
    TEMPLATE_TOKENS,
    TOOL_NAMES,
    TOOL_RESULT_TOKENS,
    TOOL_SCHEMA_TOKENS,
    TOOLS_HEADER_TOKENS,
    WORDS,
    AgentSpec,
    LoadSpec,
    TurnSpec,
)

_BITS = len(WORDS).bit_length()  # random.choice's draw: getrandbits(_BITS), retried while >= len(WORDS)
# 1 where a 32-bit output's top byte holds an accepted draw (bytes.translate + count: no Python loop)
_ACCEPT = bytes(1 if (b >> (8 - _BITS)) < len(WORDS) else 0 for b in range(256)) if _BITS <= 8 else b""


def _skip_words(rng: random.Random, n: int) -> int:
    """Advance ``rng`` as ``agent_load._text(rng, n)`` does; returns its word count."""
    words = max(n, 1)
    if not _ACCEPT:  # a word list past 256 entries: draw them
        for _ in range(words):
            rng.choice(WORDS)
        return words
    need = words
    while need:  # each output lands at most one word: never past the n-th
        raw = rng.getrandbits(32 * need).to_bytes(4 * need, "little")  # output j = bytes 4j..4j+3
        need -= raw[3::4].translate(_ACCEPT).count(1)
    return words


def _prefix_shape(spec: LoadSpec, rng: random.Random) -> tuple[int, int]:
    """``agent_load._prefix``: (nominal tokens of the system prompt and tools, number of tools)."""
    tokens = _skip_words(rng, spec.system_tokens.sample_int(rng)) + TEMPLATE_TOKENS + TOOLS_HEADER_TOKENS
    names = list(TOOL_NAMES)
    rng.shuffle(names)
    tools = len(names[: max(1, spec.num_tools.sample_int(rng))])
    for _ in range(tools):
        tokens += _skip_words(rng, spec.tool_description_tokens.sample_int(rng)) + TOOL_SCHEMA_TOKENS
    return tokens, tools


def agent_shape(spec: LoadSpec, i: int) -> AgentSpec:
    """Agent ``i`` of ``spec`` as ``agent_load.agent`` draws it, without the text (module docstring)."""
    if i < 0:
        raise ValueError(f"agent index must be >= 0, got {i}")
    rng = random.Random(f"kvserving-agent:{spec.seed}:{i}")
    prefix_rng = random.Random(f"kvserving-prefix:{spec.seed}") if spec.shared_system_prompt else rng
    prefix_tokens, tools = _prefix_shape(spec, prefix_rng)
    tool_index = range(tools)  # rng.choice over the tool names: only their number matters
    n_turns = 1 << 30 if spec.long_context else max(1, spec.turns.sample_int(rng))
    turns: list[TurnSpec] = []
    history = prefix_tokens
    pending: int | None = None  # the last reply's tool result length, when it called one
    for k in range(n_turns):
        if pending is None:
            new = _skip_words(rng, spec.user_tokens.sample_int(rng)) + TEMPLATE_TOKENS
        else:
            _skip_words(rng, pending)
            new = pending + TOOL_RESULT_TOKENS
        output = max(1, spec.output_tokens.sample_int(rng))
        call_tokens = 0
        result_tokens = 0
        called = rng.random() < spec.tool_call_prob
        if called:
            call_tokens = _skip_words(rng, spec.tool_args_tokens.sample_int(rng)) + CALL_TOKENS
            rng.choice(tool_index)
            result_tokens = max(1, spec.tool_result_tokens.sample_int(rng))
        think = spec.think_time_s.sample(rng) if k > 0 else 0.0
        prompt = history + new + GENERATION_PROMPT_TOKENS
        if prompt + output > spec.max_context_tokens:
            break
        history += new
        turns.append(
            TurnSpec(
                index=k,
                user="" if pending is None else None,
                tool_result=None if pending is None else "",
                output_tokens=output,
                tool_call=None,
                think_time_s=think,
                new_tokens=new,
                history_tokens=prompt,
                call_tokens=call_tokens,
            )
        )
        history += output + call_tokens + REPLY_TOKENS
        pending = result_tokens if called else None
    return AgentSpec(agent_id=i, session_id=f"agent-{spec.seed}-{i}", system="", tools=(), prefix_tokens=prefix_tokens, turns=tuple(turns))

"""A seeded population of LLM agents: what each agent sends, turn by turn.

Pure (no torch, no I/O, no clock): the benchmark on the real stack
(``bench/agents.py``) and the cluster simulator (``kvserving simulate``) draw
the same agents from the same ``LoadSpec``, so their numbers describe the same
traffic.

An agent is one conversation: a system prompt followed by tool schemas, then
turns. Each turn is one chat request carrying the whole history (as agent
clients resend it) plus what arrived since the last reply: a user message
(first turn, or after a reply without a tool call) or the result of the tool
the previous reply called. The model's reply is the assistant's reasoning; the
agent attaches the turn's scripted tool call to it, as a tool-using model
would emit::

    system+tools | user | reply+call_1 | result_1 | reply+call_2 | result_2 | reply | user | ...
    '------------ turn 1 -------------' '-- turn 2 -------------' '- turn 3 --' '- turn 4 ...

Lengths are in tokens. Text is built from ``WORDS``, English words that are
each one token after a space in the built-in tiny model's byte-level BPE (a
test holds this), so an n-token draw is n words; JSON punctuation of tool
calls and schemas and the chat template's delimiters come on top (the real
count is what the server reports in ``usage``); the nominal counts add the
template costs measured on the tiny model (``TEMPLATE_TOKENS`` and below) and
land within about 10% of the rendered prompt. For another tokenizer the same
text is roughly 1-1.3 tokens a word.

Determinism: agent ``i`` of a spec depends only on (``spec.seed``, ``i``) and
the spec's distributions, never on other agents or the order they are drawn.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvserving.config import ReuseConfig

DIST_KINDS = ("fixed", "uniform", "exponential", "lognormal")

# One token each after a space in the tiny model's tokenizer (tests/test_agent_load.py).
WORDS: tuple[str, ...] = tuple(
    """
the a an of to in is it for on with as by at or be this that from are not if can value file name list line
return default error type data object string number first last each new text code result test read call key
path function class method set get time should must will when then else only more same other all any one two
before after values item items check count size start end lines output input options option module case run
field fields arguments argument names found empty files directory index format width state source match
pattern parse print update remove add copy close open user version token message body order sort filter group
block cache length range flag local current next previous left right top second part parts entry entries tree
child parent root base main we you they there here where how what which because but so also just still now use
used using make need want see look find try keep change fix passed correct good
""".split()
)

# Tool names agents are given (the first ``num_tools`` of a shuffled copy).
TOOL_NAMES: tuple[str, ...] = (
    "read_file",
    "list_files",
    "run_python",
    "grep_repo",
    "edit_file",
    "run_tests",
    "web_search",
    "git_diff",
    "open_url",
    "ask_user",
    "write_file",
    "run_shell",
)


@dataclass(slots=True, frozen=True)
class Dist:
    """A length or time distribution, clipped to [``low``, ``high``].

    ``fixed``: always ``mean``. ``uniform``: on [mean - spread, mean + spread].
    ``exponential``: mean ``mean``. ``lognormal``: mean ``mean`` before
    clipping, shape ``spread`` (sigma of the log). Clipping moves the mean;
    ``Dist.mean`` is the parameter, a test bounds the sample mean.
    """

    kind: str = "fixed"
    mean: float = 0.0
    spread: float = 0.0
    low: float = 0.0
    high: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"Dist.kind must be one of {DIST_KINDS}, got {self.kind!r}")
        if self.mean < 0 or self.spread < 0 or self.low < 0:
            raise ValueError(f"Dist mean, spread and low must be >= 0, got {self.mean}, {self.spread}, {self.low}")
        if self.high < self.low:
            raise ValueError(f"Dist.high ({self.high}) must be >= Dist.low ({self.low})")
        if self.kind == "uniform" and self.spread > self.mean:
            raise ValueError(f"Dist.spread ({self.spread}) must be <= Dist.mean ({self.mean}) for uniform")
        if self.kind in ("exponential", "lognormal") and self.mean == 0:
            raise ValueError(f"Dist.mean must be > 0 for {self.kind}")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            x = self.mean
        elif self.kind == "uniform":
            x = rng.uniform(self.mean - self.spread, self.mean + self.spread)
        elif self.kind == "exponential":
            x = rng.expovariate(1.0 / self.mean)
        else:
            # E[exp(N(mu, s^2))] = exp(mu + s^2/2) = mean
            x = rng.lognormvariate(math.log(self.mean) - self.spread**2 / 2, self.spread)
        return min(max(x, self.low), self.high)

    def sample_int(self, rng: random.Random) -> int:
        return int(round(self.sample(rng)))


def fixed(value: float) -> Dist:
    return Dist("fixed", value, 0.0, value, value)


@dataclass(slots=True, frozen=True)
class LoadSpec:
    """The agent population. Token lengths per part of a turn, think time in seconds.

    ``output_tokens`` is each request's ``max_tokens`` (the reply is the
    assistant's reasoning). ``tool_call_prob`` is the chance a reply calls a
    tool (then the next turn carries its result instead of a user message).
    ``shared_system_prompt``: every agent gets the same system prompt and
    tools (one product's agents), else each agent its own. Histories never
    exceed ``max_context_tokens`` (nominal tokens, with ``TEMPLATE_TOKENS`` per
    message): an agent ends before a turn that would. ``long_context``: agents
    ignore ``turns`` and run until the next turn would not fit, so histories
    reach the model's context.
    """

    seed: int = 0
    system_tokens: Dist = Dist("uniform", 300, 100, 1)
    num_tools: Dist = Dist("uniform", 4, 2, 1, len(TOOL_NAMES))
    tool_description_tokens: Dist = Dist("uniform", 20, 10, 1)
    turns: Dist = Dist("uniform", 8, 4, 1)
    user_tokens: Dist = Dist("lognormal", 60, 0.6, 4, 600)
    output_tokens: Dist = Dist("uniform", 12, 4, 1)
    tool_call_prob: float = 0.7
    tool_args_tokens: Dist = Dist("uniform", 12, 6, 1)
    tool_result_tokens: Dist = Dist("lognormal", 150, 0.8, 4, 2000)
    think_time_s: Dist = Dist("exponential", 1.0, 0.0, 0.0, 10.0)
    shared_system_prompt: bool = False
    long_context: bool = False
    max_context_tokens: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 <= self.tool_call_prob <= 1.0:
            raise ValueError(f"LoadSpec.tool_call_prob must be in [0, 1], got {self.tool_call_prob}")
        if self.max_context_tokens < 64:
            raise ValueError(f"LoadSpec.max_context_tokens must be >= 64, got {self.max_context_tokens}")
        if self.turns.low < 1:
            raise ValueError(f"LoadSpec.turns.low must be >= 1, got {self.turns.low}")
        if self.output_tokens.low < 1:
            raise ValueError(f"LoadSpec.output_tokens.low must be >= 1, got {self.output_tokens.low}")


# Nominal template costs, measured on the built-in tiny model's Qwen-style chat
# template and tokenizer (tests/test_agent_load.py holds nominal to rendered):
TEMPLATE_TOKENS = 5  # one system/user message around its words: <|im_start|>role\n ... <|im_end|>\n
TOOL_RESULT_TOKENS = 9  # a tool message: its turn plus <tool_response> ... </tool_response>
REPLY_TOKENS = 7  # the assistant message around the reply, in the history
CALL_TOKENS = 24  # a tool call around its argument words: <tool_call>{"name": .., "arguments": ..}</tool_call>
TOOLS_HEADER_TOKENS = 83  # the template's tools preamble, once when tools are offered
TOOL_SCHEMA_TOKENS = 67  # one tool's JSON schema around its description words
GENERATION_PROMPT_TOKENS = 5  # <|im_start|>assistant\n ... at the end of every request


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


@dataclass(slots=True, frozen=True)
class TurnSpec:
    """One request of an agent. ``user``/``tool_result`` is what arrived since the last reply.

    ``tool_call`` is attached to this turn's reply; ``tool_result`` is the
    previous turn's call's result. ``*_tokens`` are nominal (words plus the
    template costs above, see the module docstring): ``history_tokens`` is
    this request's whole prompt; the next turn's is this one's plus
    ``output_tokens + call_tokens + REPLY_TOKENS`` (the reply) plus its own
    ``new_tokens``. ``think_time_s`` is the pause before sending the turn (0
    on turn 0).
    """

    index: int
    user: str | None
    tool_result: str | None
    output_tokens: int
    tool_call: ToolCall | None
    think_time_s: float
    new_tokens: int  # the user message or tool result, with its template tokens
    history_tokens: int  # the whole prompt of this request
    call_tokens: int  # the tool call the agent attaches to the reply (0 without one)


@dataclass(slots=True, frozen=True)
class AgentSpec:
    agent_id: int
    session_id: str
    system: str
    tools: tuple[dict[str, Any], ...]
    prefix_tokens: int  # nominal system prompt + tool schemas
    turns: tuple[TurnSpec, ...]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))


def _prefix(spec: LoadSpec, rng: random.Random) -> tuple[str, tuple[dict[str, Any], ...], int]:
    system = _text(rng, spec.system_tokens.sample_int(rng))
    names = list(TOOL_NAMES)
    rng.shuffle(names)
    tools: list[dict[str, Any]] = []
    tokens = len(system.split()) + TEMPLATE_TOKENS + TOOLS_HEADER_TOKENS
    for name in names[: max(1, spec.num_tools.sample_int(rng))]:
        description = _text(rng, spec.tool_description_tokens.sample_int(rng))
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
                },
            }
        )
        tokens += len(description.split()) + TOOL_SCHEMA_TOKENS
    return system, tuple(tools), tokens


def agent(spec: LoadSpec, i: int) -> AgentSpec:
    """Agent ``i`` of the population, a pure function of (spec, i)."""
    if i < 0:
        raise ValueError(f"agent index must be >= 0, got {i}")
    rng = random.Random(f"kvserving-agent:{spec.seed}:{i}")
    prefix_rng = random.Random(f"kvserving-prefix:{spec.seed}") if spec.shared_system_prompt else rng
    system, tools, prefix_tokens = _prefix(spec, prefix_rng)
    tool_names = [t["function"]["name"] for t in tools]
    n_turns = 1 << 30 if spec.long_context else max(1, spec.turns.sample_int(rng))
    turns: list[TurnSpec] = []
    history = prefix_tokens
    pending: tuple[ToolCall, int] | None = None  # the last reply's call and its result length
    for k in range(n_turns):
        user: str | None = None
        result: str | None = None
        if pending is None:
            user = _text(rng, spec.user_tokens.sample_int(rng))
            new = len(user.split()) + TEMPLATE_TOKENS
        else:
            result = _text(rng, pending[1])
            new = pending[1] + TOOL_RESULT_TOKENS
        output = max(1, spec.output_tokens.sample_int(rng))
        call: ToolCall | None = None
        call_tokens = 0
        result_tokens = 0
        if rng.random() < spec.tool_call_prob:
            args = _text(rng, spec.tool_args_tokens.sample_int(rng))
            call = ToolCall(id=f"call_{i}_{k}", name=rng.choice(tool_names), arguments=json.dumps({"arg": args}))
            call_tokens = len(args.split()) + CALL_TOKENS
            result_tokens = max(1, spec.tool_result_tokens.sample_int(rng))
        think = spec.think_time_s.sample(rng) if k > 0 else 0.0
        # The request must fit with its reply.
        prompt = history + new + GENERATION_PROMPT_TOKENS
        if prompt + output > spec.max_context_tokens:
            break
        history += new
        turns.append(
            TurnSpec(
                index=k,
                user=user,
                tool_result=result,
                output_tokens=output,
                tool_call=call,
                think_time_s=think,
                new_tokens=new,
                history_tokens=prompt,
                call_tokens=call_tokens,
            )
        )
        history += output + call_tokens + REPLY_TOKENS
        pending = (call, result_tokens) if call is not None else None
    return AgentSpec(
        agent_id=i, session_id=f"agent-{spec.seed}-{i}", system=system, tools=tools, prefix_tokens=prefix_tokens, turns=tuple(turns)
    )


def iter_turns(spec: LoadSpec, i: int) -> Iterator[TurnSpec]:
    """Agent ``i``'s turns in order (deterministic from ``spec.seed`` and ``i``)."""
    yield from agent(spec, i).turns


@dataclass(slots=True)
class Conversation:
    """The OpenAI ``messages`` an agent sends, grown turn by turn (the whole history each time).

    ``request(turn)`` adds what arrived for ``turn`` (the last call's result,
    a user message) and returns the messages to send; ``reply(turn, text)``
    records the model's reply with the turn's tool call. Messages are plain
    dicts in the wire shape.
    """

    spec: AgentSpec
    messages: list[dict[str, Any]] = field(default_factory=list)
    _next: int = 0
    _call: ToolCall | None = None

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": self.spec.system})

    @property
    def tools(self) -> list[dict[str, Any]]:
        return list(self.spec.tools)

    def request(self, turn: TurnSpec) -> list[dict[str, Any]]:
        if turn.index != self._next:
            raise ValueError(f"turn {turn.index} requested, expected turn {self._next}")
        if turn.tool_result is not None:
            if self._call is None:
                raise ValueError(f"turn {turn.index} carries a tool result but no tool was called")
            self.messages.append({"role": "tool", "tool_call_id": self._call.id, "content": turn.tool_result})
        if turn.user is not None:
            self.messages.append({"role": "user", "content": turn.user})
        return list(self.messages)

    def reply(self, turn: TurnSpec, text: str) -> None:
        if turn.index != self._next:
            raise ValueError(f"reply to turn {turn.index}, expected turn {self._next}")
        assistant: dict[str, Any] = {"role": "assistant", "content": text}
        call = self._call = turn.tool_call
        if call is not None:
            assistant["tool_calls"] = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
        self.messages.append(assistant)
        self._next += 1


# Reuse modes the agent benchmark compares (and the simulator replays for validation):
# leases (the default retention, renewed while a conversation is active), a fixed
# short retention TTL, and bidirectional reuse off.
REUSE_MODES = ("lease", "ttl", "off")


def reuse_for_mode(mode: str, *, ttl_s: float) -> ReuseConfig:
    """The workers' reuse config for one of ``REUSE_MODES``."""
    if mode == "lease":
        return ReuseConfig()
    if mode == "ttl":
        return ReuseConfig(retention_ttl_s=ttl_s, lease_ttl_s=ttl_s / 2)
    if mode == "off":
        return ReuseConfig(bidirectional=False)
    raise ValueError(f"mode must be one of {REUSE_MODES}, got {mode!r}")

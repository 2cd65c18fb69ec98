"""The agent population generator: deterministic per (seed, agent), distributions
hold their stated means, histories respect the context, messages are valid."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvserving.agents.load import (
    WORDS,
    AgentSpec,
    Conversation,
    Dist,
    LoadSpec,
    TurnSpec,
    agent,
    fixed,
    iter_turns,
)


def test_agent_is_a_pure_function_of_seed_and_index() -> None:
    spec = LoadSpec(seed=7)
    forward = [agent(spec, i) for i in range(6)]
    backward = [agent(spec, i) for i in reversed(range(6))][::-1]
    assert forward == backward
    assert list(iter_turns(spec, 3)) == list(forward[3].turns)
    assert forward[0] != forward[1]
    assert agent(LoadSpec(seed=8), 0) != forward[0]
    assert forward[4].session_id == "agent-7-4"


@pytest.mark.parametrize(
    ("dist", "mean", "tolerance"),
    [
        (Dist("uniform", 8, 4, 1), 8.0, 0.1),
        (Dist("exponential", 1.0), 1.0, 0.03),
        (Dist("lognormal", 60, 0.6), 60.0, 1.5),
        (fixed(12), 12.0, 0.0),
    ],
)
def test_sample_means_match_the_parameter(dist: Dist, mean: float, tolerance: float) -> None:
    rng = random.Random(0)
    samples = [dist.sample(rng) for _ in range(20_000)]
    assert abs(statistics.fmean(samples) - mean) <= tolerance
    assert all(dist.low <= x <= dist.high for x in samples)


def test_clipping_bounds_every_sample() -> None:
    rng = random.Random(1)
    dist = Dist("lognormal", 150, 0.8, 4, 300)
    samples = [dist.sample_int(rng) for _ in range(5_000)]
    assert min(samples) >= 4 and max(samples) == 300
    assert statistics.fmean(samples) < 150  # clipping the long tail lowers the mean


def test_population_lengths_follow_the_spec() -> None:
    spec = LoadSpec(seed=3, max_context_tokens=1_000_000)  # nothing truncated by the context
    agents = [agent(spec, i) for i in range(400)]
    turns = [t for a in agents for t in a.turns]
    assert 7.6 <= statistics.fmean(len(a.turns) for a in agents) <= 8.4
    users = [len(t.user.split()) for t in turns if t.user is not None]
    assert 55 <= statistics.fmean(users) <= 65  # lognormal mean 60, clipped to [4, 600]
    calls = [t.tool_call is not None for t in turns]
    assert 0.66 <= statistics.fmean(calls) <= 0.74
    results = [len(t.tool_result.split()) for t in turns if t.tool_result is not None]
    assert 130 <= statistics.fmean(results) <= 160  # lognormal mean 150, clipped to [4, 2000]
    assert 11 <= statistics.fmean(t.output_tokens for t in turns) <= 13
    thinks = [t.think_time_s for t in turns if t.index > 0]
    assert 0.93 <= statistics.fmean(thinks) <= 1.07
    assert all(t.think_time_s == 0.0 for t in turns if t.index == 0)


def test_a_turn_carries_a_user_message_or_the_last_calls_result() -> None:
    for t_prev, t in _pairs(agent(LoadSpec(seed=2), 0)):
        if t_prev is None or t_prev.tool_call is None:
            assert t.user is not None and t.tool_result is None
        else:
            assert t.user is None and t.tool_result is not None


def _pairs(a: AgentSpec) -> list[tuple[TurnSpec | None, TurnSpec]]:
    previous: list[TurnSpec | None] = [None, *a.turns[:-1]]
    return list(zip(previous, a.turns))


def test_histories_stay_inside_the_context_and_long_context_fills_it() -> None:
    short = LoadSpec(seed=4, max_context_tokens=1024)
    for i in range(50):
        for t in agent(short, i).turns:
            assert t.history_tokens + t.output_tokens <= 1024
    long = replace(
        short,
        long_context=True,
        max_context_tokens=4096,
        user_tokens=fixed(50),
        tool_result_tokens=fixed(50),
        tool_args_tokens=fixed(5),
        output_tokens=fixed(10),
    )
    for i in range(20):
        a = agent(long, i)
        last = a.turns[-1]
        assert len(a.turns) > 12  # more than the `turns` distribution ever gives
        assert last.history_tokens + last.output_tokens <= 4096
        # it stopped because the next turn would not fit: reply, call and new message add under 120 tokens
        assert last.history_tokens > 4096 - 120


def test_shared_system_prompt_gives_every_agent_one_prefix() -> None:
    spec = LoadSpec(seed=5, shared_system_prompt=True)
    a, b = agent(spec, 0), agent(spec, 1)
    assert (a.system, a.tools) == (b.system, b.tools)
    assert a.turns != b.turns
    c, d = agent(replace(spec, shared_system_prompt=False), 0), agent(replace(spec, shared_system_prompt=False), 1)
    assert c.system != d.system


def test_words_are_one_token_each_for_the_tiny_model() -> None:
    from kvserving import tokenizer_data

    tokenizer = tokenizer_data.train_tokenizer()
    assert [w for w in WORDS if len(tokenizer.encode(" " + w).ids) != 1] == []


def test_conversation_resends_the_history_with_valid_tool_messages() -> None:
    spec = LoadSpec(seed=6, tool_call_prob=0.8)
    a = agent(spec, 2)
    conv = Conversation(a)
    previous: list[dict[str, object]] = []
    for t in a.turns:
        messages = conv.request(t)
        assert messages[0] == {"role": "system", "content": a.system}
        assert messages[: len(previous)] == previous  # the whole history, unchanged, every turn
        if t.tool_result is not None:
            assert messages[-1]["role"] == "tool" and messages[-1]["content"] == t.tool_result
            assert messages[-2]["role"] == "assistant"
            assert messages[-1]["tool_call_id"] == messages[-2]["tool_calls"][0]["id"]  # type: ignore[index]
        else:
            assert messages[-1] == {"role": "user", "content": t.user}
        conv.reply(t, f"reply {t.index}")
        previous = list(conv.messages)
        if t.tool_call is not None:
            call = conv.messages[-1]["tool_calls"][0]
            assert call["function"]["name"] in {tool["function"]["name"] for tool in a.tools}
            assert json.loads(call["function"]["arguments"])["arg"]
    assert any(t.tool_call is not None for t in a.turns)
    with pytest.raises(ValueError, match="expected turn"):
        conv.request(a.turns[0])


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="Dist.kind"):
        Dist("normal", 1.0)
    with pytest.raises(ValueError, match="spread"):
        Dist("uniform", 2.0, 3.0)
    with pytest.raises(ValueError, match="high"):
        Dist("fixed", 1.0, 0.0, 2.0, 1.0)
    with pytest.raises(ValueError, match="tool_call_prob"):
        LoadSpec(tool_call_prob=1.5)
    with pytest.raises(ValueError, match="turns.low"):
        LoadSpec(turns=Dist("uniform", 2, 1, 0))
    with pytest.raises(ValueError, match="agent index"):
        agent(LoadSpec(), -1)


def test_module_imports_no_torch() -> None:
    code = "import sys, kvserving.agents.load; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_nominal_history_grows_by_reply_and_new_message() -> None:
    from kvserving.agents.load import GENERATION_PROMPT_TOKENS, REPLY_TOKENS

    a = agent(LoadSpec(seed=9), 1)
    assert a.turns[0].history_tokens == a.prefix_tokens + a.turns[0].new_tokens + GENERATION_PROMPT_TOKENS
    for prev, t in zip(a.turns, a.turns[1:]):
        reply = prev.output_tokens + prev.call_tokens + REPLY_TOKENS
        assert t.history_tokens == prev.history_tokens + reply + t.new_tokens
        assert (prev.call_tokens > 0) == (prev.tool_call is not None)


def test_nominal_prompt_lengths_match_the_tiny_models_rendered_prompts(tmp_path: Path) -> None:
    """The generator's nominal ``history_tokens`` land within 3% of the prompt the gateway
    renders and tokenizes (replies of ``output_tokens`` words, as the tiny model's are counted)."""
    from kvserving.gateway.prompt.chat_template import ChatTemplate
    from kvserving.gateway.prompt.tagger import ChatTagger
    from kvserving.gateway.prompt.tokenizer import TextTokenizer
    from kvserving.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    tagger = ChatTagger(TextTokenizer.from_dir(model), ChatTemplate.from_dir(model))
    ratios = []
    for i in range(6):
        a = agent(LoadSpec(seed=1), i)
        conv = Conversation(a)
        for t in a.turns:
            rendered = len(tagger.build(conv.request(t), tools=conv.tools).input_ids)
            ratios.append(rendered / t.history_tokens)
            conv.reply(t, " ".join(WORDS[: t.output_tokens]))
    assert len(ratios) > 20
    assert 0.97 <= min(ratios) and max(ratios) <= 1.03

"""The gateway through the official `openai` client (sync, async, streaming)
in front of fake workers that speak docs/worker-api.md."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from kvs_poll import wait_until
from fake_worker import PAGE_SIZE
from gw_harness import MODEL, Stack
from prometheus_client import CollectorRegistry

from kvserving.config import GatewayConfig, ModelConfig, ServingConfig
from kvserving.gateway.app import build_state
from kvserving.gateway.prompt.chat_template import ChatTemplate, normalize_messages
from kvserving.gateway.completions import ModelInfo
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.tags import decode_tag

REPLY = "Hello from the fake worker, with several words."


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_model_dir)


def prompt_ids(model_dir: Path, tok: TextTokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
    text = ChatTemplate.from_dir(model_dir).render(normalize_messages(messages), tools=tools)
    return tok.encode_ids(text)


def client(gw, **kw) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=gw.base_url, api_key=kw.pop("api_key", "none"), max_retries=0, timeout=20, **kw)


def test_chat_sync_answers_the_workers_tokens_with_exact_usage(stack: Stack, tok: TextTokenizer, tiny_model_dir: Path) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url], prefill=[worker.url])
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    out = client(gw).chat.completions.create(model=MODEL, messages=messages, temperature=0)
    ids = prompt_ids(tiny_model_dir, tok, messages)
    assert out.choices[0].message.content == REPLY
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(reply)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    body = worker.received[-1]
    assert body["input_ids"] == ids
    tagged = ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir)).build(messages)
    assert body["tags"] == tagged.tags and len(body["tags"]) == len(ids)
    assert {decode_tag(t)[2] for t in body["tags"]} >= {"inst", "user", "delim"}
    assert body["sampling"]["temperature"] == 0
    # no session id: a key minted from the first user turn, and the KV is retained under it
    assert body["retain"] is True and body["conversation_key"].startswith("conv-")


def test_max_tokens_cut_is_length_and_max_completion_tokens_wins(stack: Stack, tok: TextTokenizer) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url])
    c = client(gw)
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3
    assert out.choices[0].message.content == tok.decode(reply[:3], skip_special_tokens=False)
    assert worker.received[-1]["sampling"]["max_tokens"] == 3
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, max_completion_tokens=5)
    assert worker.received[-1]["sampling"]["max_tokens"] == 5
    assert out.usage.completion_tokens == 5


def test_streaming_chunks_join_to_the_reply_and_usage_comes_last(stack: Stack, tok: TextTokenizer) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url])
    chunks = list(
        client(gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stream please"}], stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reply)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_async_client_concurrent_requests(stack: Stack, tok: TextTokenizer) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply, token_delay_s=0.01)
    gw = stack.gateway(decode=[worker.url])

    async def main() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=20)
        outs = await asyncio.gather(
            *(ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}]) for i in range(8))
        )
        await ac.close()
        return [o.choices[0].message.content or "" for o in outs]

    assert asyncio.run(main()) == [REPLY] * 8
    assert gw.metric("kvserving_gateway_requests_total", {"route": "/v1/chat/completions", "code": "200"}) == 8
    wait_until(lambda: gw.metric("kvserving_gateway_requests_in_flight") == 0)  # decremented after the last byte


def test_multi_turn_reports_cached_tokens_of_the_previous_turn(stack: Stack, tok: TextTokenizer, tiny_model_dir: Path) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url], prefill=[worker.url])
    c = client(gw)
    messages = [{"role": "system", "content": "You are a coding agent. " * 8}, {"role": "user", "content": "List the files."}]
    first = c.chat.completions.create(model=MODEL, messages=messages, extra_headers={"X-Session-ID": "s1"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert worker.received[-1]["conversation_key"] is not None and worker.received[-1]["retain"] is True
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Now read main.py."}]
    second = c.chat.completions.create(model=MODEL, messages=messages, extra_headers={"X-Session-ID": "s1"})
    # The fake keeps prompt + output of turn 1 as full pages; turn 2's prompt starts with them.
    turn1 = prompt_ids(tiny_model_dir, tok, messages[:2]) + reply
    turn2 = prompt_ids(tiny_model_dir, tok, messages)
    common = 0
    while common < min(len(turn1), len(turn2)) and turn1[common] == turn2[common]:
        common += 1
    assert second.usage.prompt_tokens == len(turn2)
    assert second.usage.prompt_tokens_details.cached_tokens == common // PAGE_SIZE * PAGE_SIZE > 0
    assert gw.metric("kvserving_gateway_kv_reused_tokens_total", {"source": "local"}) == common // PAGE_SIZE * PAGE_SIZE


def test_a_plain_client_resending_the_history_is_recognised_by_prefix(stack: Stack, tok: TextTokenizer) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url])
    c = client(gw)
    messages = [{"role": "system", "content": "You are a coding agent. " * 8}, {"role": "user", "content": "List the files."}]
    first = c.chat.completions.create(model=MODEL, messages=messages)
    key = worker.received[-1]["conversation_key"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Now read main.py."}]
    second = c.chat.completions.create(model=MODEL, messages=messages)
    assert worker.received[-1]["conversation_key"] == key
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    other = c.chat.completions.create(model=MODEL, messages=[messages[0], {"role": "user", "content": "Something else."}])
    assert worker.received[-1]["conversation_key"] != key  # a shared system prompt is not the same conversation
    assert other.usage.prompt_tokens_details.cached_tokens > 0  # ...but its pages are still reused
    assert gw.metric("kvserving_gateway_conversation_identities_total", {"source": "prefix"}) == 1
    assert gw.metric("kvserving_gateway_conversation_identities_total", {"source": "new"}) == 2


def test_stop_string_ends_the_reply_and_aborts_upstream(stack: Stack, tok: TextTokenizer) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply, token_delay_s=0.02)
    gw = stack.gateway(decode=[worker.url])
    out = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stop=["fake"])
    assert out.choices[0].message.content == "Hello from the "
    assert out.choices[0].finish_reason == "stop"
    rid = worker.received[-1]["request_id"]
    wait_until(lambda: rid in worker.aborted)
    assert out.usage.completion_tokens < len(reply)


def test_stream_stop_string_split_across_tokens(stack: Stack, tok: TextTokenizer) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url])
    chunks = list(
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stop="several words", stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the fake worker, with "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_client_disconnect_aborts_the_upstream_request(stack: Stack, tok: TextTokenizer) -> None:
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY) * 20, token_delay_s=0.05)
    gw = stack.gateway(decode=[worker.url])
    stream = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    next(iter(stream))
    stream.close()
    rid = worker.received[-1]["request_id"]
    wait_until(lambda: rid in worker.aborted)
    wait_until(lambda: gw.metric("kvserving_gateway_requests_in_flight") == 0)


def test_client_disconnect_before_the_first_token_aborts_too(stack: Stack, tok: TextTokenizer) -> None:
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY), token_delay_s=5.0)
    gw = stack.gateway(decode=[worker.url])
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=0.5).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    wait_until(lambda: bool(worker.received) and worker.received[-1]["request_id"] in worker.aborted)
    wait_until(lambda: gw.metric("kvserving_gateway_requests_total", {"route": "/v1/chat/completions", "code": "499"}) == 1)
    wait_until(lambda: gw.metric("kvserving_gateway_requests_in_flight") == 0)


def test_tools_and_reasoning_multi_turn(stack: Stack, tok: TextTokenizer, tiny_model_dir: Path) -> None:
    said = '<think>\nI should list the directory.\n</think>\n\n<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(said))
    gw = stack.gateway(decode=[worker.url])
    c = client(gw)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "ls",
                "description": "list a directory",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    messages: list[dict] = [{"role": "user", "content": "What is here?"}]
    out = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, prompt_cache_key="agent-1")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "I should list the directory.\n"  # type: ignore[attr-defined]
    call = choice.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("ls", '{"path": "."}')
    messages += [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should list the directory.",
            "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "ls", "arguments": call.function.arguments}}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "main.py\nREADME.md"},
    ]
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, prompt_cache_key="agent-1", stream=True, stream_options={"include_usage": True}
        )
    )
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [(0, "ls", '{"path": "."}')]
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
    assert reasoning == "I should list the directory.\n"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert worker.received[-1]["input_ids"] == prompt_ids(tiny_model_dir, tok, messages, tools)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_text_completions_sync_and_stream(stack: Stack, tok: TextTokenizer) -> None:
    reply = tok.encode_ids(REPLY)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url])
    c = client(gw)
    out = c.completions.create(model=MODEL, prompt="def main():", max_tokens=50)
    assert out.choices[0].text == REPLY and out.choices[0].finish_reason == "stop"
    assert worker.received[-1]["input_ids"] == tok.encode_ids("def main():")
    assert out.usage.prompt_tokens == len(tok.encode_ids("def main():"))
    chunks = list(c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == tok.decode(reply[:2], skip_special_tokens=False)
    assert worker.received[-1]["input_ids"] == [1, 2, 3]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_models_lists_the_served_model(stack: Stack) -> None:
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url])
    models = client(gw).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(gw).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client(gw).models.retrieve("gpt-4o")


def test_concurrent_identical_first_turns_are_different_conversations(stack: Stack, tok: TextTokenizer) -> None:
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY), token_delay_s=0.02)
    gw = stack.gateway(decode=[worker.url])

    async def main() -> None:
        ac = openai.AsyncOpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=20)
        await asyncio.gather(*(ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "same"}]) for _ in range(6)))
        await ac.close()

    asyncio.run(main())
    keys = [body["conversation_key"] for body in worker.received]
    assert len(set(keys)) == 6 and len(worker.leases) == 6


def test_tool_choice_none_leaves_tool_call_text_as_content(stack: Stack, tok: TextTokenizer) -> None:
    said = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(said))
    gw = stack.gateway(decode=[worker.url])
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
    out = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="none")
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == said


def test_parallel_tool_calls_false_returns_only_the_first_call(stack: Stack, tok: TextTokenizer) -> None:
    said = (
        '<tool_call>\n{"name": "ls", "arguments": {"path": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ls", "arguments": {"path": "b"}}\n</tool_call>'
    )
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(said))
    gw = stack.gateway(decode=[worker.url])
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
    c = client(gw)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": tools}
    both = c.chat.completions.create(**kwargs)
    assert [call.function.arguments for call in both.choices[0].message.tool_calls or []] == ['{"path": "a"}', '{"path": "b"}']
    one = c.chat.completions.create(**kwargs, parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls"
    assert [call.function.arguments for call in one.choices[0].message.tool_calls or []] == ['{"path": "a"}']
    chunks = list(c.chat.completions.create(**kwargs, parallel_tool_calls=False, stream=True))
    streamed = [call.function.arguments for ch in chunks for call in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert streamed == ['{"path": "a"}'] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_next_turn_sends_the_held_ids_the_workers_sampled(stack: Stack, tok: TextTokenizer, tiny_model_dir: Path) -> None:
    """A reply sampled as one token per character (not its canonical tokenization): the next
    turn's body starts with turn 1's ids + those very ids (exact history), every id as sent."""
    text = "Reading setup.py now."
    reply = [i for ch in text for i in tok.encode_ids(ch)]
    assert tok.decode(reply) == text and reply != tok.encode_ids(text)
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url])
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Read setup.py."}]
    c = client(gw)
    first = c.chat.completions.create(model=MODEL, messages=messages, extra_headers={"X-Session-ID": "held"})
    assert first.choices[0].message.content == text
    sent1 = worker.received[-1]["input_ids"]
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Now run the tests."}]
    second = c.chat.completions.create(model=MODEL, messages=messages, extra_headers={"X-Session-ID": "held"})
    body = worker.received[-1]
    held = sent1 + reply
    assert body["input_ids"][: len(held)] == held
    assert tok.decode(body["input_ids"], skip_special_tokens=False) == ChatTemplate.from_dir(tiny_model_dir).render(
        normalize_messages(messages)
    )
    assert len(body["tags"]) == len(body["input_ids"]) == second.usage.prompt_tokens


def test_the_config_bounds_what_the_gateway_keeps_between_turns(tiny_model_dir: Path) -> None:
    config = ServingConfig(
        model=ModelConfig(path=str(tiny_model_dir), served_name=MODEL),
        gateway=GatewayConfig(decode_urls=("http://127.0.0.1:9",), max_conversations=7, max_kept_tokens=1000),
    )
    model = ModelInfo.load(tiny_model_dir, served_name=MODEL, max_kept_tokens=config.gateway.max_kept_tokens)
    state = build_state(config, model=model, registry=CollectorRegistry())
    store, tagger = state.completions.store, state.model.tagger
    assert (store.max_conversations, store.max_tokens) == (7, 1000)
    # one store: the leases, identity, exact history and the tagger's kept prompts all live in its records
    assert state.keeper.table.store is store and state.completions.identities.store is store
    assert tagger.prefixes is not None and tagger.prefixes.kept is store
    assert tagger.renders is not None and tagger.renders.kept is store

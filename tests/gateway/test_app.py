"""The gateway through the official `openai` client (sync, async, streaming)
in front of fake workers that speak docs/worker-api.md."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fake_worker import PAGE_SIZE
from gw_harness import MODEL, Stack

from kvserving.gateway.chat_template import ChatTemplate, normalize_messages
from kvserving.gateway.tokenizer import TextTokenizer

REPLY = "Hello from the fake worker, with several words."


@pytest.fixture()
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    s = Stack(tiny_model_dir)
    try:
        yield s
    finally:
        s.close()


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
    assert body["sampling"]["temperature"] == 0
    assert body["retain"] is False and body["conversation_key"] is None

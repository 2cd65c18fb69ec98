"""The prompt stage through the gateway: one worker request per turn, with the ids of the
real render, also when a template inspects content (the marked render differs); later
turns mark only what they append; a huge prompt is prepared off the event loop while
other requests are served."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from gw_harness import MODEL, Stack
from test_tagger import EDITING_TEMPLATE

from kvserving.gateway.completions import OFF_LOOP_CHARS
from kvserving.gateway.prompt.chat_template import ChatTemplate, normalize_messages
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer

REPLY = "Fine, reading it now."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Please read the whole of setup.py and tell me what it installs."},
]


def _client(gw) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def editing_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a template that cuts user text at 12 characters (markers count)."""
    root = tmp_path_factory.mktemp("editing_model") / "model"
    shutil.copytree(tiny_model_dir, root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = EDITING_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_is_one_worker_request_with_the_real_ids(stack: Stack, tiny_model_dir: Path, stream: bool) -> None:
    tok = TextTokenizer.from_dir(tiny_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY))
    gw = stack.gateway(decode=[worker.url])
    out = _client(gw).chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream else out.choices[0].message.content
    assert text == REPLY
    real = ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir)).build(MESSAGES)
    assert len(worker.received) == 1
    assert worker.received[0]["input_ids"] == real.input_ids and worker.received[0]["tags"] == real.tags


@pytest.mark.parametrize("stream", [False, True])
def test_a_template_that_edits_content_gets_one_worker_request_with_the_real_ids(
    stack: Stack, editing_model_dir: Path, stream: bool
) -> None:
    tok = TextTokenizer.from_dir(editing_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY))
    gw = Stack(editing_model_dir)
    try:
        g = gw.gateway(decode=[worker.url])
        out = _client(g).chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = out.choices[0].message.content
        assert text == REPLY
        real_text = ChatTemplate(EDITING_TEMPLATE).render(normalize_messages(MESSAGES))
        # the marked render is not the real one with markers: the tags are aligned to the real text
        real = ChatTagger(tok, ChatTemplate(EDITING_TEMPLATE)).build(MESSAGES)
        assert real.method == "aligned" and real.input_ids == tok.encode_ids(real_text)
        assert len(worker.received) == 1
        assert worker.received[0]["input_ids"] == real.input_ids and worker.received[0]["tags"] == real.tags
        if not stream:  # the usage is the real prompt's
            assert out.usage.prompt_tokens == len(real.input_ids)
    finally:
        gw.close()


def test_later_turns_render_only_what_they_append_and_send_the_real_prompt(stack: Stack, tiny_model_dir: Path) -> None:
    """Four turns of one conversation through the gateway: from the third on the prompt is marked
    only in its last user turn (kept render), and every worker request carries exactly the ids
    and tags of a whole render."""
    tok = TextTokenizer.from_dir(tiny_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY))
    gw = stack.gateway(decode=[worker.url])
    client = _client(gw)
    real = ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir))
    messages = list(MESSAGES)
    for turn in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content
        assert reply == REPLY
        # the fake worker's reply ids are the reply's canonical tokenization, so the held ids
        # exact history sends are the whole render's too
        expected, sent = real.build(messages), worker.received[-1]
        assert sent["input_ids"] == expected.input_ids and sent["tags"] == expected.tags, turn
        messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": f"Step {turn}: go on."}]
    assert len(worker.received) == 4
    render = (
        gw.metric("kvserving_gateway_prompt_reuse_total", {"part": "render", "result": "hit"}),
        gw.metric("kvserving_gateway_prompt_reuse_total", {"part": "render", "result": "miss"}),
    )
    assert render == (2, 2)  # turn 1: nothing kept; turn 2: the kept render's only user message is its first


def test_a_short_request_completes_while_a_huge_prompt_is_prepared(stack: Stack, tiny_model_dir: Path) -> None:
    """A prompt above OFF_LOOP_CHARS is prepared on a worker thread: held there (the tagger
    waits for an event), it does not stop the gateway from serving a short request meanwhile."""
    tok = TextTokenizer.from_dir(tiny_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY))
    gw = stack.gateway(decode=[worker.url], max_model_len=200_000)
    tagger = gw.state.model.tagger
    build, preparing, release = tagger.build, threading.Event(), threading.Event()

    def held_build(messages: Any, **kwargs: Any) -> Any:
        if sum(len(m["content"]) for m in messages) > OFF_LOOP_CHARS:
            preparing.set()
            assert release.wait(30)
        return build(messages, **kwargs)

    tagger.build = held_build  # type: ignore[method-assign]
    huge = [{"role": "user", "content": "Summarize this log: " + "line ok\n" * (OFF_LOOP_CHARS // 8 + 1)}]
    client = _client(gw)
    with ThreadPoolExecutor(1) as pool:
        try:
            long = pool.submit(client.chat.completions.create, model=MODEL, messages=huge, max_tokens=8)
            assert preparing.wait(30)
            short = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
            assert short.choices[0].message.content == REPLY
            assert not long.done()  # still held in the prompt stage
        finally:
            release.set()
        assert long.result(timeout=30).choices[0].message.content == REPLY
    real = ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir))
    assert [r["input_ids"] for r in worker.received] == [real.build(m).input_ids for m in (MESSAGES, huge)]

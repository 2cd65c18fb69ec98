"""Draft prompts through the gateway: a chat prompt goes to the worker from the marked
render alone and the real render confirms it before the first token is relayed; when a
template inspects content (the marked render differs), the draft's worker request is
dropped and the turn runs again from the real render. The client sees the same answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from gw_harness import MODEL, Stack
from test_tagger import EDITING_TEMPLATE

from kvserving.gateway.prompt.chat_template import ChatTemplate, normalize_messages
from kvserving.gateway.prompt.tagger import Drafting
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer

REPLY = "Fine, reading it now."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Please read the whole of setup.py and tell me what it installs."},
]


def _client(gw) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=20)


def _drafts(gw, result: str) -> float:  # type: ignore[no-untyped-def]
    return gw.metric("kvserving_gateway_prompt_drafts_total", {"result": result})


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
def test_confirmed_draft_is_one_worker_request_with_the_real_ids(stack: Stack, tiny_model_dir: Path, stream: bool) -> None:
    tok = TextTokenizer.from_dir(tiny_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY))
    gw = stack.gateway(decode=[worker.url])
    out = _client(gw).chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream else out.choices[0].message.content
    assert text == REPLY
    real = ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir)).build(MESSAGES)
    assert len(worker.received) == 1
    assert worker.received[0]["input_ids"] == real.input_ids and worker.received[0]["tags"] == real.tags
    assert (_drafts(gw, "confirmed"), _drafts(gw, "mismatch")) == (1, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_unconfirmed_draft_is_dropped_and_the_turn_runs_from_the_real_render(stack: Stack, editing_model_dir: Path, stream: bool) -> None:
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
        # the draft went first (its text is not the real render), then the real prompt
        assert len(worker.received) == 2
        assert tok.decode(worker.received[0]["input_ids"], skip_special_tokens=False) != real_text
        assert worker.received[1]["input_ids"] == tok.encode_ids(real_text)
        assert (_drafts(g, "confirmed"), _drafts(g, "mismatch")) == (0, 1)
        if not stream:  # the usage is the real prompt's
            assert out.usage.prompt_tokens == len(tok.encode_ids(real_text))
    finally:
        gw.close()


def test_drafting_turns_off_when_mismatches_pass_eight_and_a_tenth() -> None:
    d = Drafting()
    d.drafts = 200
    for _ in range(8):
        d.mismatch()
    assert d.on  # a few odd requests leave it on
    d.mismatch()
    assert d.on  # 9 of 200: under a tenth
    d.drafts, d.mismatches = 50, 8
    d.mismatch()
    assert not d.on  # 9 of 50


def test_later_turns_render_only_what_they_append_and_send_the_real_prompt(stack: Stack, tiny_model_dir: Path) -> None:
    """Four turns of one conversation through the gateway: from the third on the draft renders only
    its last user turn (kept render), and every worker request carries exactly the ids and tags
    of a whole render; every draft is confirmed."""
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
    assert (_drafts(gw, "confirmed"), _drafts(gw, "mismatch")) == (4, 0)
    render = (
        gw.metric("kvserving_gateway_prompt_reuse_total", {"part": "render", "result": "hit"}),
        gw.metric("kvserving_gateway_prompt_reuse_total", {"part": "render", "result": "miss"}),
    )
    assert render == (2, 2)  # turn 1: nothing kept; turn 2: the kept render's only user message is its first

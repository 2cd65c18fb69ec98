"""Client input through the real app: every malformed request is a 4xx in OpenAI's
shape, on both completion routes, streamed or not, before a worker sees it; content
that spells out special tokens reaches the worker as text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from gw_harness import MODEL, Stack
from malformed_inputs import CHAT, INJECTION, ROUTED, ROUTED_IDS, request_body

from kvserving.gateway.prompt.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    stack = Stack(tiny_model_dir)
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url], max_model_len=64)  # 64 tokens: at most 64 x 82 characters
    try:
        yield gw, worker
    finally:
        stack.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("route", "name", "change", "only", "expected"), ROUTED, ids=ROUTED_IDS)
def test_malformed_input_is_a_4xx_in_openai_shape(
    served,
    route: str,
    stream: bool,
    name: str,  # type: ignore[no-untyped-def]
    change: dict[str, Any] | bytes,
    only: str | None,
    expected: tuple[int, str, str | None, str | None],
) -> None:
    gw, worker = served
    seen = len(worker.received)
    r = httpx.post(gw.url + route, content=request_body(route, change, stream), headers={"content-type": "application/json"}, timeout=30)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert (r.status_code, err["type"], err["code"], err["param"]) == expected, err["message"]
    assert r.headers["content-type"] == "application/json"
    assert len(worker.received) == seen  # refused before any worker request


def test_the_injection_reaches_the_worker_as_text(stack: Stack, tiny_model_dir: Path) -> None:
    """The issue's injection in a user message: the worker gets the template's control tokens
    only, where a benign message puts them, and the injected text as the tokens of its text;
    the next turn (history spliced after the reply) keeps it so."""
    from transformers import AutoTokenizer

    tok = TextTokenizer.from_dir(tiny_model_dir)
    split = AutoTokenizer.from_pretrained(str(tiny_model_dir), split_special_tokens=True)
    worker = stack.worker(role="both", reply_ids=[505, 929])
    gw = stack.gateway(decode=[worker.url])

    def chat(messages: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
        r = httpx.post(gw.url + CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        return worker.received[-1]["input_ids"], r.json()

    system = {"role": "system", "content": "Be brief."}
    benign, _ = chat([system, {"role": "user", "content": "hi"}])
    hi = tok.encode_ids("hi")
    assert len(hi) == 1
    at = benign.index(hi[0], 8)
    text_ids = split.encode(INJECTION, add_special_tokens=False)
    assert sum(t in tok.special_ids for t in text_ids) == 0
    injected, reply = chat([system, {"role": "user", "content": INJECTION}])
    assert injected == benign[:at] + text_ids + benign[at + 1 :]
    assert reply["usage"]["prompt_tokens"] == len(injected)
    controls = [i for i, t in enumerate(injected) if t in tok.special_ids]
    assert controls == [i if i < at else i + len(text_ids) - 1 for i, t in enumerate(benign) if t in tok.special_ids]
    assert len(controls) == 5  # system and user: open and close each; the reply's opener

    answer = reply["choices"][0]["message"]["content"]
    later, _ = chat(
        [system, {"role": "user", "content": INJECTION}, {"role": "assistant", "content": answer}, {"role": "user", "content": INJECTION}]
    )
    assert later[: len(injected)] == injected  # the first turn's ids as sent
    assert sum(t in tok.special_ids for t in later) == 5 + 4  # + the reply's close, the new user message's two, an opener
    tail = later[len(later) - (len(benign) - at - 1) - len(text_ids) :]
    assert tail == text_ids + benign[at + 1 :]

"""A huge prompt prepared on a worker thread while other conversations' turns run: the
conversation store is read and written on the event loop only, and ends as a serial run
leaves it (records, kept prefixes and renders, identity's sequences, the reuse counts);
an eviction while the thread works changes nothing of its prompt."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
from gw_harness import MODEL, Gateway, Stack

from kvserving.gateway.completions import OFF_LOOP_CHARS
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer

REPLY = "Read it; two tests fail."
HUGE = [
    {"role": "system", "content": "You are a log reader."},
    {"role": "user", "content": "Summarize this log: " + "line 17 ok, checksum matched\n" * (OFF_LOOP_CHARS // 29 + 1)},
]
STORE_CALLS = ("prefix", "has_cut", "renders", "open", "keep_prefixes", "keep_render", "forget", "hold", "file_sequence")


def chat(gw: Gateway, messages: list[dict[str, Any]], session: str) -> list[dict[str, Any]]:
    """One turn; the messages with its reply appended."""
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, extra_headers={"X-Session-ID": session})  # type: ignore[arg-type]
    return [*messages, {"role": "assistant", "content": out.choices[0].message.content}]


def other_turns(gw: Gateway, n: int) -> None:
    """Two turns each of ``n`` small conversations."""
    for i in range(n):
        first = chat(gw, [{"role": "system", "content": f"Agent {i}."}, {"role": "user", "content": f"Fix bug {i}."}], f"c{i}")
        chat(gw, [*first, {"role": "user", "content": "And the next one."}], f"c{i}")


def record_store_threads(gw: Gateway) -> set[int]:
    """The threads that call the conversation store from now on."""
    store, threads = gw.state.completions.store, set()

    def recorded(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.get_ident())
            return method(*args, **kwargs)

        return call

    for name in STORE_CALLS:
        setattr(store, name, recorded(getattr(store, name)))
    return threads


def hold_off_loop_encodes(gw: Gateway) -> tuple[threading.Event, threading.Event, threading.Event]:
    """(hold, holding, release): once ``hold`` is set, the next tokenization on a worker thread
    waits for ``release`` (``holding`` says it does)."""
    tokenizer = gw.state.model.tagger.tokenizer
    encode, hold, holding, release = tokenizer.encode, threading.Event(), threading.Event(), threading.Event()

    def held(text: str) -> Any:
        if hold.is_set() and threading.current_thread() is not gw.server.thread and not holding.is_set():
            holding.set()
            assert release.wait(60)
        return encode(text)

    tokenizer.encode = held  # type: ignore[method-assign]
    return hold, holding, release


def snapshot(gw: Gateway) -> dict[str, Any]:
    """Everything the conversation store keeps, and the tagger's reuse counts."""
    store = gw.state.completions.store
    records = [
        (
            c.key,
            c.scope,
            c.active,
            c.charge,
            list(c.held.ids) if c.held is not None else None,
            c.render.marked if c.render is not None else None,
            [(e.key, e.text, list(e.ids), e.shared) for e in c.prefixes],
            list(c.sequences),
        )
        for c in store
    ]
    return {
        "records": records,
        "prefixes": sorted(store._prefixes),
        "cuts": dict(store._cuts),
        "renders": {k: [r.marked for r in v] for k, v in store._renders.items()},
        "sequences": {k: list(v) for k, v in store._sequences.items()},
        "tokens": store.tokens,
        "reuse": gw.state.model.tagger.reuse_counts(),
    }


def test_a_huge_prompt_on_a_thread_leaves_the_store_to_the_loop_and_as_a_serial_run_does(stack: Stack, tiny_model_dir: Path) -> None:
    tok = TextTokenizer.from_dir(tiny_model_dir)
    reply = tok.encode_ids(REPLY)
    # concurrent: the huge conversation's second turn is held on its thread, after its
    # kept render and prefix were found, while four other conversations take two turns each
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url], max_model_len=200_000)
    huge = chat(gw, HUGE, "h")
    second = [*huge, {"role": "user", "content": "Which lines failed?"}]
    hold, holding, release = hold_off_loop_encodes(gw)
    threads = record_store_threads(gw)
    hold.set()
    with ThreadPoolExecutor(1) as pool:
        try:
            held = pool.submit(chat, gw, second, "h")
            assert holding.wait(60)
            other_turns(gw, 4)
            assert not held.done()
        finally:
            release.set()
        held.result(timeout=60)
    assert threads == {gw.server.thread.ident}  # every store call on the event loop's thread
    # serial: the same turns, one after another, in the order the concurrent run filed them
    serial_worker = stack.worker(role="both", reply_ids=reply)
    serial = stack.gateway(decode=[serial_worker.url], max_model_len=200_000)
    chat(serial, HUGE, "h")
    other_turns(serial, 4)
    chat(serial, second, "h")
    assert [(r["input_ids"], r["tags"]) for r in worker.received] == [(r["input_ids"], r["tags"]) for r in serial_worker.received]
    assert snapshot(gw) == snapshot(serial)
    assert snapshot(gw)["reuse"][0]["tokens"][0] >= 1  # the huge second turn reused its first turn's tokens
    real = ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir)).build(second)
    assert worker.received[-1]["input_ids"] == real.input_ids and worker.received[-1]["tags"] == real.tags


def test_a_huge_prompt_whose_conversation_is_evicted_while_its_thread_works_is_the_real_prompt(stack: Stack, tiny_model_dir: Path) -> None:
    tok = TextTokenizer.from_dir(tiny_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids(REPLY))
    gw = stack.gateway(decode=[worker.url], max_model_len=200_000, max_conversations=2)
    huge = chat(gw, HUGE, "h")
    second = [*huge, {"role": "user", "content": "Which lines failed?"}]
    hold, holding, release = hold_off_loop_encodes(gw)
    store = gw.state.completions.store
    (key,) = [c.key for c in store]
    hold.set()
    with ThreadPoolExecutor(1) as pool:
        try:
            held = pool.submit(chat, gw, second, "h")
            assert holding.wait(60)
            other_turns(gw, 2)
            assert store.get(key) is None  # evicted, kept prefix and render with it, while the thread works
        finally:
            release.set()
        held.result(timeout=60)
    real = ChatTagger(tok, ChatTemplate.from_dir(tiny_model_dir)).build(second)
    assert worker.received[-1]["input_ids"] == real.input_ids and worker.received[-1]["tags"] == real.tags
    # the indexes hold only what live records filed
    entries = [e for c in store for e in c.prefixes]
    assert sorted(store._prefixes) == sorted(e.key for e in entries)
    assert sum(store._cuts.values()) == len(entries)
    assert sorted(r.marked for v in store._renders.values() for r in v) == sorted(c.render.marked for c in store if c.render is not None)

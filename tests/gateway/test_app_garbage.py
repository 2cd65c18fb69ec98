"""A served completion leaves nothing of the gateway to the cyclic collector: what a request
allocates is freed by reference counting when it ends. Garbage in reference cycles waits for a
collection, and a collection pauses every request in flight for as long as it takes to free it."""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from kvs_poll import wait_until
from gw_harness import MODEL, Stack

import kvserving.gateway

from kvserving.gateway.prompt.tokenizer import TextTokenizer

GATEWAY_DIR = str(Path(kvserving.gateway.__file__).parent)
CODE_TYPES = (types.FrameType, types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType, types.FunctionType)


def gateway_objects(objects: list[Any]) -> list[str]:
    """The objects of the gateway's own code among ``objects``: instances of its classes, and
    frames, coroutines, generators and functions of its modules."""
    out = []
    for obj in objects:
        if isinstance(obj, CODE_TYPES):
            code = getattr(obj, "f_code", None) or getattr(obj, "cr_code", None) or getattr(obj, "gi_code", None)
            code = code or getattr(obj, "ag_code", None) or getattr(obj, "__code__", None)
            if isinstance(code, types.CodeType) and code.co_filename.startswith(GATEWAY_DIR):
                out.append(f"{type(obj).__name__} {code.co_qualname}")
        elif type(obj).__module__.startswith("kvserving.gateway"):
            out.append(type(obj).__qualname__)
    return out


@pytest.fixture()
def collector_off() -> Iterator[None]:
    """Automatic collections off for the test (the garbage stays for it to find), on again after."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gc.collect()


def test_served_completions_leave_no_reference_cycles(stack: Stack, tiny_model_dir: Path, collector_off: None) -> None:
    tok = TextTokenizer.from_dir(tiny_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids("Done: the tests pass now."))
    gw = stack.gateway(decode=[worker.url], prefill=[worker.url])
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=20)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"Step {turn}: run the tests."})
        if turn % 2:
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64)  # type: ignore[arg-type]
            text = reply.choices[0].message.content
        else:
            stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, stream=True)  # type: ignore[arg-type]
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == "Done: the tests pass now."
        messages.append({"role": "assistant", "content": text})
    wait_until(lambda: gw.metric("kvserving_gateway_requests_in_flight") == 0, what="no request in flight")
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage, not freed
    gc.collect()
    assert gateway_objects(gc.garbage) == []

"""The prefill worker's first token opens the reply (docs/worker-api.md): the
gateway streams it before the decode request, the decode continues after it
(``output_ids``), a reply that ends with it makes no decode request, a seeded
sampled request is left to the decode alone, and a decode worker lost after the
first token is replaced without running the prefill again."""

from __future__ import annotations

import openai
from fake_worker import FakeWorker
from gw_harness import MODEL, Gateway, Stack

REPLY = [40, 41, 42, 43, 44, 45]
MESSAGES = [{"role": "user", "content": "List the files."}]


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=20)


def split(stack: Stack, *, decoders: int = 1, **decode_kwargs: object) -> tuple[FakeWorker, list[FakeWorker], Gateway]:
    prefill = stack.worker(role="prefill", reply_ids=REPLY)
    decode = [stack.worker(role="decode", reply_ids=REPLY, **decode_kwargs) for _ in range(decoders)]
    return prefill, decode, stack.gateway(prefill=[prefill.url], decode=[d.url for d in decode], health_interval_s=60)


def test_the_decode_continues_after_the_prefills_first_token(stack: Stack) -> None:
    prefill, (decode,), gw = split(stack)
    out = client(gw).completions.create(model=MODEL, prompt="ls", max_tokens=5, extra_headers={"X-Session-ID": "s1"})
    (p,), (d,) = prefill.received, decode.received
    assert p["sampling"]["max_tokens"] == 1
    assert d["output_ids"] == REPLY[:1] and d["sampling"]["max_tokens"] == 5
    assert d["input_ids"] == p["input_ids"]  # the first token is context, not prompt
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    # the decode's retained lease covers prompt + the whole reply, first token included
    (lease,) = decode.leases.values()
    assert len(lease.hashes) == (len(p["input_ids"]) + 5) // 16


def test_the_first_token_reaches_the_client_even_when_the_decode_then_fails(stack: Stack) -> None:
    _, (decode,), gw = split(stack, fail_status=500)
    chunks, error = [], None
    try:
        for chunk in client(gw).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=5):
            chunks.append(chunk)
    except openai.APIError as exc:  # the error event after the streamed first token
        error = exc
    assert error is not None and len(decode.received) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text  # the prefill's token was streamed before the decode was asked


def test_a_reply_that_ends_with_its_first_token_makes_no_decode_request(stack: Stack) -> None:
    prefill, (decode,), gw = split(stack)
    one = client(gw).completions.create(model=MODEL, prompt="ls", max_tokens=1)
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    stop_prefill = stack.worker(role="prefill", reply_ids=REPLY[:1])  # its one token ends the reply ("stop")
    gw2 = stack.gateway(prefill=[stop_prefill.url], decode=[decode.url], health_interval_s=60)
    ended = client(gw2).completions.create(model=MODEL, prompt="ls", max_tokens=5)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    assert decode.received == [] and len(prefill.received) == 1 and len(stop_prefill.received) == 1


def test_a_seeded_sampled_reply_is_sampled_by_the_decode_alone(stack: Stack) -> None:
    _, (decode,), gw = split(stack)
    client(gw).completions.create(model=MODEL, prompt="ls", max_tokens=4, temperature=0.7, seed=3)
    client(gw).completions.create(model=MODEL, prompt="ls", max_tokens=4, temperature=0.0, seed=3)
    sampled, greedy = decode.received
    assert "output_ids" not in sampled  # the seed's stream is the decode's, whatever the topology
    assert greedy["output_ids"] == REPLY[:1]  # greedy: the same token either way


def test_a_decode_lost_after_the_first_token_is_replaced_without_a_second_prefill(stack: Stack) -> None:
    prefill, decoders, gw = split(stack, decoders=2)
    first, second = sorted(decoders, key=lambda w: w.url)  # ties go to the first URL
    next(s for s in stack.servers if getattr(s, "url", None) == first.url).stop()
    out = client(gw).completions.create(model=MODEL, prompt="ls", max_tokens=5)
    assert out.usage.completion_tokens == 5 and out.choices[0].text
    assert len(prefill.received) == 1  # the prefill ran once; its first token was already streamed
    (d,) = second.received
    assert d["output_ids"] == REPLY[:1]
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "retry", "reason": "connect"}) == 1

"""Bounded stalls through the gateway, over fake workers: a worker that does not
answer in time, goes silent mid-stream, refuses (503: draining) or is a lease
holder the prefill cannot reach loses its part of the turn to another worker
before anything of it reached the client; after that the stream ends with an
error event whose code says a retry is safe (docs/gateway-errors.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fake_worker import FakeWorker
from gw_harness import MODEL, Gateway, Stack

from kvserving.gateway.tenants import DEFAULT_TENANT
from kvserving.gateway.workers import EVENTS_LATE_S, FROZEN_FLOOR_S, FROZEN_RATIO, PROBE_TIMEOUT_S

from kvserving.config import ReuseConfig
from kvserving.gateway.prompt.tokenizer import TextTokenizer

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a careful coding agent working in a repository. " * 4}


@pytest.fixture(scope="module")
def reply(tiny_model_dir: Path) -> list[int]:
    return TextTokenizer.from_dir(tiny_model_dir).encode_ids("Done. The tests pass now; the parser is fixed.")


@pytest.fixture(scope="module")
def text(tiny_model_dir: Path, reply: list[int]) -> str:
    return TextTokenizer.from_dir(tiny_model_dir).decode(reply)


def chat(gw: Gateway, messages: list[dict[str, Any]], session: str) -> str:
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=30)
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=messages, stream=True, extra_headers={"X-Session-ID": session})  # type: ignore[arg-type]
        if c.choices
    ]
    messages.append({"role": "assistant", "content": "".join(parts)})
    return "".join(parts)


def by_url(workers: list[FakeWorker]) -> list[FakeWorker]:
    return sorted(workers, key=lambda w: w.url)  # the router breaks ties by URL


def test_a_lease_holder_the_prefill_cannot_reach_loses_the_decode_before_the_first_token(stack: Stack, reply: list[int], text: str) -> None:
    prefill = stack.worker(role="prefill", reply_ids=reply)
    decoders = [stack.worker(role="decode", reply_ids=reply) for _ in range(2)]
    gw = stack.gateway(prefill=[prefill.url], decode=[d.url for d in decoders], health_interval_s=60)
    messages = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    assert chat(gw, messages, "s") == text
    (holder,) = [d for d in decoders if d.leases]
    (other,) = [d for d in decoders if d is not holder]
    prefill.pull_fallback = "remote_unreachable"  # the holder froze: the prefill's hold of its lease timed out
    messages.append({"role": "user", "content": "Run them again."})
    assert chat(gw, messages, "s") == text
    assert len(holder.received) == 1 and len(other.received) == 1  # the decode went to the other worker
    assert prefill.received[-1]["kv_transfer_params"]["agent_url"] == holder.url
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 1
    assert not gw.state.pool.workers[holder.url].healthy  # out of the rotation until /ready answers
    assert gw.state.keeper.table.get(DEFAULT_TENANT.scope("session:s")).worker_url == other.url  # type: ignore[union-attr]


def test_a_lone_lease_holder_the_prefill_cannot_reach_stays_in_the_rotation(stack: Stack, reply: list[int], text: str) -> None:
    """With no other decode worker, a pull that timed out is no reason to refuse every turn: the
    turn recomputes (counted) and decodes on the holder, which stays healthy."""
    prefill = stack.worker(role="prefill", reply_ids=reply)
    holder = stack.worker(role="decode", reply_ids=reply)
    gw = stack.gateway(prefill=[prefill.url], decode=[holder.url], health_interval_s=60)
    messages = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    assert chat(gw, messages, "lone") == text
    prefill.pull_fallback = "remote_unreachable"  # the holder was too busy to answer the prefill's hold in time
    messages.append({"role": "user", "content": "Run them again."})
    assert chat(gw, messages, "lone") == text
    assert len(holder.received) == 2
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 1
    assert gw.state.pool.workers[holder.url].healthy  # still in the rotation: the next turn is served
    messages.append({"role": "user", "content": "And once more."})
    assert chat(gw, messages, "lone") == text
    assert len(holder.received) == 3


def test_a_lone_frozen_decode_worker_fails_its_turn_once_stays_in_the_rotation_and_serves_the_next(
    stack: Stack, reply: list[int], text: str
) -> None:
    """Late headers and unanswered /health probes from the only decode worker: its first-byte
    deadline runs out (no probe answer restarts it) and the turn fails without a retry on that same worker (the client would wait twice), and the worker is not
    taken out: once it answers again the next turns are served, not refused with 503."""
    prefill = stack.worker(role="prefill", reply_ids=reply)
    lone = stack.worker(role="decode", reply_ids=reply)
    gw = stack.gateway(prefill=[prefill.url], decode=[lone.url], health_interval_s=60, first_byte_timeout_s=1.0)
    lone.answer_after_s, lone.health_delay_s = 5.0, 5.0
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Fix it."}])  # type: ignore[list-item]
    assert failed.value.status_code == 502 and "did not answer within 1 s" in failed.value.message
    assert gw.state.pool.workers[lone.url].healthy
    lone.answer_after_s, lone.health_delay_s = 0.0, 0.0
    for n in range(3):
        assert chat(gw, [SYSTEM, {"role": "user", "content": f"Fix it, take {n}."}], f"lone-{n}") == text
    assert len(lone.received) == 4
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "first_byte_timeout"}) == 1


def test_a_lone_worker_that_misses_its_ready_polls_stays_in_the_rotation(stack: Stack, reply: list[int], text: str) -> None:
    worker = stack.worker(role="both", reply_ids=reply)
    gw = stack.gateway(decode=[worker.url], health_interval_s=0.1, connect_timeout_s=0.25)
    state = gw.state.pool.workers[worker.url]
    deadline = time.monotonic() + 30
    while not state.healthy:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker.ready_delay_s = 3.0  # past the poll deadline (2 s): busy, every poll missed
    while state.misses < 3:
        assert time.monotonic() < deadline + 20, state.misses
        time.sleep(0.05)
    assert state.healthy
    assert chat(gw, [SYSTEM, {"role": "user", "content": "Fix it."}], "busy") == text
    assert gw.metric("kvserving_gateway_requests_total", {"route": CHAT, "code": "503"}) == 0


def test_a_decode_worker_that_does_not_answer_in_time_is_left_for_another(stack: Stack, reply: list[int], text: str) -> None:
    prefill = stack.worker(role="prefill", reply_ids=reply)
    frozen, alive = by_url([stack.worker(role="decode", reply_ids=reply) for _ in range(2)])
    frozen.answer_after_s = 6.0  # long past the deadline (and short enough for the fake to stop soon)
    gw = stack.gateway(
        prefill=[prefill.url],
        decode=[frozen.url, alive.url],
        health_interval_s=60,
        first_byte_timeout_s=2.0,  # the live worker's headers come within it on a stalled machine too
        reuse=ReuseConfig(transfer_timeout_s=0.5),
    )
    t0 = time.monotonic()
    assert chat(gw, [SYSTEM, {"role": "user", "content": "Fix it."}], "f") == text  # whole, no error event
    assert time.monotonic() - t0 < 10
    assert len(frozen.received) == 1 and len(alive.received) == 1
    assert alive.received[0]["output_ids"] == reply[:1]  # the decode only: the prefill's token was out already
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "first_byte_timeout"}) == 1
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "retry", "reason": "first_byte_timeout"}) == 1
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 0  # no lease yet


def test_a_draining_decode_worker_before_its_first_byte_is_a_retry_not_an_error_event(stack: Stack, reply: list[int], text: str) -> None:
    prefill = stack.worker(role="prefill", reply_ids=reply)
    draining, alive = by_url([stack.worker(role="decode", reply_ids=reply) for _ in range(2)])
    gw = stack.gateway(prefill=[prefill.url], decode=[draining.url, alive.url], health_interval_s=60)
    deadline = time.monotonic() + 30  # the gateway's first poll sees both ready (on a loaded machine it may come late)
    while not all(gw.state.pool.workers[w.url].healthy for w in (draining, alive)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    draining.ready = False  # answers 503 now; the gateway's last poll saw it ready
    assert chat(gw, [SYSTEM, {"role": "user", "content": "Fix it."}], "d") == text
    assert len(draining.received) == 1 and len(alive.received) == 1
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "retry", "reason": "status"}) == 1


def test_a_worker_silent_after_its_first_token_ends_the_stream_with_a_retry_safe_error_event(
    stack: Stack, reply: list[int], text: str
) -> None:
    worker = stack.worker(role="both", reply_ids=reply, stall_after_tokens=1)
    gw = stack.gateway(decode=[worker.url], health_interval_s=60, event_timeout_s=2.0)
    t0 = time.monotonic()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", gw.url + CHAT, json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert 1.9 < time.monotonic() - t0 < 10
    error = json.loads(events[-1])["error"]
    assert (error["type"], error["code"]) == ("server_error", "worker_unavailable")
    assert "sent nothing for 2 s" in error["message"]
    assert "[DONE]" not in events
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "event_timeout"}) == 1


def test_keep_alive_comments_hold_a_slow_stream_open_past_the_event_deadline(stack: Stack, reply: list[int]) -> None:
    worker = stack.worker(role="both", reply_ids=reply[:1], token_delay_s=2.6, keepalive_s=0.5)
    gw = stack.gateway(decode=[worker.url], health_interval_s=60, event_timeout_s=2.0)
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=30)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.completion_tokens == 1
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "event_timeout"}) == 0


def test_a_lone_busy_decode_worker_whose_headers_come_late_still_serves_the_turn(stack: Stack, reply: list[int], text: str) -> None:
    """The only decode worker sends its headers past the first-byte deadline but answers /health
    all along (a queue, a long pull): busy, not frozen. The turn waits for it and completes."""
    prefill = stack.worker(role="prefill", reply_ids=reply)
    busy = stack.worker(role="decode", reply_ids=reply)
    busy.answer_after_s = 2.5  # past the 1 s deadline
    gw = stack.gateway(
        prefill=[prefill.url], decode=[busy.url], health_interval_s=60, first_byte_timeout_s=1.0, reuse=ReuseConfig(transfer_timeout_s=0.5)
    )
    messages = [SYSTEM, {"role": "user", "content": "Fix it."}]
    assert chat(gw, messages, "busy") == text  # whole, no error event
    messages.append({"role": "user", "content": "Again."})
    assert chat(gw, messages, "busy") == text
    assert len(busy.received) == 2
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "first_byte_timeout"}) == 0
    assert gw.state.pool.workers[busy.url].healthy


def test_with_every_worker_of_a_role_out_of_the_rotation_the_turn_goes_to_the_one_that_answered_last(
    stack: Stack, reply: list[int], text: str
) -> None:
    """Every worker marked out (slow polls, failed requests) is no reason for a 503 while one of
    them is reachable: the one whose /ready answered 200 last takes the turn."""
    prefill = stack.worker(role="prefill", reply_ids=reply)
    first, second = by_url([stack.worker(role="decode", reply_ids=reply) for _ in range(2)])
    gw = stack.gateway(prefill=[prefill.url], decode=[first.url, second.url], health_interval_s=60)
    pool = gw.state.pool
    assert chat(gw, [SYSTEM, {"role": "user", "content": "Fix it."}], "a") == text
    assert len(first.received) == 1  # the tie between idle workers goes to the first URL
    pool.workers[second.url].answered_at = time.monotonic()  # second answered /ready last
    for w in pool.workers.values():
        w.healthy = False
    assert chat(gw, [SYSTEM, {"role": "user", "content": "Fix that."}], "b") == text
    assert len(prefill.received) == 2
    assert len(first.received) == 1 and len(second.received) == 1
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "decode", "reason": "last_answered"}) == 1
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "prefill", "reason": "last_answered"}) == 1


def test_a_lease_holder_frozen_after_its_headers_loses_the_decode_at_the_probe_deadline(stack: Stack, reply: list[int], text: str) -> None:
    """The decode worker holding the conversation's lease sends its headers, then nothing (no
    keep-alive, no token) and leaves /health unanswered: frozen. Its keep-alive is late after
    EVENTS_LATE_S, the probe gives up after PROBE_TIMEOUT_S, and the decode moves to the other
    worker before any of its tokens reached the client, long before the event deadline."""
    prefill = stack.worker(role="prefill", reply_ids=reply)
    holder, other = by_url([stack.worker(role="decode", reply_ids=reply) for _ in range(2)])
    gw = stack.gateway(prefill=[prefill.url], decode=[holder.url, other.url], health_interval_s=60, event_timeout_s=8.0)
    messages = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    assert chat(gw, messages, "s") == text
    assert holder.leases and not other.leases  # the tie between idle workers went to the first URL
    holder.stall_after_tokens = 0  # /health answered until its stream stalls: the holder check finds it alive
    messages.append({"role": "user", "content": "Run them again."})
    t0 = time.monotonic()
    assert chat(gw, messages, "s") == text  # whole, no error event
    elapsed = time.monotonic() - t0
    # the rest of the turn (a prefill, a decode) may take seconds on a loaded machine: still before the 8 s deadline
    assert EVENTS_LATE_S + PROBE_TIMEOUT_S - 0.1 < elapsed < EVENTS_LATE_S + PROBE_TIMEOUT_S + 4.0, elapsed
    assert len(holder.received) == 2 and len(other.received) == 1
    assert other.received[0]["output_ids"] == reply[:1]  # the decode only: the prefill's token was out already
    assert holder.received[1]["request_id"] in holder.aborted
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "unresponsive"}) == 1
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "event_timeout"}) == 0
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "retry", "reason": "unresponsive"}) == 1
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 1
    assert not gw.state.pool.workers[holder.url].healthy  # out of the rotation until /ready answers
    assert gw.state.keeper.table.get(DEFAULT_TENANT.scope("session:s")).worker_url == other.url  # type: ignore[union-attr]


def test_a_worker_frozen_mid_reply_ends_the_stream_with_an_error_event_at_the_probe_deadline(stack: Stack, reply: list[int]) -> None:
    frozen, spare = by_url([stack.worker(role="both", reply_ids=reply) for _ in range(2)])
    frozen.stall_after_tokens, frozen.health_delay_s = 1, 5.0
    gw = stack.gateway(decode=[frozen.url, spare.url], health_interval_s=60, event_timeout_s=8.0)
    t0 = time.monotonic()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", gw.url + CHAT, json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - t0 < EVENTS_LATE_S + PROBE_TIMEOUT_S + 4.0  # before the 8 s event deadline, on a loaded machine too
    error = json.loads(events[-1])["error"]
    assert (error["type"], error["code"]) == ("server_error", "worker_unavailable")
    assert f"did not answer /health within {PROBE_TIMEOUT_S:g} s" in error["message"]
    assert not spare.received  # a token was out: no retry
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "unresponsive"}) == 1


def test_a_silent_stream_whose_worker_answers_health_is_waited_for(stack: Stack, reply: list[int]) -> None:
    """No keep-alive for 2.5 s but /health answers: busy, not frozen; the token comes and the
    turn completes on the same worker."""
    slow, spare = by_url([stack.worker(role="both", reply_ids=reply[:1]) for _ in range(2)])
    slow.token_delay_s = 2.5
    gw = stack.gateway(decode=[slow.url, spare.url], health_interval_s=60, event_timeout_s=8.0)
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=30)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.completion_tokens == 1
    assert len(slow.received) == 1 and not spare.received
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "unresponsive"}) == 0


def holder_and_other(
    stack: Stack, reply: list[int], *, warm: bool = False
) -> tuple[FakeWorker, FakeWorker, FakeWorker, Gateway, list[dict[str, Any]]]:
    """A prefill and two decode workers, a conversation's first turn served: (prefill, its lease
    holder, the other decode worker, the gateway, the messages of turn 2). ``warm``: turn 2's
    messages sent once under another conversation (decoded by the other worker), so that the
    prefill has every page of turn 2 and nothing to pull."""
    prefill = stack.worker(role="prefill", reply_ids=reply)
    holder, other = by_url([stack.worker(role="decode", reply_ids=reply) for _ in range(2)])
    gw = stack.gateway(prefill=[prefill.url], decode=[holder.url, other.url], health_interval_s=60)
    messages = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    chat(gw, messages, "s")
    assert holder.leases and not other.leases  # the tie between idle workers went to the first URL
    messages.append({"role": "user", "content": "Run them again."})
    if warm:
        chat(gw, list(messages), "warm-up")
        assert len(other.received) == 1  # (the worker with fewer leases)
    return prefill, holder, other, gw, messages


def test_a_frozen_lease_holder_loses_the_decode_before_it_is_sent(stack: Stack, reply: list[int], text: str) -> None:
    """The holder answers neither /health nor a generate (frozen) while the other decode worker
    answers /health at once: the holder check tells it frozen at FROZEN_FLOOR_S, beside the
    prefill, and the decode goes to the other worker, never to the holder (no late headers to wait
    for: not PROBE_AFTER_S + PROBE_TIMEOUT_S)."""
    prefill, holder, other, gw, messages = holder_and_other(stack, reply, warm=True)
    holder.answer_after_s, holder.health_delay_s = 5.0, 5.0
    t0 = time.monotonic()
    assert chat(gw, messages, "s") == text
    elapsed = time.monotonic() - t0
    # not before the verdict, and long before the holder would answer (the counts below show where the
    # decode went: a loaded machine stretches the turn by seconds, never shortens it)
    assert FROZEN_FLOOR_S < elapsed < holder.answer_after_s, elapsed
    assert prefill.received[-1]["kv_transfer_params"]["agent_url"] == holder.url and not prefill.aborted  # nothing to pull
    assert len(holder.received) == 1 and len(other.received) == 2
    assert other.received[1]["output_ids"] == reply[:1]  # the prefill's token, then the decode elsewhere
    assert other.received[1]["kv_transfer_params"]["agent_url"] == prefill.url
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 1
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "unresponsive"}) == 0
    assert not gw.state.pool.workers[holder.url].healthy  # out of the rotation until /ready answers
    assert gw.state.keeper.table.get(DEFAULT_TENANT.scope("session:s")).worker_url == other.url  # type: ignore[union-attr]


def test_a_prefill_pulling_from_a_frozen_holder_is_sent_again_without_its_lease_at_the_verdict(
    stack: Stack, reply: list[int], text: str
) -> None:
    """The prefill's pull from a frozen holder would wait for the worker's peer deadline (here 8 s):
    at the holder check's verdict the gateway closes that prefill (the worker aborts it) and sends
    it again without the holder's params; the turn recomputes on the other decode worker."""
    prefill, holder, other, gw, messages = holder_and_other(stack, reply)
    holder.answer_after_s, holder.health_delay_s = 5.0, 5.0
    prefill.pull_delay_s = 8.0
    t0 = time.monotonic()
    assert chat(gw, messages, "s") == text
    elapsed = time.monotonic() - t0
    assert FROZEN_FLOOR_S < elapsed < prefill.pull_delay_s, elapsed  # at the verdict, not at the pull's deadline
    pulled, recomputed = prefill.received[1:]
    assert pulled["kv_transfer_params"]["agent_url"] == holder.url and pulled["request_id"] in prefill.aborted
    assert recomputed["kv_transfer_params"] is None and recomputed["request_id"] == pulled["request_id"] + "-recompute"
    assert len(holder.received) == 1 and len(other.received) == 1
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 1


@pytest.mark.parametrize(
    ("holder_s", "other_s"),
    [(0.05, 0.0), (0.3, 0.1)],
    ids=["busy-holder-idle-peer", "everything-slow-holder-slowest"],
)
def test_a_lease_holder_that_answers_health_late_but_in_time_keeps_the_turn(
    stack: Stack, reply: list[int], text: str, holder_s: float, other_s: float
) -> None:
    """Busy, not frozen: /health answered within FROZEN_FLOOR_S, or (everything slow: the peer
    itself answers in 0.1 s) within FROZEN_RATIO x the peer's time. The decode goes to the holder and
    the prefill pulls its KV (no recompute)."""
    prefill, holder, other, gw, messages = holder_and_other(stack, reply)
    assert holder_s < max(FROZEN_FLOOR_S, FROZEN_RATIO * other_s)
    holder.health_delay_s, other.health_delay_s = holder_s, other_s
    prefill.pull_delay_s = 0.5  # the verdict comes while the prefill pulls
    assert chat(gw, messages, "s") == text
    assert len(holder.received) == 2 and not other.received
    assert prefill.received[-1]["kv_transfer_params"]["agent_url"] == holder.url and not prefill.aborted
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 0
    assert gw.state.pool.workers[holder.url].healthy


def test_a_lease_holder_slower_than_its_ratio_to_a_slow_peer_is_frozen(stack: Stack, reply: list[int], text: str) -> None:
    """The peer answers in 0.1 s: the holder is frozen once FROZEN_RATIO x that has passed without
    its answer, not at FROZEN_FLOOR_S."""
    prefill, holder, other, gw, messages = holder_and_other(stack, reply, warm=True)
    holder.answer_after_s, holder.health_delay_s, other.health_delay_s = 5.0, 5.0, 0.1
    t0 = time.monotonic()
    assert chat(gw, messages, "s") == text
    elapsed = time.monotonic() - t0
    assert FROZEN_RATIO * 0.1 < elapsed < holder.answer_after_s, elapsed  # at the ratio, not the floor; not waiting for the holder
    assert len(holder.received) == 1 and len(other.received) == 2
    assert gw.metric("kvserving_gateway_reuse_fallbacks_total", {"reason": "holder_unresponsive"}) == 1

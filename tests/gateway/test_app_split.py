"""Prefill/decode split through the gateway: the KV flow of docs/worker-api.md,
the lease table as a cache of the decode workers (two gateway replicas), and
lease heartbeats, releases and expiries."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from kvs_poll import wait_until
from fake_worker import PAGE_SIZE, FakeWorker
from gw_harness import MODEL, Gateway, Stack

from kvserving.config import ReuseConfig
from kvserving.gateway.tenants import DEFAULT_TENANT
from kvserving.gateway.prompt.tokenizer import TextTokenizer

SYSTEM = {"role": "system", "content": "You are a careful coding agent working in a repository. " * 4}


@pytest.fixture(scope="module")
def reply(tiny_model_dir: Path) -> list[int]:
    # longer than a page: the decode's retained pages reach past what the prefill computed itself
    return TextTokenizer.from_dir(tiny_model_dir).encode_ids(
        "Done. The tests pass now; I also fixed the flaky parser test and updated the changelog entry."
    )


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=20)


def turn(gw: Gateway, messages: list[dict], session: str) -> openai.types.chat.ChatCompletion:
    out = client(gw).chat.completions.create(model=MODEL, messages=messages, extra_headers={"X-Session-ID": session})
    messages.append({"role": "assistant", "content": out.choices[0].message.content})
    return out


def test_split_turns_move_kv_prefill_to_decode_and_back(stack: Stack, reply: list[int]) -> None:
    prefill = stack.worker(role="prefill", reply_ids=reply)
    decode = stack.worker(role="decode", reply_ids=reply)
    gw = stack.gateway(prefill=[prefill.url], decode=[decode.url])
    messages = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    first = turn(gw, messages, "s1")
    p1, d1 = prefill.received[-1], decode.received[-1]
    assert p1["sampling"]["max_tokens"] == 1 and p1["kv_transfer_params"] is None and p1["retain"] is False
    assert d1["input_ids"] == p1["input_ids"] and d1["retain"] is True
    assert d1["conversation_key"] == DEFAULT_TENANT.scope("session:s1")
    transfer = prefill.leases[d1["kv_transfer_params"]["lease_id"]]  # P -> D: the prefill's transfer lease
    assert d1["kv_transfer_params"]["page_hashes"] == transfer.hashes
    assert first.choices[0].message.content.startswith("Done. The tests pass now;")  # type: ignore[union-attr]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    (lease,) = decode.leases.values()
    assert lease.conversation_key == DEFAULT_TENANT.scope("session:s1")

    messages.append({"role": "user", "content": "Run them again."})
    second = turn(gw, messages, "s1")
    p2 = prefill.received[-1]
    # D -> P: the prefill is told where the conversation's KV lives (the decode's retained lease).
    assert p2["kv_transfer_params"]["lease_id"] == lease.lease_id
    assert p2["kv_transfer_params"]["agent_url"] == decode.url
    # The fake prefill pulls the pages its local cache lacks; cached = prompt - what the prefill computed.
    n = len(p2["input_ids"])
    pulled_and_local = n - (n - second.usage.prompt_tokens_details.cached_tokens)
    assert second.usage.prompt_tokens == n
    assert second.usage.prompt_tokens_details.cached_tokens == pulled_and_local > PAGE_SIZE
    assert gw.metric("kvserving_gateway_kv_reused_tokens_total", {"source": "remote"}) > 0
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "decode", "reason": "lease"}) == 1
    # the decode replaced its lease; the table follows
    (lease2,) = decode.leases.values()
    assert gw.state.keeper.table.get(DEFAULT_TENANT.scope("session:s1")).lease_id == lease2.lease_id  # type: ignore[union-attr]


def test_two_gateway_replicas_route_a_conversation_to_the_same_kv(stack: Stack, reply: list[int]) -> None:
    prefill = stack.worker(role="prefill", reply_ids=reply)
    decoders = [stack.worker(role="decode", reply_ids=reply) for _ in range(3)]
    urls = [d.url for d in decoders]
    gw_a = stack.gateway(prefill=[prefill.url], decode=urls)
    gw_b = stack.gateway(prefill=[prefill.url], decode=urls)
    sessions = {f"s{i}": [SYSTEM, {"role": "user", "content": f"task {i}"}] for i in range(6)}
    holder: dict[str, FakeWorker] = {}
    for session, messages in sessions.items():
        turn(gw_a, messages, session)
        key = DEFAULT_TENANT.scope(f"session:{session}")
        (owner,) = [d for d in decoders if any(le.conversation_key == key for le in d.leases.values())]
        holder[session] = owner
    assert len({id(w) for w in holder.values()}) > 1  # load spread over decode workers
    for session, messages in sessions.items():
        messages.append({"role": "user", "content": "continue"})
        before = len(holder[session].received)
        out = turn(gw_b, messages, session)  # replica B never saw the conversation: it asks the decode workers
        assert len(holder[session].received) == before + 1
        assert prefill.received[-1]["kv_transfer_params"]["agent_url"] == holder[session].url
        assert out.usage.prompt_tokens_details.cached_tokens > 0
    assert gw_b.metric("kvserving_gateway_lease_lookups_total", {"result": "hit"}) == 6
    assert gw_b.metric("kvserving_gateway_routing_decisions_total", {"role": "decode", "reason": "lease"}) == 6


def test_leases_renew_while_active_and_release_when_idle(stack: Stack, reply: list[int]) -> None:
    # a worker keeping KV briefly (2 s) beside a 4 s lease TTL: only renewals keep it. A heartbeat of 0.5 s
    # renews within 1 s of the worker's expiry, so an event loop that stalls for most of a second on a
    # loaded machine still renews in time
    decode = stack.worker(role="both", reply_ids=reply, retention_ttl_s=2.0)
    reuse = ReuseConfig(lease_ttl_s=4.0, retention_ttl_s=8.0)
    gw = stack.gateway(decode=[decode.url], reuse=reuse, lease_heartbeat_s=0.5)
    turn(gw, [SYSTEM, {"role": "user", "content": "hello"}], "idle-one")
    (lease_id,) = decode.leases
    wait_until(lambda: decode.renewals.count(lease_id) >= 2)  # active (within the TTL): kept alive
    wait_until(lambda: lease_id in decode.releases)  # idle past the lease TTL: released
    # the gateway counts a release once the worker has answered it: wait for that, not for the worker's side
    wait_until(lambda: gw.metric("kvserving_gateway_lease_releases_total") >= 1, what="the gateway counting the release")
    assert decode.leases == {}
    assert gw.state.keeper.table.get(DEFAULT_TENANT.scope("session:idle-one")) is None
    assert gw.metric("kvserving_gateway_lease_renewals_total") >= 2
    assert gw.metric("kvserving_gateway_lease_expiries_total") == 0
    assert gw.metric("kvserving_gateway_lease_releases_total") == 1
    assert gw.metric("kvserving_gateway_leases") == 0


def test_a_lease_the_worker_forgot_is_dropped_as_expired(stack: Stack, reply: list[int]) -> None:
    decode = stack.worker(role="both", reply_ids=reply, retention_ttl_s=0.6)
    reuse = ReuseConfig(lease_ttl_s=5.0, retention_ttl_s=30.0)
    gw = stack.gateway(decode=[decode.url], reuse=reuse, lease_heartbeat_s=0.2)
    turn(gw, [SYSTEM, {"role": "user", "content": "hello"}], "forgotten")
    decode.leases.clear()  # the worker lost it (restart, eviction): the renewal near its expiry gets 404
    wait_until(lambda: gw.state.keeper.table.get(DEFAULT_TENANT.scope("session:forgotten")) is None)
    assert gw.metric("kvserving_gateway_lease_expiries_total") == 1
    assert decode.releases == []


def test_gateway_shutdown_leaves_active_leases_and_releases_idle_ones(tiny_model_dir: Path, reply: list[int]) -> None:
    stack = Stack(tiny_model_dir)
    try:
        decode = stack.worker(role="both", reply_ids=reply)
        # the TTL bounds how long the second turn and the stop may take on a loaded machine (the recent
        # lease must still be active at the stop): longer than a stalled event loop's seconds
        reuse = ReuseConfig(lease_ttl_s=6.0, retention_ttl_s=60.0)
        gw = stack.gateway(decode=[decode.url], reuse=reuse, lease_heartbeat_s=60)  # no beat before the stop
        turn(gw, [SYSTEM, {"role": "user", "content": "first"}], "old")
        (old,) = decode.leases
        time.sleep(6.1)  # the old lease idle past the TTL (a lower bound: a slow machine only sleeps longer)
        turn(gw, [SYSTEM, {"role": "user", "content": "second"}], "recent")
        (recent,) = set(decode.leases) - {old}
        gw.stop()
        assert decode.releases == [old]  # idle past the TTL (by the last beat at the latest)
        assert list(decode.leases) == [recent]  # active: another replica may continue it
    finally:
        stack.close()


def test_a_stop_string_in_a_split_turn_still_reports_what_the_prefill_reused(stack: Stack, reply: list[int]) -> None:
    prefill = stack.worker(role="prefill", reply_ids=reply)
    decode = stack.worker(role="decode", reply_ids=reply, token_delay_s=0.02)
    gw = stack.gateway(prefill=[prefill.url], decode=[decode.url])
    messages = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    turn(gw, messages, "stop")
    messages.append({"role": "user", "content": "Again."})
    out = client(gw).chat.completions.create(
        model=MODEL,
        messages=messages,
        stop=["tests"],  # type: ignore[arg-type]
        extra_headers={"X-Session-ID": "stop"},
    )
    assert out.choices[0].message.content == "Done. The " and out.choices[0].finish_reason == "stop"
    rid = decode.received[-1]["request_id"]
    wait_until(lambda: rid in decode.aborted)
    assert out.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_bidirectional_off_offers_nothing_back_and_keeps_no_lease(stack: Stack, reply: list[int]) -> None:
    prefill = stack.worker(role="prefill", reply_ids=reply)
    decode = stack.worker(role="decode", reply_ids=reply)
    gw = stack.gateway(prefill=[prefill.url], decode=[decode.url], reuse=ReuseConfig(bidirectional=False))
    messages = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    turn(gw, messages, "off")
    assert decode.received[-1]["retain"] is False and decode.leases == {}
    messages.append({"role": "user", "content": "Run them again."})
    turn(gw, messages, "off")
    assert prefill.received[-1]["kv_transfer_params"] is None  # no D -> P offer
    assert decode.received[-1]["kv_transfer_params"]["agent_url"] == prefill.url  # P -> D still flows
    assert gw.metric("kvserving_gateway_kv_reused_tokens_total", {"source": "remote"}) == 0

"""Tenant scoping through the gateway (tenants.py), over fake workers: what the worker
requests carry (cache_salt, conversation keys) and which conversation a request continues."""

from __future__ import annotations

import json
import re

import openai
import pytest
from gw_harness import MODEL, Stack

from kvserving.config import SecurityConfig
from kvserving.gateway.tenants import DEFAULT_TENANT
from kvserving.gateway.prompt.tokenizer import TextTokenizer

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 8}


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


def test_each_api_key_is_a_tenant_on_the_wire(stack: Stack, tokenizer: TextTokenizer) -> None:
    worker = stack.worker(role="both", reply_ids=tokenizer.encode_ids("Done."))
    gw = stack.gateway(decode=[worker.url], api_keys=("sk-alice", "sk-bob"))
    first = [SYSTEM, {"role": "user", "content": "List the files."}]
    bodies = []
    for key in ("sk-alice", "sk-bob"):
        client(gw.url, key).chat.completions.create(model=MODEL, messages=first, extra_headers={"X-Session-ID": "alice@example.com"})
        bodies.append(worker.received[-1])
    salts = [b["cache_salt"] for b in bodies]
    keys = [b["conversation_key"] for b in bodies]
    assert all(re.fullmatch(r"[0-9a-f]{32}", s) for s in salts) and salts[0] != salts[1]
    assert keys[0] != keys[1] and all(re.fullmatch(r"conv-[0-9a-f]{32}", k) for k in keys)
    wire = json.dumps(bodies)
    assert "alice" not in wire and "sk-" not in wire  # neither the user's id nor the API key reach a worker
    # the gateway's conversation records hold them apart: a lease and a held history each
    records = [gw.state.completions.store.get(k) for k in keys]
    assert all(r is not None and r.lease is not None and r.lease.worker_url == worker.url for r in records)
    assert records[0].lease.lease_id != records[1].lease.lease_id  # type: ignore[union-attr]
    assert all(r is not None and r.held is not None for r in records) and len(gw.state.completions.store) == 2
    # cache_salt with a key: another tenant than the key alone
    client(gw.url, "sk-alice").chat.completions.create(model=MODEL, messages=first, extra_body={"cache_salt": "s1"})
    assert worker.received[-1]["cache_salt"] not in salts


def test_a_history_resent_by_another_tenant_is_not_its_conversation(stack: Stack, tokenizer: TextTokenizer) -> None:
    worker = stack.worker(role="both", reply_ids=tokenizer.encode_ids("Done."))
    gw = stack.gateway(decode=[worker.url])
    messages = [SYSTEM, {"role": "user", "content": "List the files."}]
    first = client(gw.url).chat.completions.create(model=MODEL, messages=messages, extra_body={"cache_salt": "tenant-a"})
    body = worker.received[-1]
    assert re.fullmatch(r"[0-9a-f]{32}", body["cache_salt"])
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Now read main.py."}]
    # the whole history, word for word, from another tenant (another salt; no salt): a new conversation
    for salt in ("tenant-b", None):
        extra = {"cache_salt": salt} if salt else {}
        client(gw.url).chat.completions.create(model=MODEL, messages=messages, extra_body=extra)
        assert worker.received[-1]["conversation_key"] != body["conversation_key"]
        assert worker.received[-1].get("cache_salt") != body["cache_salt"]
    assert "cache_salt" not in worker.received[-1]  # the default tenant's requests hash as they always have
    assert gw.metric("kvserving_gateway_conversation_identities_total", {"source": "prefix"}) == 0
    # its own tenant continues it
    client(gw.url).chat.completions.create(model=MODEL, messages=messages, extra_body={"cache_salt": "tenant-a"})
    assert worker.received[-1]["conversation_key"] == body["conversation_key"]
    assert gw.metric("kvserving_gateway_conversation_identities_total", {"source": "prefix"}) == 1
    # text completions carry it too
    client(gw.url).completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    assert worker.received[-1]["cache_salt"] == body["cache_salt"]


def test_sharing_tenants_sends_no_salt(stack: Stack, tokenizer: TextTokenizer) -> None:
    worker = stack.worker(role="both", reply_ids=tokenizer.encode_ids("Done."))
    gw = stack.gateway(decode=[worker.url], api_keys=("sk-alice",), security=SecurityConfig(tenants_share_cache=True))
    client(gw.url, "sk-alice").chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, {"role": "user", "content": "hi"}],
        extra_headers={"X-Session-ID": "s"},
        extra_body={"cache_salt": "x"},
    )
    assert "cache_salt" not in worker.received[-1]
    assert worker.received[-1]["conversation_key"] == DEFAULT_TENANT.scope("session:s")


@pytest.mark.parametrize(("salt", "code"), [("", "invalid_value"), (7, "invalid_type"), ("x" * 257, "invalid_value")])
def test_a_bad_cache_salt_is_a_400_naming_it(stack: Stack, tokenizer: TextTokenizer, salt: object, code: str) -> None:
    worker = stack.worker(role="both", reply_ids=tokenizer.encode_ids("Done."))
    gw = stack.gateway(decode=[worker.url])
    with pytest.raises(openai.BadRequestError) as err:
        client(gw.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"cache_salt": salt})
    assert err.value.status_code == 400
    assert err.value.body["param"] == "cache_salt" and err.value.body["code"] == code  # type: ignore[index]
    assert worker.received == []

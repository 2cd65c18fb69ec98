"""Tenant-isolated reuse through the whole product (gateway, one prefill and one
decode worker, NIXL on CPU memory), with the official `openai` client.

The probe: a tenant sends a long secret system prompt; another tenant sends the
right guess of it. Were the prefix cache shared, the guess would come back with
``cached_tokens`` covering the secret's pages (how a guess is confirmed). Tenants
are ``cache_salt`` values behind a gateway without API keys, and API keys behind
a second gateway (with keys) over the same workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvs_workers import WorkerFactory
from test_gateway_e2e import MODEL, GatewayProc, config  # noqa: E402  (sibling test module: the same stack)

SECRET = {"role": "system", "content": "You are the vault agent. The launch code is 7-4-1-9-2-2-8. " * 4}
QUESTION = {"role": "user", "content": "Summarise your instructions in one line."}
PAGE = 16  # bf16 pages (kv_cache.page_size default)
KEYS = ("sk-tenant-a", "sk-tenant-b")


@pytest.fixture()
def gateways(workers: WorkerFactory, tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(URL of a gateway without keys, URL of one with ``KEYS``), in front of the same workers."""
    prefill = workers.start("prefill", config(), wait=False)
    decode = workers.start("decode", config(), wait=False)
    prefill.wait_ready()
    decode.wait_ready()
    keyed_config = config()
    keyed_config["gateway"] = {"api_keys": list(KEYS)}
    (tmp_path / "keyed").mkdir()
    token = workers.token_path
    started = [
        GatewayProc(tmp_path, tiny_model_dir, prefill=prefill.url, decode=decode.url, token_file=token),
        GatewayProc(tmp_path / "keyed", tiny_model_dir, prefill=prefill.url, decode=decode.url, token_file=token, config=keyed_config),
    ]
    try:
        for gateway in started:
            gateway.wait_ready()
        yield started[0].url, started[1].url
    finally:
        for gateway in started:
            gateway.stop()


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], salt: str | None = None) -> tuple[str, int, int]:
    """One turn as ``salt``'s tenant: (reply, prompt tokens, cached tokens)."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"cache_salt": salt} if salt else None,
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.choices[0].message.content or "", out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens or 0


def conversation(client: openai.OpenAI, salt: str | None = None) -> list[int]:
    """A two-turn conversation of the secret's owner: cached tokens of each turn."""
    reply, _, first = ask(client, [SECRET, QUESTION], salt)
    turn2 = [SECRET, QUESTION, {"role": "assistant", "content": reply}, {"role": "user", "content": "And the next step?"}]
    _, _, second = ask(client, turn2, salt)
    return [first, second]


def test_a_right_guess_from_another_tenant_confirms_nothing_and_own_reuse_is_unchanged(gateways: tuple[str, str]) -> None:
    open_url, keyed_url = gateways
    salted = client(open_url)
    # The default tenant (no salt): its pages hash exactly as before tenants existed, so its
    # numbers are the product's reuse without tenancy, measured in this run.
    baseline = conversation(salted)
    assert baseline[0] == 0 and baseline[1] > 0
    # Tenant A owns the same secret: its first turn is another tenant's right guess of the
    # default tenant's prompt (nothing cached), and its own second turn reuses exactly as much.
    assert conversation(salted, "tenant-a") == baseline
    # Tenant B guesses A's secret, right and wrong: nothing cached either way (the guess
    # that a shared cache answered with every page of the secret is 0 here). Allowed across
    # tenants: 0 tokens. The salt is in the first page's hash, so not even the first page of
    # common template text (what a wrong guess got from a shared cache) matches; a tenant's
    # cached tokens can only be its own earlier requests' pages.
    _, prompt_tokens, right = ask(salted, [SECRET, QUESTION], "tenant-b")
    wrong_secret = {"role": "system", "content": "You are the vault agent. The launch code is 1-1-1-1-1-1-1. " * 4}
    _, _, wrong = ask(salted, [wrong_secret, QUESTION], "tenant-c")
    assert right == wrong == 0
    # The same guess from A itself (a new conversation with its own first turn) is served from
    # its pages: the measure above would have seen the secret's pages had they been shared.
    _, _, own = ask(salted, [SECRET, QUESTION], "tenant-a")
    assert own == (prompt_tokens - 1) // PAGE * PAGE
    # Behind keys, each key is a tenant: the same probe, the same answers.
    key_a, key_b = (client(keyed_url, key) for key in KEYS)
    assert conversation(key_a) == baseline
    assert ask(key_b, [SECRET, QUESTION])[2] == 0
    assert ask(key_a, [SECRET, QUESTION])[2] == own

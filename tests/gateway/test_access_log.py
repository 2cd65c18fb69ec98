"""The access log: one line per request (route, status, conversation, prompt / cached /
computed tokens, TTFT, duration), API routes at INFO, probes and scrapes at DEBUG, never a
message's content or a key."""

from __future__ import annotations

import logging
import re
import time

import httpx
import openai
import pytest
from gw_harness import MODEL, Stack

LINE = re.compile(
    r"^POST /v1/chat/completions 200 conv=([0-9a-f]{12}) prompt=(\d+) cached=(\d+) computed=(\d+) "
    r"ttft_ms=(\d+\.\d) ms=(\d+\.\d)$"
)
SECRET = "the secret word is marmalade"


def lines(caplog: pytest.LogCaptureFixture, level: int, count: int) -> list[str]:
    """The access-log lines at ``level`` once there are ``count`` (each is written after its response's last byte)."""
    deadline = time.monotonic() + 30
    while True:
        got = [r.getMessage() for r in caplog.records if r.name == "kvserving.gateway.access" and r.levelno == level]
        if len(got) >= count or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_one_line_per_request_with_its_tokens_and_no_content_or_key(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvserving.gateway.access")
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url], api_keys=("sk-access-log",))
    client = openai.OpenAI(base_url=gw.base_url, api_key="sk-access-log", max_retries=0)
    messages = [{"role": "system", "content": SECRET * 20}, {"role": "user", "content": "hi"}]
    usages = []
    for turn in range(2):
        out = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            prompt_cache_key="agent-7",
            stream=turn == 1,
            stream_options={"include_usage": True} if turn == 1 else openai.NOT_GIVEN,
        )
        if turn == 0:
            usages.append(out.usage)
            messages += [{"role": "assistant", "content": out.choices[0].message.content}, {"role": "user", "content": "more"}]
        else:
            usages.append([c.usage for c in out if c.usage][0])
    assert httpx.get(gw.url + "/metrics", timeout=5).status_code == 200
    assert httpx.get(gw.url + "/v1/models", timeout=5).status_code == 401
    assert httpx.get(gw.url + "/x%0AGET%20/v1/models", headers={"Authorization": "Bearer sk-access-log"}, timeout=5).status_code == 404

    info = lines(caplog, logging.INFO, 4)
    assert len(info) == 4, info
    parsed = [LINE.match(line) for line in info[:2]]
    assert all(parsed), info
    for match, usage in zip(parsed, usages, strict=True):
        assert match is not None and usage is not None
        prompt, cached, computed = (int(match.group(i)) for i in (2, 3, 4))
        assert (prompt, cached) == (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
        assert computed == prompt - cached
        assert 0 < float(match.group(5)) <= float(match.group(6))
    assert parsed[0].group(1) == parsed[1].group(1)  # type: ignore[union-attr]  # one conversation
    assert int(parsed[1].group(3)) > 0  # type: ignore[union-attr]  # its second turn reused the first's KV
    assert re.match(r"^GET /v1/models 401 conv=- prompt=- cached=- computed=- ttft_ms=- ms=\d+\.\d$", info[2]), info[2]
    # a client's URL cannot start a line of its own
    assert re.match(r"^GET /x\\nGET /v1/models 404 conv=- prompt=- cached=- computed=- ttft_ms=- ms=\d+\.\d$", info[3]), info[3]
    debug = lines(caplog, logging.DEBUG, 1)
    assert any(line.startswith("GET /metrics 200 ") for line in debug), debug
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "marmalade" not in text and "sk-access-log" not in text and "agent-7" not in text

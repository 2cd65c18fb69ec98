"""Every refusal of the gateway, asserted exactly: status, OpenAI error body, headers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from kvs_poll import wait_until
from gw_harness import MODEL, Stack

from kvserving.gateway.prompt.tokenizer import TextTokenizer

CHAT = "/v1/chat/completions"


def post(gw, body, *, path: str = CHAT, headers: dict | None = None) -> httpx.Response:  # type: ignore[no-untyped-def]
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(gw.url + path, content=content, headers={"content-type": "application/json", **(headers or {})}, timeout=10)


def error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


USER = [{"role": "user", "content": "hi"}]


def test_request_errors_in_openai_shape(stack: Stack) -> None:
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url], max_body_bytes=4096)
    r = post(gw, b"{not json")
    assert r.status_code == 400 and error(r)["code"] == "invalid_json" and error(r)["type"] == "invalid_request_error"
    r = post(gw, {"model": MODEL})
    assert r.status_code == 400 and (error(r)["param"], error(r)["code"]) == ("messages", "missing_required_parameter")
    r = post(gw, {"model": MODEL, "messages": []})
    assert r.status_code == 400 and (error(r)["param"], error(r)["code"]) == ("messages", "empty_array")
    r = post(gw, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and error(r)["param"] == "messages[0].role"
    assert "wizard" in error(r)["message"]
    r = post(gw, {"model": MODEL, "messages": [{"role": "user", "content": 42}]})
    assert r.status_code == 400 and error(r)["param"] == "messages[0].content"
    r = post(gw, {"model": "gpt-4o", "messages": USER})
    assert r.status_code == 404
    assert error(r) == {
        "message": "The model `gpt-4o` does not exist.",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    r = post(gw, {"model": MODEL, "messages": USER, "n": 2})
    assert r.status_code == 400 and (error(r)["param"], error(r)["code"]) == ("n", "unsupported_value")
    assert "n=2" in error(r)["message"]
    r = post(gw, {"model": MODEL, "messages": USER, "temperature": "hot"})
    assert r.status_code == 400 and error(r)["param"] == "temperature"
    r = post(gw, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"
    assert "4096" in error(r)["message"]
    r = post(gw, [1, 2])
    assert r.status_code == 400 and error(r)["message"] == "The request body must be a JSON object."
    r = httpx.get(gw.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and error(r)["code"] == "unknown_url"
    # what the gateway cannot honour is refused, not answered as if it had been (the real client raises)
    client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"})  # type: ignore[arg-type]
    assert (refused.value.param, refused.value.code) == ("response_format", "unsupported_value")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=USER, frequency_penalty=0.5)  # type: ignore[arg-type]
    assert (refused.value.param, refused.value.code) == ("frequency_penalty", "unsupported_value")
    assert gw.metric("kvserving_gateway_requests_total", {"route": CHAT, "code": "400"}) == 10
    assert worker.received == []  # nothing reached the worker


def test_completion_routes_refuse_other_methods_and_chunked_oversized_bodies(stack: Stack) -> None:
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url], max_body_bytes=4096)
    for path in (CHAT, "/v1/completions"):
        r = httpx.get(gw.url + path, timeout=5)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert error(r) == {"message": "Method Not Allowed", "type": "invalid_request_error", "param": None, "code": None}
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    r = httpx.post(gw.url + CHAT, content=iter([big[:1000], big[1000:]]), timeout=10)  # chunked: no content-length
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"
    assert r.headers["content-type"] == "application/json"
    assert gw.metric("kvserving_gateway_requests_total", {"route": CHAT, "code": "405"}) == 1
    assert gw.metric("kvserving_gateway_requests_total", {"route": CHAT, "code": "413"}) == 1
    assert worker.received == []


def test_streamed_reply_headers(stack: Stack) -> None:
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url])
    with httpx.stream("POST", gw.url + CHAT, json={"model": MODEL, "messages": USER, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        assert (r.headers["content-type"], r.headers["cache-control"], r.headers["x-accel-buffering"]) == (
            "text/event-stream; charset=utf-8",
            "no-cache",
            "no",
        )
        assert r.read().endswith(b"data: [DONE]\n\n")


def test_prompt_longer_than_the_context_names_the_numbers(stack: Stack, tiny_model_dir: Path) -> None:
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url], max_model_len=64)
    n = len(TextTokenizer.from_dir(tiny_model_dir).encode_ids("<|im_start|>user\n" + "word " * 80 + "<|im_end|>\n<|im_start|>assistant\n"))
    r = post(gw, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 80}], "max_tokens": 10})
    assert r.status_code == 400
    assert error(r) == {
        "message": f"This model's maximum context length is 64 tokens. However, you requested {n + 10} tokens "
        f"({n} in the messages, 10 in the completion). Please reduce the length of the messages or completion.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    r = post(gw, {"model": MODEL, "messages": USER, "max_tokens": 10})
    assert r.status_code == 200
    assert worker.received[-1]["sampling"]["max_tokens"] == 10
    post(gw, {"model": MODEL, "messages": USER})  # no max_tokens: what the context leaves
    assert worker.received[-1]["sampling"]["max_tokens"] == 64 - len(worker.received[-1]["input_ids"])


def test_no_healthy_worker_is_503_with_retry_after(stack: Stack) -> None:
    worker = stack.worker(role="both", ready=False)
    gw = stack.gateway(decode=[worker.url])
    r = post(gw, {"model": MODEL, "messages": USER})
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert error(r)["type"] == "service_unavailable_error"
    assert httpx.get(gw.url + "/ready", timeout=5).status_code == 503
    worker.ready = True  # comes back into the rotation at the next health poll
    wait_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200)
    assert post(gw, {"model": MODEL, "messages": USER}).status_code == 200
    worker.ready = False
    wait_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 503)
    assert post(gw, {"model": MODEL, "messages": USER}).status_code == 503


def test_unreachable_worker_is_503_and_leaves_the_rotation(stack: Stack) -> None:
    gw = stack.gateway(decode=["http://127.0.0.1:9"], health_interval_s=60)
    r = post(gw, {"model": MODEL, "messages": USER})
    assert r.status_code == 503 and r.headers["retry-after"] == "2"


def test_upstream_refusal_before_the_first_token_is_an_http_error(stack: Stack) -> None:
    worker = stack.worker(role="both", fail_status=500)
    gw = stack.gateway(decode=[worker.url])
    for stream in (False, True):
        r = post(gw, {"model": MODEL, "messages": USER, "stream": stream})
        assert r.status_code == 502
        assert error(r) == {
            "message": "worker error (500): injected failure",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "status"}) == 2


def test_upstream_failure_mid_stream_is_an_error_event_then_the_stream_closes(stack: Stack, tiny_model_dir: Path) -> None:
    tok = TextTokenizer.from_dir(tiny_model_dir)
    worker = stack.worker(role="both", reply_ids=tok.encode_ids("one two three four"), fail_after_tokens=2)
    gw = stack.gateway(decode=[worker.url])
    with httpx.stream("POST", gw.url + CHAT, json={"model": MODEL, "messages": USER, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-1]) == {
        "error": {"message": "worker error: injected mid-stream failure", "type": "server_error", "param": None, "code": "upstream_error"}
    }
    assert "[DONE]" not in events
    contents = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(contents) == tok.decode(tok.encode_ids("one two three four")[:2], skip_special_tokens=False)
    client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="injected mid-stream failure"):
        list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))  # type: ignore[arg-type]
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "worker_error"}) == 2


def test_api_keys_guard_everything_but_health_ready_metrics(stack: Stack) -> None:
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url], api_keys=("sk-one", "sk-two"))
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-one"}):
        r = post(gw, {"model": MODEL, "messages": USER}, headers=headers)
        assert r.status_code == 401 and error(r)["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(gw.url + "/v1/models", headers=headers, timeout=5).status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(gw.url + path, timeout=5).status_code == 200
    assert post(gw, {"model": MODEL, "messages": USER}, headers={"Authorization": "Bearer sk-two"}).status_code == 200
    good = openai.OpenAI(base_url=gw.base_url, api_key="sk-one", max_retries=0)
    assert good.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base_url, api_key="sk-nope", max_retries=0).models.list()
    assert gw.metric("kvserving_gateway_requests_total", {"route": "/v1/chat/completions", "code": "401"}) == 3


def test_a_worker_gone_before_the_first_token_is_left_for_another(stack: Stack) -> None:
    a, b = stack.worker(role="both"), stack.worker(role="both")
    gw = stack.gateway(decode=[a.url, b.url], health_interval_s=60)  # the poll will not notice in time
    first, second = sorted([a, b], key=lambda w: w.url)  # ties go to the first URL
    server = next(s for s in stack.servers if getattr(s, "url", None) == first.url)
    server.stop()
    r = post(gw, {"model": MODEL, "messages": USER})
    assert r.status_code == 200
    assert len(second.received) == 1
    assert gw.metric("kvserving_gateway_upstream_errors_total", {"kind": "connect"}) == 1
    assert gw.metric("kvserving_gateway_routing_decisions_total", {"role": "retry", "reason": "connect"}) == 1
    assert not gw.state.pool.workers[first.url].healthy  # out of the rotation until /ready answers again
    assert post(gw, {"model": MODEL, "messages": USER}).status_code == 200
    assert len(second.received) == 2

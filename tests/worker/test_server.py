"""The worker HTTP server (`kvserving.worker.server`) on a real uvicorn socket:
streams equal the offline engine, usage counts cached and computed tokens,
malformed bodies get one-line 4xx errors, duplicates 409, a client that goes
away frees its pages, /metrics exports every worker metric of the dashboard."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_worker import Live, start_live, stop_live

from kvserving.config import KVCacheConfig, ModelConfig, ServingConfig
from kvserving.operator.dashboard import DASHBOARD_METRICS
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.puller import FALLBACK_REASONS
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.service import WorkerService

PAGE = 16
MAX_LEN = 512


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> ServingConfig:
    return ServingConfig(
        model=ModelConfig(path=str(tiny_model_dir), max_model_len=MAX_LEN),
        kv_cache=KVCacheConfig(dtype="bf16", memory_bytes=4 << 20),
    )


def generate(live: Live, body: dict[str, Any], *, timeout: float = 60) -> tuple[list[int], dict[str, Any]]:
    """POST /internal/generate; the streamed token ids and the final event."""
    tokens: list[int] = []
    final: dict[str, Any] = {}
    done = False
    with httpx.stream("POST", live.url + "/internal/generate", json=body, headers=live.headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line or line.startswith(":"):  # a blank separator or a keep-alive comment
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            tokens.extend(event["token_ids"])
            if "finish_reason" in event:
                final = event
    assert done and final
    return tokens, final


def body(rid: str, ids: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"request_id": rid, "input_ids": ids, "sampling": {"max_tokens": max_tokens, "ignore_eos": True}, **extra}


def test_stream_equals_offline_engine_and_usage_counts_the_prefix_cache(live: Live, config: ServingConfig) -> None:
    prompt = [(7 * i + 3) % 4000 + 50 for i in range(70)]  # 70 tokens: 4 full pages + 6
    want = LLMEngine(config).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]

    tokens, final = generate(live, body("first", prompt))
    assert tokens == want
    assert final["finish_reason"] == "length"
    assert final["kv_transfer_params"] is None
    assert final["usage"] == {
        "prompt_tokens": 70,
        "completion_tokens": 8,
        "local_cached_tokens": 0,
        "remote_pulled_tokens": 0,
        "computed_prompt_tokens": 70,
        "kv_bytes_pulled": 0,
        "kv_regions_pulled": 0,
        "reuse_fallback": None,
    }
    # the same prompt again: its 4 full pages come from the prefix cache
    tokens, final = generate(live, body("second", prompt))
    assert tokens == want
    assert final["usage"]["local_cached_tokens"] == 64
    assert final["usage"]["computed_prompt_tokens"] == 6


def test_concurrent_streams_are_batched_and_each_equals_its_offline_output(live: Live, config: ServingConfig) -> None:
    prompts = [[(13 * i + k) % 3000 + 100 for i in range(n)] for k, n in enumerate((5, 40, 17, 33))]
    params = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=7)]
    engine = LLMEngine(config)
    want = [engine.generate([p], params[k % 2])[0] for k, p in enumerate(prompts)]
    results: dict[int, list[int]] = {}

    def run(k: int) -> None:
        sampling = (
            {"max_tokens": 12, "ignore_eos": True}
            if k % 2 == 0
            else {"max_tokens": 12, "temperature": 0.8, "top_k": 50, "seed": 7, "ignore_eos": True}
        )
        results[k] = generate(live, {"request_id": f"conc-{k}", "input_ids": prompts[k], "sampling": sampling})[0]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results.get(k) for k in range(len(prompts))] == want


BAD_BODIES: list[tuple[str, Any, int, str]] = [
    ("bad json", b'{"request_id": "x", "input_ids": [1,', 400, "request body is not valid JSON"),
    ("unknown field", {"request_id": "x", "input_ids": [1], "prompt": "hi"}, 422, "prompt: Extra inputs are not permitted"),
    ("unknown sampling field", {"request_id": "x", "input_ids": [1], "sampling": {"n": 2}}, 422, "sampling.n: Extra inputs"),
    ("id as string", {"request_id": "x", "input_ids": ["1"]}, 422, "input_ids.0: Input should be a valid integer"),
    ("negative id", {"request_id": "x", "input_ids": [-1]}, 422, "input_ids.0: Input should be greater than or equal to 0"),
    ("empty prompt", {"request_id": "x", "input_ids": []}, 422, "input_ids: List should have at least 1 item"),
    ("id outside vocab", {"request_id": "x", "input_ids": [1, 4096]}, 400, "input_ids outside the vocabulary [0, 4096): [4096]"),
    ("tag 56", {"request_id": "x", "input_ids": [1, 2], "tags": [0, 56]}, 422, "tags.1: Input should be less than or equal to 55"),
    ("tags length", {"request_id": "x", "input_ids": [1, 2], "tags": [0]}, 422, "tags has 1 entries for 2 input_ids"),
    (
        "prompt too long",
        {"request_id": "x", "input_ids": [5] * MAX_LEN},
        400,
        f"prompt of {MAX_LEN} tokens does not fit the context length {MAX_LEN}",
    ),
    (
        "max_tokens 0",
        {"request_id": "x", "input_ids": [1], "sampling": {"max_tokens": 0}},
        422,
        "sampling.max_tokens: Input should be greater than or equal to 1",
    ),
    ("temperature nan", b'{"request_id": "x", "input_ids": [1], "sampling": {"temperature": NaN}}', 422, "sampling.temperature"),
    ("no request id", {"input_ids": [1]}, 422, "request_id: Field required"),
    (
        "kv params page ids as strings",
        {
            "request_id": "x",
            "input_ids": [1],
            "kv_transfer_params": {
                "engine_id": "e",
                "agent_url": "http://a",
                "lease_id": "l",
                "page_ids": ["0"],
                "page_hashes": [1],
                "num_tokens": 16,
                "page_size": 16,
                "dtype": "bf16",
                "layout_hash": "h",
                "expires_at": 1.0,
            },
        },
        422,
        "kv_transfer_params.page_ids.0: Input should be a valid integer",
    ),
    (
        "kv params lengths",
        {
            "request_id": "x",
            "input_ids": [1],
            "kv_transfer_params": {
                "engine_id": "e",
                "agent_url": "http://a",
                "lease_id": "l",
                "page_ids": [0, 1],
                "page_hashes": [1],
                "num_tokens": 16,
                "page_size": 16,
                "dtype": "bf16",
                "layout_hash": "h",
                "expires_at": 1.0,
            },
        },
        422,
        "page_ids has 2 entries but page_hashes has 1",
    ),
    (
        "kv params missing",
        {"request_id": "x", "input_ids": [1], "kv_transfer_params": {"engine_id": "e"}},
        422,
        "kv_transfer_params.agent_url: Field required",
    ),
    ("body not an object", [1, 2], 422, "Input should be a valid dictionary"),
]


@pytest.mark.parametrize(("case", "payload", "status", "message"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_malformed_requests_get_a_one_line_4xx(live: Live, case: str, payload: Any, status: int, message: str) -> None:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = httpx.post(
        live.url + "/internal/generate", content=content, headers={"content-type": "application/json", **live.headers}, timeout=30
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"]
    assert "\n" not in err["message"]
    assert set(err) == {"message", "type", "code"}
    assert httpx.get(live.url + "/health", timeout=5).json()["status"] == "ok"


def test_a_body_over_the_limit_is_refused_before_it_is_read(live: Live) -> None:
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /internal/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + live.token.encode() + b"\r\nContent-Length: 100000000\r\n\r\n{"
        )
        reply = b""
        while b"bytes" not in reply and len(reply) < 65536:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413")
    assert b'"message":"request body over 67108864 bytes"' in reply


def test_an_engine_failure_ends_the_streams_with_an_error_event_and_the_worker_goes_on(live: Live) -> None:
    assert live.service.engine is not None
    runner = live.service.engine.engine.runner
    real = runner.execute

    def broken(*args: Any, **kwargs: Any) -> Any:
        runner.execute = real  # type: ignore[method-assign]  # fail one step only
        raise RuntimeError("injected device fault")

    runner.execute = broken  # type: ignore[method-assign]
    with httpx.stream("POST", live.url + "/internal/generate", json=body("boom", [5, 6, 7]), headers=live.headers, timeout=60) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line and not line.startswith(":")]
    assert json.loads(events[0]) == {"error": {"message": "engine error: injected device fault", "type": "engine_error", "code": None}}
    assert events[-1] == "[DONE]"
    _wait_idle(live)
    tokens, final = generate(live, body("after-boom", [5, 6, 7], max_tokens=3))
    assert len(tokens) == 3 and final["finish_reason"] == "length"


def test_unknown_route_and_lease_are_404_in_the_error_shape(live: Live) -> None:
    r = httpx.get(live.url + "/nope", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    r = httpx.post(live.url + "/internal/kv/leases/nope/renew", headers=live.headers, timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_lease"
    r = httpx.delete(live.url + "/internal/kv/leases/nope", headers=live.headers, timeout=5)
    assert r.status_code == 404 and "unknown lease 'nope'" in r.json()["error"]["message"]
    assert httpx.get(live.url + "/internal/kv/leases", headers=live.headers, timeout=5).json() == {"leases": []}


def _kv_stats(live: Live) -> dict[str, Any]:
    r = httpx.get(live.url + "/internal/kv/stats", headers=live.headers, timeout=10)
    assert r.status_code == 200
    stats: dict[str, Any] = r.json()
    return stats


def _wait_idle(live: Live, *, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = _kv_stats(live)
        if stats["in_flight"] == 0 and stats["running"] == 0 and stats["pages"]["owned"] == 0:
            return stats
        assert time.monotonic() < deadline, f"request still holds pages: {stats}"
        time.sleep(0.05)


def test_duplicate_in_flight_id_is_409_and_a_disconnect_frees_the_pages(live: Live) -> None:
    prompt = list(range(100, 140))
    with httpx.stream(
        "POST", live.url + "/internal/generate", json=body("dup", prompt, max_tokens=400), headers=live.headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line and not line.startswith(":"))
        assert json.loads(first[len("data: ") :])["token_ids"]
        again = httpx.post(live.url + "/internal/generate", json=body("dup", [1, 2, 3]), headers=live.headers, timeout=30)
        assert again.status_code == 409
        assert again.json()["error"] == {
            "message": "request_id 'dup' is already in flight",
            "type": "conflict",
            "code": "duplicate_request_id",
        }
        busy = _kv_stats(live)
        assert busy["in_flight"] == 1 and busy["pages"]["owned"] >= 3
    # the client is gone: the request is aborted and every page is back in the pool
    stats = _wait_idle(live)
    total = stats["pages"]["total"]
    assert stats["pages"]["free"] + stats["pages"]["cached"] == total
    metrics = httpx.get(live.url + "/metrics", timeout=10).text
    assert 'kvserving_worker_requests_total{finish_reason="abort"} 1.0' in metrics
    # the id is free again
    tokens, final = generate(live, body("dup", [1, 2, 3], max_tokens=2))
    assert len(tokens) == 2 and final["finish_reason"] == "length"


def test_metrics_export_every_worker_metric_with_values(live: Live) -> None:
    def scrape() -> dict[str, Any]:
        return {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics", timeout=10).text)}

    def value(name: str, **labels: str) -> float:
        fam = families[name]
        for s in fam.samples:
            if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
        raise AssertionError(f"no sample {name}{labels}")

    families = scrape()
    steps_before = {kind: value("kvserving_worker_steps", kind=kind) for kind in ("decode", "mixed")}
    firsts_before = value("kvserving_worker_first_token_requests")
    generate(live, body("metrics-a", list(range(200, 250)), max_tokens=4))
    generate(live, body("metrics-b", list(range(200, 250)), max_tokens=4))  # 3 pages from the cache
    families = scrape()
    # each request: one step with its prompt chunk (its first token), three decode steps
    assert value("kvserving_worker_steps", kind="mixed") - steps_before["mixed"] == 2
    assert value("kvserving_worker_steps", kind="decode") - steps_before["decode"] == 6
    assert value("kvserving_worker_step_seconds", kind="decode") > 0
    # each request's first token: counted once, its step's time among the phases
    assert value("kvserving_worker_first_token_requests") - firsts_before == 2
    assert value("kvserving_worker_first_token_phase_seconds", phase="first_step") > 0

    worker_metrics = [(n, t) for n, t, _ in DASHBOARD_METRICS if n.startswith("kvserving_worker_")]
    assert len(worker_metrics) == 10
    for name, kind in worker_metrics:
        base = name.removesuffix("_total") if kind == "counter" else name
        assert base in families, name
        assert families[base].type == kind, name
    assert value("kvserving_worker_prompt_tokens") >= 50 + 2
    assert value("kvserving_worker_generation_tokens") >= 8
    assert 0.0 <= value("kvserving_worker_kv_cache_usage_ratio") <= 1.0
    assert families["kvserving_worker_kv_transfer_bytes"].type == "counter"
    assert value("kvserving_worker_prompt_tokens_by_source", source="local_cache") >= 48
    assert value("kvserving_worker_prompt_tokens_by_source", source="computed") >= 50
    assert value("kvserving_worker_prompt_tokens_by_source", source="remote_pull") == 0
    for reason in FALLBACK_REASONS:
        assert value("kvserving_worker_kv_reuse_fallbacks", reason=reason) == 0
    assert value("kvserving_worker_requests", finish_reason="length") >= 2
    assert value("kvserving_worker_kernel_compiles", phase="serving") == 0  # nothing compiles on a CPU
    assert value("kvserving_worker_kv_pool_capacity_tokens", precision="bf16") == live.service.engine.engine.capacity_tokens  # type: ignore[union-attr]
    assert value("kvserving_worker_kv_pool_pages", precision="bf16", state="capacity") > 0
    assert value("kvserving_worker_queue_depth", state="running") == 0
    assert value("kvserving_worker_queue_depth", state="waiting") == 0
    assert value("kvserving_worker_ready") == 1
    for name, kind in [
        ("kvserving_worker_kv_transfer_seconds", "histogram"),
        ("kvserving_worker_kv_transfer_regions", "histogram"),
        ("kvserving_worker_preemptions", "counter"),
        ("kvserving_worker_kv_leases", "gauge"),
        ("kvserving_worker_kv_leased_tokens", "gauge"),
    ]:
        assert families[name].type == kind, name


def test_both_worker_retains_under_a_lease_and_reuses_its_own_kv(live: Live, config: ServingConfig) -> None:
    prompt = list(range(300, 400))  # 100 tokens
    reply, first = generate(live, body("turn-1", prompt, conversation_key="c1", retain=True))
    params = first["kv_transfer_params"]
    assert params["lease_id"].startswith("kv-") and params["engine_id"] == "test-both"
    assert params["agent_url"] == live.url
    assert params["num_tokens"] == (100 + 8 - 1) // PAGE * PAGE  # prompt + reply with KV, full pages
    assert len(params["page_ids"]) == len(params["page_hashes"]) == 6
    listed = httpx.get(live.url + "/internal/kv/leases", params={"conversation_key": "c1"}, headers=live.headers, timeout=10).json()[
        "leases"
    ]
    assert [(le["lease_id"], le["num_pages"], le["num_tokens"]) for le in listed] == [(params["lease_id"], 6, 96)]
    assert listed[0]["kv_transfer_params"]["page_ids"] == params["page_ids"]

    # the next turn: the history (prompt + reply) comes from this worker's own retained pages
    prompt2 = prompt + reply + list(range(500, 520))  # 128 tokens
    want = LLMEngine(config).generate([prompt2], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    tokens, second = generate(live, body("turn-2", prompt2, kv_transfer_params=params, conversation_key="c1", retain=True))
    assert tokens == want
    u = second["usage"]
    assert (u["local_cached_tokens"], u["remote_pulled_tokens"], u["computed_prompt_tokens"]) == (96, 0, 32)
    assert u["reuse_fallback"] is None and u["kv_bytes_pulled"] == 0
    new = second["kv_transfer_params"]
    listed = httpx.get(live.url + "/internal/kv/leases", headers=live.headers, timeout=10).json()["leases"]
    assert [le["lease_id"] for le in listed] == [new["lease_id"]]  # one lease per conversation: the newest

    # renew: capped at the retention TTL; release: pages go back to the prefix cache, not the free list
    now = time.time()
    r = httpx.post(live.url + f"/internal/kv/leases/{new['lease_id']}/renew", json={"ttl_s": 1e6}, headers=live.headers, timeout=10)
    assert r.status_code == 200
    assert now + 470 < r.json()["expires_at"] <= time.time() + 480 + 0.5
    assert {k: v for k, v in r.json().items() if k != "expires_at"} == {
        "lease_id": new["lease_id"],
        "page_ids": new["page_ids"],
        "page_hashes": new["page_hashes"],
        "num_tokens": new["num_tokens"],
    }
    r = httpx.post(live.url + f"/internal/kv/leases/{new['lease_id']}/renew", json={"ttl_s": 5}, headers=live.headers, timeout=10)
    assert now + 4 < r.json()["expires_at"] <= time.time() + 5.5
    assert (
        httpx.post(
            live.url + f"/internal/kv/leases/{new['lease_id']}/renew", json={"ttl_s": -1}, headers=live.headers, timeout=10
        ).status_code
        == 422
    )
    held = _kv_stats(live)
    assert held["leases"] == 1 and held["leased_tokens"] == new["num_tokens"] and held["pages"]["owned"] == 8
    r = httpx.delete(live.url + f"/internal/kv/leases/{new['lease_id']}", headers=live.headers, timeout=10)
    assert r.status_code == 200 and r.json() == {"lease_id": new["lease_id"], "released": True}
    assert httpx.delete(live.url + f"/internal/kv/leases/{new['lease_id']}", headers=live.headers, timeout=10).status_code == 404
    after = _wait_idle(live)
    assert after["leases"] == 0 and after["pages"]["cached"] >= 8
    tokens, third = generate(live, body("turn-2-again", prompt2))
    assert tokens == want and third["usage"]["local_cached_tokens"] == 112  # (128 - 1) // 16 pages, from the LRU


def test_agent_metadata_names_the_engine_and_layout(live: Live) -> None:
    info = httpx.get(live.url + "/internal/kv/agent", headers=live.headers, timeout=10).json()
    assert info["engine_id"] == "test-both"
    assert info["layout"]["dtype"] == "bf16" and info["layout"]["page_size"] == PAGE
    assert len(info["layout_hash"]) >= 16 and len(info["metadata"]) > 100


def test_health_answers_while_the_model_loads_and_ready_waits_for_it(config: ServingConfig) -> None:
    loaded = threading.Event()

    async def slow_startup(service: WorkerService) -> None:
        await asyncio.to_thread(loaded.wait, 60)  # the model "loads" until the test lets it
        await service.start(LLMEngine(config), transfer=False)

    live = start_live(config, role="decode", startup=slow_startup, wait_ready=False)
    url = live.url
    try:
        assert httpx.get(url + "/health", timeout=5).json()["state"] == "starting"
        r = httpx.get(url + "/ready", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["message"] == "worker is starting"
        r = httpx.post(url + "/internal/generate", json=body("early", [1, 2]), headers=live.headers, timeout=5)
        assert r.status_code == 503
        assert httpx.get(url + "/internal/kv/stats", headers=live.headers, timeout=5).status_code == 503
        assert "kvserving_worker_ready 0.0" in httpx.get(url + "/metrics", timeout=5).text
        loaded.set()
        deadline = time.monotonic() + 60
        while (ready := httpx.get(url + "/ready", timeout=5)).status_code != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)
        # what a request may need, for the gateway's routing (the engine's admission check)
        assert live.service.engine is not None
        engine = live.service.engine.engine
        told = ready.json()
        assert (told["max_model_len"], told["kv_capacity_tokens"]) == (engine.max_model_len, engine.kv_cache.capacity_tokens_at(0.0))
        assert told["max_model_len"] > 0 and told["kv_capacity_tokens"] > 0
        tokens, _ = generate(live, body("late", [1, 2], max_tokens=2))
        assert len(tokens) == 2
    finally:
        loaded.set()
        stop_live(live)


def test_a_long_step_is_covered_by_keep_alive_comments_so_the_gateway_sees_a_busy_worker(live: Live) -> None:
    """A step (a long prefill) of 3.5 s: the stream carries a ``: keep-alive`` comment about
    every ``STREAM_KEEPALIVE_S`` meanwhile, then the same tokens as without the wait."""
    from kvserving.config import STREAM_KEEPALIVE_S

    assert live.service.engine is not None
    runner = live.service.engine.engine.runner
    real = runner.execute
    prompt = list(range(300, 340))
    expected, _ = generate(live, body("fast", prompt, max_tokens=3))

    def slow(*args: Any, **kwargs: Any) -> Any:
        runner.execute = real  # type: ignore[method-assign]  # one slow step only
        time.sleep(3.5)
        return real(*args, **kwargs)

    runner.execute = slow  # type: ignore[method-assign]
    with httpx.stream(
        "POST", live.url + "/internal/generate", json=body("slow", prompt, max_tokens=3), headers=live.headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    first_event = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    # about three comments during the step; at least two, so a late tick on a loaded machine still passes
    assert lines[:first_event] == [": keep-alive"] * first_event and first_event >= 3.5 / STREAM_KEEPALIVE_S - 1.5
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert [t for e in events for t in e["token_ids"]] == expected
    assert lines[-1] == "data: [DONE]"


def test_headers_go_out_at_once_and_keep_alive_comments_while_the_engine_thread_is_busy(live: Live) -> None:
    """A request that waits for the engine thread (a long step) is answered at once: its
    response headers, then a ``: keep-alive`` comment about every ``STREAM_KEEPALIVE_S``
    until it is queued and runs; the gateway's first-byte deadline sees a busy worker, not a
    frozen one. The tokens are those of an unhindered run."""
    from kvserving.config import STREAM_KEEPALIVE_S

    engine = live.service.engine
    assert engine is not None
    prompt = list(range(400, 440))
    expected, _ = generate(live, body("quick", prompt, max_tokens=3))
    # The engine thread is held from before the request until hold_s after its headers are in: no
    # fixed pause can race the request (a loaded machine only makes the wait longer).
    hold_s = 3.5 * STREAM_KEEPALIVE_S
    holding, headers_in = threading.Event(), threading.Event()

    def hold_the_engine_thread() -> None:
        holding.set()
        if headers_in.wait(60):
            time.sleep(hold_s)

    busy = threading.Thread(target=engine.run_sync, args=(hold_the_engine_thread,))
    busy.start()
    try:
        assert holding.wait(30)
        t0 = time.monotonic()
        with httpx.stream(
            "POST", live.url + "/internal/generate", json=body("waits", prompt, max_tokens=3), headers=live.headers, timeout=90
        ) as r:
            headers_s = time.monotonic() - t0
            headers_in.set()
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
    finally:
        headers_in.set()
        busy.join()
    assert headers_s < 30.0, headers_s  # not after the engine thread: that waits for them for 60 s
    first_event = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    # about three comments while the thread is held; at least two, so a late tick on a loaded machine still passes
    assert lines[:first_event] == [": keep-alive"] * first_event and first_event >= 2
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert [t for e in events for t in e["token_ids"]] == expected

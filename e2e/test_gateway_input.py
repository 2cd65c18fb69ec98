"""Client input against real processes: `kvserving gateway` in front of one `both`
`kvserving worker` whose KV pool is smaller than the context. A 7 MiB message is
refused before the gateway renders or tokenizes it, for little memory, and the
gateway's memory comes back; a prompt the pool cannot hold is a 400 the official
`openai` client raises as `BadRequestError`, without retrying; streamed, with a
prefill worker whose pool holds it and a decode worker whose pool does not, the
same 400 comes before the stream starts. Every malformed input of the in-process
app test (tests/gateway/malformed_inputs.py) is refused by the real gateway
process in OpenAI's shape before any worker request."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_gateway_e2e import GatewayProc, metric

from kvs_workers import WorkerFactory, WorkerProc

MODEL = "kvserving-tiny"
CHAT = "/v1/chat/completions"


def _malformed_inputs():  # type: ignore[no-untyped-def]
    """The case list the in-process app test uses (tests/gateway/malformed_inputs.py), loaded by path."""
    path = Path(__file__).resolve().parents[1] / "tests" / "gateway" / "malformed_inputs.py"
    spec = importlib.util.spec_from_file_location("malformed_inputs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("malformed_inputs", module)
    spec.loader.exec_module(module)
    return module


MALFORMED = _malformed_inputs()


def config() -> dict[str, Any]:
    # a 1 MiB bf16 KV pool holds a few hundred of the tiny model's tokens: fewer than the 1024-token context
    return {
        "model": {"max_model_len": 1024, "served_name": MODEL},
        "kv_cache": {"dtype": "bf16", "memory_bytes": 1 << 20},
    }


@contextlib.contextmanager
def _gateway(tmp: Path, model_dir: Path, worker: WorkerProc, workers: WorkerFactory, cfg: dict[str, Any]) -> Iterator[GatewayProc]:
    """A real gateway in front of one `both` worker, stopped at the end."""
    gateway = GatewayProc(tmp, model_dir, prefill=worker.url, decode=worker.url, token_file=workers.token_path, config=cfg)
    try:
        gateway.wait_ready()
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def served(
    workers: WorkerFactory, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProc, WorkerProc]]:
    worker = workers.start("both", config())
    with _gateway(tmp_path_factory.mktemp("gateway"), tiny_model_dir, worker, workers, config()) as gateway:
        yield gateway, worker


@pytest.fixture(scope="module")
def narrow(
    served: tuple[GatewayProc, WorkerProc], workers: WorkerFactory, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProc]:
    """A second real gateway in front of the same worker, with the 64-token context the cases assume."""
    short = {**config(), "model": {**config()["model"], "max_model_len": 64}}
    with _gateway(tmp_path_factory.mktemp("narrow"), tiny_model_dir, served[1], workers, short) as gateway:
        yield gateway


def _finished(url: str) -> float:
    """Generate requests the worker finished, every finish reason."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return sum(s.value for fam in families for s in fam.samples if s.name == "kvserving_worker_requests_total")


def test_every_malformed_input_is_a_4xx_from_the_real_gateway_before_the_worker(
    narrow: GatewayProc, served: tuple[GatewayProc, WorkerProc]
) -> None:
    """Each case of the in-process list, whole and streamed, on both routes: the error's shape and
    fields, one 4xx counted per request on its route, and no generate reached the worker."""
    _, worker = served
    finished = _finished(worker.url)
    routes = {c[0] for c in MALFORMED.ROUTED}
    before = {(r, s): metric(narrow.url, "kvserving_gateway_requests_total", route=r, code=s) for r in routes for s in ("400", "413")}
    sent: dict[tuple[str, str], int] = {}
    with httpx.Client(base_url=narrow.url, timeout=30) as client:
        for (route, name, change, _only, expected), stream in [(case, stream) for case in MALFORMED.ROUTED for stream in (False, True)]:
            r = client.post(route, content=MALFORMED.request_body(route, change, stream), headers={"content-type": "application/json"})
            body = r.json()
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (name, body)
            err = body["error"]
            assert (r.status_code, err["type"], err["code"], err["param"]) == expected, (name, route, stream, err["message"])
            sent[(route, str(r.status_code))] = sent.get((route, str(r.status_code)), 0) + 1
    assert sum(sent.values()) == 2 * len(MALFORMED.ROUTED)
    for key, n in sent.items():
        assert metric(narrow.url, "kvserving_gateway_requests_total", route=key[0], code=key[1]) == before[key] + n, key
    assert _finished(worker.url) == finished  # no generate reached the worker


def _memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (the most it has been resident) of a process, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024  # kB
    return out


def test_a_7_mib_message_is_refused_for_little_memory_that_comes_back(served: tuple[GatewayProc, WorkerProc]) -> None:
    gateway, _ = served
    pid = gateway.proc.pid

    def post(chars: int) -> httpx.Response:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "ab " * (chars // 3)}]})
        return httpx.post(gateway.url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=60)

    # One refusal first: what the route allocates once (its code paths' first use) is in the baseline.
    assert post(100_000).status_code == 400
    time.sleep(0.5)
    baseline = _memory_mib(pid)["VmRSS"]
    seen = metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code="400")
    for _ in range(10):
        r = post(7 << 20)
        assert r.status_code == 400
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "messages")
    # Transient: the body (~7.3 MB) is held as received, joined, decoded to JSON text and as the
    # content string: ~4 x 7.3 = 29 MB (measured 28-33). Rendering and tokenizing it took 1.5 GB
    # (~200 bytes of token objects per character); 50 MB leaves room for the first, never the second.
    transient = _memory_mib(pid)["VmHWM"] - baseline
    assert transient < 50, f"peak {transient:.0f} MiB above the baseline {baseline:.0f} MiB"
    # Back within 10 % of the baseline once the last response is out (freed after it is sent: polled).
    deadline = time.monotonic() + 20
    while (rss := _memory_mib(pid)["VmRSS"]) > baseline * 1.1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rss <= baseline * 1.1, f"RSS {rss:.0f} MiB after ten requests, baseline {baseline:.0f} MiB"
    assert metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code="400") == seen + 10


def test_a_prompt_the_kv_pool_cannot_hold_is_a_bad_request_not_retried(served: tuple[GatewayProc, WorkerProc]) -> None:
    gateway, _ = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x")  # retries 5xx twice by default
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
    seen = metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code="400")
    words = "the quick brown fox jumps over the lazy dog " * 35  # 636 tokens: inside the context, over the pool
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=8)
    assert (refused.value.code, refused.value.param, refused.value.type) == ("context_length_exceeded", "messages", "invalid_request_error")
    message = str(refused.value)
    # refused by the gateway before any worker request: the worker's /ready told its pool
    held = re.search(
        r"needs (\d+) tokens of KV cache \(\d+ of prompt, 8 of completion\) but the largest decode worker's "
        r"KV pool holds (\d+) tokens\. Please reduce",
        message,
    )
    assert held is not None and int(held[2]) < int(held[1]), message
    assert metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code="400") == seen + 1  # no retry
    assert metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code="502") == 0


def test_a_streamed_prompt_the_prefill_pool_holds_but_no_decode_pool_does_is_a_400_before_the_stream(
    workers: WorkerFactory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    big = {**config(), "kv_cache": {"dtype": "bf16", "memory_bytes": 16 << 20}}
    prefill = workers.start("prefill", big, wait=False)
    decode = workers.start("decode", config(), wait=False)
    prefill.wait_ready()
    decode.wait_ready()
    gateway = GatewayProc(
        tmp_path, tiny_model_dir, prefill=prefill.url, decode=[decode.url], token_file=workers.token_path, config=config()
    )
    try:
        gateway.wait_ready()
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        words = "the quick brown fox jumps over the lazy dog " * 35  # 636 tokens: the prefill's pool, not the decode's
        seen = {code: metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code=code) for code in ("200", "400")}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=8, stream=True)
        assert (refused.value.code, refused.value.param, refused.value.type) == (
            "context_length_exceeded",
            "messages",
            "invalid_request_error",
        )
        assert "the largest decode worker's KV pool holds" in str(refused.value)
        assert metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code="400") == seen["400"] + 1
        assert metric(gateway.url, "kvserving_gateway_requests_total", route=CHAT, code="200") == seen["200"]
        # what fits both pools streams as before
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    finally:
        gateway.stop()
        prefill.kill()
        decode.kill()

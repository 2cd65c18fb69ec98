"""`kvserving worker` as a real process: SIGTERM stops admitting (503), lets
requests in flight finish within the grace period, aborts the rest after it,
and exits 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import httpx

from kvs_workers import WorkerFactory

CONFIG: dict[str, Any] = {"kv_cache": {"dtype": "bf16", "memory_bytes": 16 << 20}}


def _stream_in_thread(worker: Any, body: dict[str, Any]) -> tuple[threading.Thread, list[dict[str, Any] | str], threading.Event]:
    events: list[dict[str, Any] | str] = []
    first = threading.Event()

    def read() -> None:
        try:
            with httpx.stream("POST", worker.url + "/internal/generate", json=body, headers=worker.headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line and not line.startswith(":"):  # not a keep-alive comment
                        data = line.removeprefix("data: ")
                        events.append(data if data == "[DONE]" else json.loads(data))
                        first.set()
        except httpx.TransportError as exc:
            events.append(f"transport error: {exc}")
        finally:
            first.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, events, first


def _wait_exit(worker: Any, timeout: float) -> int:
    try:
        return int(worker.proc.wait(timeout=timeout))
    except Exception:
        raise AssertionError(f"worker did not exit within {timeout} s:\n{worker.log_tail()}") from None


def test_sigterm_refuses_new_work_lets_short_requests_finish_aborts_the_rest_and_exits_0(workers: WorkerFactory) -> None:
    w = workers.start("both", CONFIG, args=("--grace-period-s", "5"))
    prompt = list(range(10, 40))
    long_body = {"request_id": "long", "input_ids": prompt, "sampling": {"max_tokens": 3000, "ignore_eos": True}}
    short_body = {"request_id": "short", "input_ids": prompt, "sampling": {"max_tokens": 40, "ignore_eos": True}}
    long_thread, long_events, long_first = _stream_in_thread(w, long_body)
    short_thread, short_events, short_first = _stream_in_thread(w, short_body)
    for first, events in ((long_first, long_events), (short_first, short_events)):
        assert first.wait(60) and isinstance(events[0], dict) and events[0].get("token_ids"), events[:1]
    t0 = time.monotonic()
    os.kill(w.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3.0  # well inside the 5 s grace: the late request below still meets the drain
    while httpx.get(w.url + "/ready", timeout=2).status_code != 503:
        assert time.monotonic() < deadline, "ready still 200 after SIGTERM"
        time.sleep(0.02)
    r = httpx.post(w.url + "/internal/generate", json={"request_id": "late", "input_ids": [1, 2]}, headers=w.headers, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["message"] == "worker is draining"
    assert _wait_exit(w, 30) == 0
    long_thread.join(10)
    short_thread.join(10)
    # the short request finished within the grace period, whole
    short_tokens = [t for e in short_events if isinstance(e, dict) for t in e.get("token_ids", [])]
    short_final = [e for e in short_events if isinstance(e, dict) and "finish_reason" in e]
    assert short_final and short_final[0]["finish_reason"] == "length" and len(short_tokens) == 40
    assert short_events[-1] == "[DONE]"
    # the long one was aborted once the grace period ran out, with a final event
    long_final = [e for e in long_events if isinstance(e, dict) and "finish_reason" in e]
    assert long_final and long_final[0]["finish_reason"] == "abort", long_events[-3:]
    assert long_events[-1] == "[DONE]"
    assert time.monotonic() - t0 >= 4.9  # it waited out the grace period first
    assert "draining (grace 5.0 s)" in w.log_tail(200)

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


def _stream_in_thread(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[dict[str, Any] | str], threading.Event]:
    events: list[dict[str, Any] | str] = []
    first = threading.Event()

    def read() -> None:
        try:
            with httpx.stream("POST", url + "/internal/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
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


def test_sigterm_refuses_new_work_aborts_after_the_grace_period_and_exits_0(workers: WorkerFactory) -> None:
    w = workers.start("both", CONFIG, args=("--grace-period-s", "1.5"))
    body = {"request_id": "long", "input_ids": list(range(10, 40)), "sampling": {"max_tokens": 3000, "ignore_eos": True}}
    thread, events, first = _stream_in_thread(w.url, body)
    assert first.wait(60) and isinstance(events[0], dict) and events[0].get("token_ids"), events[:1]
    t0 = time.monotonic()
    os.kill(w.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 1.0
    while httpx.get(w.url + "/ready", timeout=2).status_code != 503:
        assert time.monotonic() < deadline, "ready still 200 after SIGTERM"
        time.sleep(0.02)
    r = httpx.post(w.url + "/internal/generate", json={"request_id": "late", "input_ids": [1, 2]}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["message"] == "worker is draining"
    assert _wait_exit(w, 30) == 0
    thread.join(10)
    final = [e for e in events if isinstance(e, dict) and "finish_reason" in e]
    assert final and final[0]["finish_reason"] == "abort", events[-3:]
    assert events[-1] == "[DONE]"
    assert time.monotonic() - t0 >= 1.4  # it waited out the grace period first
    assert "draining (grace 1.5 s)" in w.log_tail(200)


def test_sigterm_lets_a_request_in_flight_finish(workers: WorkerFactory) -> None:
    w = workers.start("both", CONFIG, args=("--grace-period-s", "60"))
    body = {"request_id": "short", "input_ids": list(range(10, 40)), "sampling": {"max_tokens": 200, "ignore_eos": True}}
    thread, events, first = _stream_in_thread(w.url, body)
    assert first.wait(60)
    os.kill(w.proc.pid, signal.SIGTERM)
    assert _wait_exit(w, 60) == 0
    thread.join(10)
    tokens = [t for e in events if isinstance(e, dict) for t in e.get("token_ids", [])]
    final = [e for e in events if isinstance(e, dict) and "finish_reason" in e]
    assert final and final[0]["finish_reason"] == "length" and len(tokens) == 200
    assert events[-1] == "[DONE]"

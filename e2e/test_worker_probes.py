"""A worker busy with long prefills still answers its probes: /ready and
/health are served on the event loop without touching the engine, and the
engine's steps run on their own thread with the GIL released inside torch's
kernels, so a probe waits at most for a scheduling slice, not for a step.

The gateway takes a worker out of the rotation when /ready misses its short
deadline (2 x connect_timeout_s, 4 s); this test holds the worker to one
second per probe while three 3,000-token prefills are in flight."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from kvs_workers import WorkerFactory, stream_generate

CONFIG: dict[str, Any] = {
    "model": {"max_model_len": 4096},
    "kv_cache": {"dtype": "bf16", "memory_bytes": 64 << 20},
    "reuse": {"recompute_threshold_tokens": 0},
}
PROBE_DEADLINE_S = 1.0  # a quarter of the gateway's (2 x connect_timeout_s)
PROMPT_TOKENS = 3000
STREAMS = 3


def test_probes_answer_within_their_deadline_while_long_prefills_run(workers: WorkerFactory) -> None:
    worker = workers.start("prefill", CONFIG)
    finished: list[int] = []
    errors: list[BaseException] = []

    def prefill(k: int) -> None:
        ids = [(j * 37 + k * 101) % 3500 + 300 for j in range(PROMPT_TOKENS)]
        try:
            tokens, final = stream_generate(
                worker, {"request_id": f"long-{k}", "input_ids": ids, "sampling": {"max_tokens": 1, "ignore_eos": True}}, timeout=300
            )
            finished.append(final["usage"]["computed_prompt_tokens"])
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=prefill, args=(k,)) for k in range(STREAMS)]
    for t in threads:
        t.start()
    latencies: dict[str, list[float]] = {"/ready": [], "/health": []}
    with httpx.Client(timeout=PROBE_DEADLINE_S) as client:
        while any(t.is_alive() for t in threads):
            for path, seen in latencies.items():
                t0 = time.monotonic()
                response = client.get(worker.url + path)  # a probe past its deadline raises ReadTimeout
                seen.append(time.monotonic() - t0)
                assert response.status_code == 200, response.text
            time.sleep(0.05)
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(finished) == [PROMPT_TOKENS] * STREAMS  # every prompt prefilled in full while probed
    assert len(latencies["/ready"]) >= 5, latencies  # the probes ran during the prefills, not after
    worst = {path: round(max(seen) * 1000, 1) for path, seen in latencies.items()}
    print(f"probe latency under load, worst ms: {worst}")

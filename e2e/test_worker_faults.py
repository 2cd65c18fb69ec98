"""Reuse faults through the worker API, with real processes: each one falls
back to recompute, gives the tokens of a run without reuse, names its reason
in ``usage.reuse_fallback`` and is counted in
``kvserving_worker_kv_reuse_fallbacks_total{reason}`` and ``/internal/kv/stats``.

One prefill and one decode worker; the decode is killed, then restarted on
the same port (a new engine id: the prefill's cached agent is stale). A
frozen peer (``transfer_timeout``) and a partial READ are covered at the
transfer level (tests/worker/test_kv_transfer.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from kvs_workers import WorkerFactory, WorkerProc, stream_generate
from kvserving.config import ServingConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.sampling import SamplingParams

CONFIG: dict[str, Any] = {
    "model": {"max_model_len": 1024},
    "kv_cache": {"dtype": "bf16", "memory_bytes": 16 << 20},
    "reuse": {"recompute_threshold_tokens": 0},
}
PAGE = 16
REPLY = 6


def prefill_turn(
    worker: WorkerProc, rid: str, ids: list[int], params: dict[str, Any] | None, *, max_tokens: int = 1
) -> tuple[list[int], dict[str, Any]]:
    return stream_generate(
        worker,
        {
            "request_id": rid,
            "input_ids": ids,
            "sampling": {"max_tokens": max_tokens, "ignore_eos": True},
            "kv_transfer_params": params,
            "conversation_key": rid,
        },
    )


def decode_turn(worker: WorkerProc, rid: str, ids: list[int], params: dict[str, Any] | None) -> tuple[list[int], dict[str, Any]]:
    return stream_generate(
        worker,
        {
            "request_id": rid,
            "input_ids": ids,
            "sampling": {"max_tokens": REPLY, "ignore_eos": True},
            "kv_transfer_params": params,
            "conversation_key": rid,
            "retain": True,
        },
    )


def test_each_reuse_fault_recomputes_the_same_tokens_and_is_counted(workers: WorkerFactory, tiny_model_dir: Path) -> None:
    prefill = workers.start("prefill", CONFIG, wait=False)
    decode = workers.start("decode", CONFIG, wait=False)
    reference = LLMEngine(ServingConfig.from_dict({**CONFIG, "model": {**CONFIG["model"], "path": str(tiny_model_dir)}}))
    reference.kv.match_prefix = lambda seq: 0  # type: ignore[method-assign]

    def expected(ids: list[int]) -> list[int]:
        return reference.generate([ids], SamplingParams(max_tokens=REPLY, ignore_eos=True))[0]

    prefill.wait_ready()
    decode.wait_ready()
    rng = random.Random(11)
    seen: dict[str, int] = {}

    def conversation(name: str) -> tuple[list[int], dict[str, Any], int]:
        """Turn 1 through prefill and decode; the next turn's prompt, the decode's retained
        params, and how many of its tokens the prefill holds itself (its turn-1 pages)."""
        first = [rng.randrange(300, 4000) for _ in range(125)]  # the reply ends a page past the prompt
        _, p1 = prefill_turn(prefill, name + "-p", first, None)
        reply, d1 = decode_turn(decode, name, first, p1["kv_transfer_params"])
        return first + reply + [rng.randrange(300, 4000) for _ in range(50)], d1["kv_transfer_params"], len(first) // PAGE * PAGE

    def check(rid: str, ids: list[int], params: dict[str, Any], reason: str, *, local: int) -> None:
        # (a prefill worker generates what it is asked for: here REPLY tokens, to compare more of them)
        tokens, final = prefill_turn(prefill, rid, ids, params, max_tokens=REPLY)
        u = final["usage"]
        assert u["reuse_fallback"] == reason, (rid, u)
        assert tokens == expected(ids), rid
        assert (u["local_cached_tokens"], u["remote_pulled_tokens"]) == (local, 0), (rid, u)
        assert u["computed_prompt_tokens"] == len(ids) - local and u["kv_bytes_pulled"] == 0
        seen[reason] = seen.get(reason, 0) + 1

    # 1. a layout that is not ours (another dtype, page layout or weights)
    history, retained, own = conversation("layout")
    check("layout-2", history, {**retained, "layout_hash": "0" * 16}, "layout_mismatch", local=own)
    # 2. an edited history: page 2 differs, so only pages 0-1 are common (already local): nothing to pull
    history, retained, own = conversation("edited")
    history[2 * PAGE + 3] = (history[2 * PAGE + 3] + 1) % 4000
    check("edited-2", history, retained, "hash_mismatch", local=2 * PAGE)
    # 3. the decode released the lease (the gateway went idle): never read pages that may be reused
    history, retained, own = conversation("released")
    assert httpx.delete(f"{decode.url}/internal/kv/leases/{retained['lease_id']}", headers=decode.headers, timeout=10).status_code == 200
    check("released-2", history, retained, "lease_expired", local=own)
    # 4. the decode worker is dead; 5. it restarted on the same address: a new engine, its pages are gone
    dead = conversation("dead")
    stale = conversation("stale")
    port = int(decode.url.rsplit(":", 1)[1])
    decode.kill()
    check("dead-2", dead[0], dead[1], "remote_unreachable", local=dead[2])
    restarted = workers.start("decode", CONFIG, port=port)
    check("stale-2", stale[0], stale[1], "stale_agent", local=stale[2])

    assert seen == {"layout_mismatch": 1, "hash_mismatch": 1, "lease_expired": 1, "remote_unreachable": 1, "stale_agent": 1}
    stats = httpx.get(prefill.url + "/internal/kv/stats", headers=prefill.headers, timeout=10).json()
    assert stats["fallbacks"] == dict(sorted(seen.items()))
    text = httpx.get(prefill.url + "/metrics", timeout=10).text
    for reason, count in seen.items():
        assert f'kvserving_worker_kv_reuse_fallbacks_total{{reason="{reason}"}} {float(count)}' in text, reason
    assert 'kvserving_worker_kv_reuse_fallbacks_total{reason="transfer_timeout"} 0.0' in text
    restarted.kill()
    prefill.kill()


def test_a_worker_answers_at_once_and_keeps_the_stream_alive_while_its_pull_waits_on_a_frozen_peer(
    workers: WorkerFactory, tiny_model_dir: Path
) -> None:
    """The response opens when the request is admitted, before the pull: while the decode worker
    holding the pages is frozen (SIGSTOP), the prefill worker's headers and keep-alive comments
    still flow, so a gateway tells this busy worker from a frozen one; the pull then gives up and
    the tokens are a recompute's."""
    # the pull waits on the frozen peer for its contact deadline (peer_timeout_s) before giving up
    config = {**CONFIG, "reuse": {**CONFIG["reuse"], "transfer_timeout_s": 4.0, "peer_timeout_s": 2.5}}
    prefill = workers.start("prefill", config, wait=False)
    decode = workers.start("decode", config, wait=False)
    reference = LLMEngine(ServingConfig.from_dict({**config, "model": {**config["model"], "path": str(tiny_model_dir)}}))
    prefill.wait_ready()
    decode.wait_ready()
    rng = random.Random(12)
    first = [rng.randrange(300, 4000) for _ in range(125)]
    _, p1 = prefill_turn(prefill, "frozen-p", first, None)
    reply, d1 = decode_turn(decode, "frozen", first, p1["kv_transfer_params"])
    history = first + reply + [rng.randrange(300, 4000) for _ in range(50)]
    body = {
        "request_id": "frozen-2",
        "input_ids": history,
        "sampling": {"max_tokens": REPLY, "ignore_eos": True},
        "kv_transfer_params": d1["kv_transfer_params"],
        "conversation_key": "frozen",
    }
    tokens: list[int] = []
    final: dict[str, Any] = {}
    comments = 0  # keep-alive comments before the first token
    os.kill(decode.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", prefill.url + "/internal/generate", json=body, headers=prefill.headers, timeout=60) as r:
            headers_at = time.monotonic() - t0
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith(":"):
                    comments += not tokens
                    continue
                data = line.removeprefix("data: ")
                if not line or data == "[DONE]":
                    continue
                event = json.loads(data)
                assert "error" not in event, event
                tokens.extend(event["token_ids"])
                final = event if "finish_reason" in event else final
        ended_at = time.monotonic() - t0
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
    # the pull waited out the frozen peer (its 2.5 s contact deadline) after the
    # headers; the old order (pull, then headers) put the headers at the end of that wait
    assert ended_at - headers_at >= 1.5, (headers_at, ended_at)
    assert comments >= 1
    assert final["usage"]["reuse_fallback"] in ("transfer_timeout", "remote_unreachable"), final["usage"]
    assert tokens == reference.generate([history], SamplingParams(max_tokens=REPLY, ignore_eos=True))[0]
    decode.kill()
    prefill.kill()

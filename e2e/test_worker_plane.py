"""The attacks on the workers' internal plane, with real processes (one prefill
and one decode worker, NIXL between them): a caller on the pod network without
the deployment's credential can neither list leases, nor fetch the NIXL agent
metadata a READ or WRITE of another conversation's pages needs, nor hold,
renew, release or create one; a generate whose ``agent_url`` names a machine
outside the deployment connects nowhere. The victim's next turn then equals a
fault-free run, reusing its KV as usual."""

from __future__ import annotations

import socket
import threading
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
REPLY = 6
KEY = "user:victim@example.com"


def turn(worker: WorkerProc, rid: str, ids: list[int], params: dict[str, Any] | None, *, retain: bool) -> tuple[list[int], dict[str, Any]]:
    """A prefill worker's part of a turn (its first token), or the decode's (the reply, retained)."""
    max_tokens = 1 if worker.role == "prefill" else REPLY
    return stream_generate(
        worker,
        {
            "request_id": rid,
            "input_ids": ids,
            "sampling": {"max_tokens": max_tokens, "ignore_eos": True},
            "kv_transfer_params": params,
            "conversation_key": KEY,
            "retain": retain,
        },
    )


def refused(method: str, url: str, **kw: Any) -> bool:
    """Whether the call is refused with the fixed 401, without and with a wrong token."""
    for headers in ({}, {"Authorization": "Bearer guessed"}):
        r = httpx.request(method, url, headers=headers, timeout=10, **kw)
        if r.status_code != 401 or r.json()["error"]["code"] != "unauthorized" or "metadata" in r.text:
            return False
    return True


def test_without_the_credential_nothing_touches_the_victims_kv(workers: WorkerFactory, tiny_model_dir: Path) -> None:
    prefill = workers.start("prefill", CONFIG, wait=False)
    decode = workers.start("decode", CONFIG, wait=False)
    reference = LLMEngine(ServingConfig.from_dict({**CONFIG, "model": {**CONFIG["model"], "path": str(tiny_model_dir)}}))
    reference.kv.match_prefix = lambda seq: 0  # type: ignore[method-assign]  # every prompt prefilled fresh
    prefill.wait_ready()
    decode.wait_ready()
    prompt1 = [(i * 37) % 3500 + 300 for i in range(125)]  # the reply ends a page past the prompt
    _, p1 = turn(prefill, "v1-p", prompt1, None, retain=False)
    reply1, d1 = turn(decode, "v1", prompt1, p1["kv_transfer_params"], retain=True)
    assert d1["usage"]["remote_pulled_tokens"] > 0
    lease = d1["kv_transfer_params"]
    lid = lease["lease_id"]

    # the attacker on the pod network, without the token
    assert refused("GET", decode.url + "/internal/kv/leases")  # no conversation keys
    assert refused("GET", decode.url + "/internal/kv/agent")  # no NIXL metadata: no READ, no WRITE
    assert refused("GET", decode.url + "/internal/kv/stats")
    assert refused("POST", f"{decode.url}/internal/kv/leases/{lid}/hold", json={"digest": "0" * 32, "hold_s": 120})
    assert refused("POST", f"{decode.url}/internal/kv/leases/{lid}/renew", json={"ttl_s": 1})
    assert refused("DELETE", f"{decode.url}/internal/kv/leases/{lid}")
    assert refused(
        "POST",
        decode.url + "/internal/generate",
        json={"request_id": "evil", "input_ids": [1, 2, 3], "conversation_key": KEY, "retain": True},
    )

    # a request (past the gateway) naming a machine outside the deployment: nothing connects there
    seen: list[socket.socket] = []
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.1)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                seen.append(trap.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        evil = {**p1["kv_transfer_params"], "agent_url": f"http://127.0.0.1:{trap.getsockname()[1]}", "engine_id": "evil"}
        tokens, final = stream_generate(
            prefill,
            {"request_id": "ssrf", "input_ids": prompt1, "sampling": {"max_tokens": 2, "ignore_eos": True}, "kv_transfer_params": evil},
        )
        assert final["usage"]["reuse_fallback"] == "unknown_peer" and len(tokens) == 2
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(timeout=5)
        trap.close()
    assert seen == []

    # the victim's next turn: its KV untouched, reused, the tokens of a fault-free run
    prompt2 = prompt1 + reply1 + [(i * 53) % 3500 + 300 for i in range(40)]
    _, p2 = turn(prefill, "v2-p", prompt2, lease, retain=False)
    # the prefill holds the prompt's 7 pages itself; the page the reply completed comes from the decode's lease
    assert (p2["usage"]["remote_pulled_tokens"], p2["usage"]["reuse_fallback"]) == (16, None)
    reply2, d2 = turn(decode, "v2", prompt2, p2["kv_transfer_params"], retain=True)
    assert reply1 == reference.generate([prompt1], SamplingParams(max_tokens=REPLY, ignore_eos=True))[0]
    assert reply2 == reference.generate([prompt2], SamplingParams(max_tokens=REPLY, ignore_eos=True))[0]
    assert d2["usage"]["reuse_fallback"] is None
    listed = httpx.get(decode.url + "/internal/kv/leases", params={"conversation_key": KEY}, headers=decode.headers, timeout=10).json()[
        "leases"
    ]
    assert [le["lease_id"] for le in listed] == [d2["kv_transfer_params"]["lease_id"]]  # its own turn replaced it

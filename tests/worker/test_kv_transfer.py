"""KV reuse across two real processes over real NIXL (UCX, CPU memory): P->D and
D->P pulls on the tiny model, exact token accounting, outputs equal to a run
without transfer, and each fault falling back to recompute with its reason.

The test process hosts the prefill worker (and the reference engines); a child
process (``kv_transfer_peer.py``) hosts the decode worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv_transfer import KVTransferParams
from kvserving.worker.sampling import SamplingParams

PEER = Path(__file__).with_name("kv_transfer_peer.py")
_spec = importlib.util.spec_from_file_location("kv_transfer_peer", PEER)
assert _spec is not None and _spec.loader is not None
peer_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_mod)

CALL_TIMEOUT_S = 60.0


class Peer:
    """The child process: a Host of decode workers, driven by JSON lines."""

    def __init__(self, port: int = 0) -> None:
        env = dict(os.environ, PYTHONSAFEPATH="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.port = int(self._read()["port"])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(peer_mod.REPLY):
                self._lines.put(line[len(peer_mod.REPLY):])

    def _read(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=CALL_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError("peer did not answer") from None
        return json.loads(line)

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/w/{name}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def host() -> Iterator[Any]:
    h = peer_mod.Host()
    yield h
    h.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.stop()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=g).tolist()


def _spec(model: Path, dtype: str, engine_id: str, **kw: Any) -> dict[str, Any]:
    return {"model": str(model), "dtype": dtype, "engine_id": engine_id, **kw}


def test_bf16_p_to_d_and_back(tiny_model_dir: Path, host: Any, peer: Peer) -> None:
    """Turn 1: P computes, D pulls P's prompt pages. Turn 2: P pulls D's conversation
    (prompt + reply) and computes only the new tokens; D pulls only the delta."""
    P = host.open("p-bf16", _spec(tiny_model_dir, "bf16", "p-bf16-1", role="prefill"))
    peer.call("open", name="d-bf16", spec=_spec(tiny_model_dir, "bf16", "d-bf16-1", role="decode"))
    ps = 16
    n1, gen = 150, 20
    prompt1 = _prompt(n1, 1)
    p1 = P.generate({"request_id": "t1p", "input_ids": prompt1, "max_tokens": 1, "retain": True})
    assert p1["computed"] == n1 and p1["params"]["num_tokens"] == n1 // ps * ps
    d1 = peer.call("generate", name="d-bf16", request_id="t1d", input_ids=prompt1, max_tokens=gen,
                   params=p1["params"], retain=True, conversation_key="c1")
    pulled1 = (n1 - 1) // ps * ps  # every full prompt page but one token is left to compute
    assert (d1["pulled"], d1["cached"], d1["computed"], d1["fallback"]) == (pulled1, pulled1, n1 - pulled1, None)
    assert d1["regions"] == 4  # 9 contiguous pages x 4 layers: one region per layer
    # the decode released P's transfer lease after its pull
    assert P.kvt.leases() == []
    # reference: the same prompt on a fresh engine, no reuse
    ref = LLMEngine(ServingConfig(model=ModelConfig(path=str(tiny_model_dir)), kv_cache=KVCacheConfig(dtype="bf16", memory_bytes=4 << 20)))
    sp = SamplingParams(max_tokens=gen, ignore_eos=True)
    assert d1["tokens"] == ref.generate([prompt1], sp)[0]

    # turn 2: the history (prompt + reply) plus new user tokens
    prompt2 = prompt1 + d1["tokens"] + _prompt(70, 2)
    n2 = len(prompt2)
    retained = d1["params"]
    assert retained["num_tokens"] == (n1 + gen - 1) // ps * ps
    p2 = P.generate({"request_id": "t2p", "input_ids": prompt2, "max_tokens": 1, "retain": True, "params": retained})
    local = n1 // ps * ps  # P still caches its turn-1 prompt pages (released to its LRU)
    assert (p2["cached"] - p2["pulled"], p2["pulled"]) == (local, retained["num_tokens"] - local)
    assert p2["computed"] == n2 - retained["num_tokens"]
    d2 = peer.call("generate", name="d-bf16", request_id="t2d", input_ids=prompt2, max_tokens=gen,
                   params=p2["params"], retain=True, conversation_key="c1")
    # D holds its own retained pages and pulls only the pages P computed this turn
    tail = (n2 - 1) // ps * ps
    assert d2["pulled"] == tail - retained["num_tokens"] and d2["cached"] == tail
    assert d2["tokens"] == ref.generate([prompt2], sp)[0]
    # one lease per conversation: turn 2's replaced turn 1's
    leases = peer.call("leases", name="d-bf16")["leases"]
    assert [le["lease_id"] for le in leases] == [d2["params"]["lease_id"]]
    assert leases[0]["num_tokens"] == (n2 + gen - 1) // ps * ps

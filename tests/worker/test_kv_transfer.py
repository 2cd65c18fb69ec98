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

from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv_transfer import KVTransferParams
from kvserving.tags import encode_tag
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


def _sp(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _fresh(model: Path, dtype: str, prompt: list[int], gen: int) -> list[int]:
    """Tokens of a run without any reuse: a fresh engine prefills the whole prompt."""
    eng = LLMEngine(peer_mod.serving_config(_spec(model, dtype, "ref")))
    return eng.generate([prompt], _sp(gen))[0]


# Triaxial tags: the first 96 tokens are an old user turn (2 bits: INT2 pages), the rest
# this turn's user text (4 bits); generated tokens are assistant text.
OLD_USER, M1_USER, CUR_USER = encode_tag("older", "text", "user"), encode_tag("turn_m1", "text", "user"), encode_tag("current", "text", "user")
M1_ASSISTANT = encode_tag("turn_m1", "text", "assistant")


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "triaxial"])
def test_conversation_p_to_d_and_back(tiny_model_dir: Path, host: Any, peer: Peer, dtype: str) -> None:
    """Turn 1: P computes the prompt, D pulls P's prompt pages and generates. Turn 2: P pulls
    D's retained conversation (prompt + reply) and computes only the new tokens; D pulls only
    the pages P computed this turn. Token counts are exact; tokens equal the reference."""
    ps = 32 if dtype == "triaxial" else 16
    P = host.open(f"p-{dtype}", _spec(tiny_model_dir, dtype, f"p-{dtype}-1", role="prefill"))
    # a different pool size: page offsets differ between the two workers (INT2 pages count from the top)
    peer.call("open", name=f"d-{dtype}", spec=_spec(tiny_model_dir, dtype, f"d-{dtype}-1", role="decode", memory_bytes=6 << 20))
    n1, gen, new = 150, 20, 70
    prompt1 = _prompt(n1, 1)
    tags1 = [OLD_USER] * 96 + [CUR_USER] * (n1 - 96) if dtype == "triaxial" else None

    def decode(rid: str, ids: list[int], tags: list[int] | None, params: dict[str, Any]) -> dict[str, Any]:
        return peer.call("generate", name=f"d-{dtype}", request_id=rid, input_ids=ids, tags=tags, max_tokens=gen,
                         params=params, retain=True, conversation_key="c1")

    p1 = P.generate({"request_id": "t1p", "input_ids": prompt1, "tags": tags1, "max_tokens": 1, "retain": True})
    assert p1["computed"] == n1 and p1["params"]["num_tokens"] == n1 // ps * ps
    if dtype == "triaxial":  # the old user turn travels as INT2 pages
        assert sum(1 for pid in p1["params"]["page_ids"] if pid & (1 << 30)) == 96 // ps
    d1 = decode("t1d", prompt1, tags1, p1["params"])
    pulled1 = (n1 - 1) // ps * ps  # every full prompt page (one token is always computed)
    assert (d1["pulled"], d1["cached"], d1["computed"], d1["fallback"]) == (pulled1, pulled1, n1 - pulled1, None)
    assert d1["bytes"] == pulled1 // ps * 4 * P.kvt.geometry.page_bytes - (
        (96 // ps) * 4 * (P.kvt.geometry.page_bytes - P.kvt.geometry.int2_page_bytes) if dtype == "triaxial" else 0)
    assert d1["regions"] == (8 if dtype == "triaxial" else 4)  # per layer: one run (+ one INT2 run)
    assert P.kvt.leases() == []  # the decode worker released P's transfer lease after its pull

    prompt2 = prompt1 + d1["tokens"] + _prompt(new, 2)
    n2 = len(prompt2)
    tags2 = ([OLD_USER] * 96 + [M1_USER] * (n1 - 96) + [M1_ASSISTANT] * gen + [CUR_USER] * new) if dtype == "triaxial" else None
    retained = d1["params"]
    kept = (n1 + gen - 1) // ps * ps  # the last sampled token has no KV yet
    assert retained["num_tokens"] == kept
    p2 = P.generate({"request_id": "t2p", "input_ids": prompt2, "tags": tags2, "max_tokens": 1, "retain": True, "params": retained})
    local = n1 // ps * ps  # P still caches its own turn-1 prompt pages (in its LRU)
    assert (p2["cached"] - p2["pulled"], p2["pulled"], p2["computed"]) == (local, kept - local, n2 - kept)
    d2 = decode("t2d", prompt2, tags2, p2["params"])
    tail = (n2 - 1) // ps * ps
    assert (d2["cached"] - d2["pulled"], d2["pulled"], d2["computed"]) == (kept, tail - kept, n2 - tail)
    leases = peer.call("leases", name=f"d-{dtype}")["leases"]  # one lease per conversation: turn 2's
    assert [le["lease_id"] for le in leases] == [d2["params"]["lease_id"]]
    assert leases[0]["num_tokens"] == (n2 + gen - 1) // ps * ps

    if dtype == "bf16":
        # unquantized KV: reuse gives exactly the tokens of prefilling everything fresh
        assert d1["tokens"] == _fresh(tiny_model_dir, dtype, prompt1, gen)
        assert d2["tokens"] == _fresh(tiny_model_dir, dtype, prompt2, gen)
        return
    # Quantized KV: a fresh prefill attends to the fresh (unquantized) K/V of its own
    # prompt, while a request reusing pages attends to their dequantized values, so the
    # logits legitimately differ from a no-reuse run. The right reference is ONE engine
    # that reuses its own prefix cache with the same chunk boundaries the two workers
    # used: pulled pages are byte copies, so the tokens must then be equal exactly.
    ref = LLMEngine(peer_mod.serving_config(_spec(tiny_model_dir, dtype, "ref")))
    t1 = [tags1] if tags1 else None
    ref.generate([prompt1], _sp(1), tags=t1)  # P's turn-1 prefill
    assert ref.generate([prompt1], _sp(gen), tags=t1)[0] == d1["tokens"]  # D: pages up to pulled1, then the tail
    ref.generate([prompt2[: tail + 1]], _sp(1), tags=[tags2[: tail + 1]] if tags2 else None)  # P's turn-2 chunk
    assert ref.generate([prompt2], _sp(gen), tags=[tags2] if tags2 else None)[0] == d2["tokens"]

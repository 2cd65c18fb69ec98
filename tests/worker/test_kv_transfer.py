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
from kvserving.worker.kv.leases import parse_lease_id
from kvserving.worker.kv.protocol import KVTransferParams, http_hold
from kvserving.tags import encode_tag
from kvserving.worker.sampling import SamplingParams

PEER = Path(__file__).with_name("kv_transfer_peer.py")
_peer_spec = importlib.util.spec_from_file_location("kv_transfer_peer", PEER)
assert _peer_spec is not None and _peer_spec.loader is not None
peer_mod = importlib.util.module_from_spec(_peer_spec)
_peer_spec.loader.exec_module(peer_mod)

CALL_TIMEOUT_S = 60.0


class Peer:
    """The child process: a Host of decode workers, driven by JSON lines."""

    def __init__(self, port: int = 0) -> None:
        env = dict(os.environ, PYTHONSAFEPATH="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.port = int(self._read()["port"])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(peer_mod.REPLY):
                self._lines.put(line[len(peer_mod.REPLY) :])

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


# Triaxial tags: the first 96 tokens are an old tool observation (2 bits: INT2 pages), the rest
# this turn's user text (4 bits); generated tokens are assistant text.
OLD_OBS, M1_USER, CUR_USER = (
    encode_tag("older", "text", "obs"),
    encode_tag("turn_m1", "text", "user"),
    encode_tag("current", "text", "user"),
)
M1_ASSISTANT = encode_tag("turn_m1", "text", "assistant")


@pytest.mark.parametrize(
    ("dtype", "layout"),
    [("bf16", "layer_major"), ("fp8_e4m3", "layer_major"), ("nvfp4", "layer_major"), ("triaxial", "layer_major"),
     ("nvfp4", "page_major"), ("triaxial", "page_major")],
)  # fmt: skip
def test_conversation_p_to_d_and_back(tiny_model_dir: Path, host: Any, peer: Peer, dtype: str, layout: str) -> None:
    """Turn 1: P computes the prompt, D pulls P's prompt pages and generates. Turn 2: P pulls
    D's retained conversation (prompt + reply) and computes only the new tokens; D pulls only
    the pages P computed this turn. Token counts are exact; tokens equal the reference. With
    ``kv_cache.layout: page_major`` a run of pages is one NIXL region for all layers."""
    ps = 32 if dtype == "triaxial" else 16
    name = f"{dtype}-{layout}"
    P = host.open(f"p-{name}", _spec(tiny_model_dir, dtype, f"p-{name}-1", role="prefill", layout=layout))
    # a different pool size: page offsets differ between the two workers (INT2 pages count from the top)
    peer.call(
        "open", name=f"d-{name}", spec=_spec(tiny_model_dir, dtype, f"d-{name}-1", role="decode", memory_bytes=6 << 20, layout=layout)
    )
    n1, gen, new = 150, 20, 70
    prompt1 = _prompt(n1, 1)
    tags1 = [OLD_OBS] * 96 + [CUR_USER] * (n1 - 96) if dtype == "triaxial" else None

    def decode(rid: str, ids: list[int], tags: list[int] | None, params: dict[str, Any]) -> dict[str, Any]:
        return peer.call(
            "generate",
            name=f"d-{name}",
            request_id=rid,
            input_ids=ids,
            tags=tags,
            max_tokens=gen,
            params=params,
            retain=True,
            conversation_key="c1",
        )

    p1 = P.generate({"request_id": "t1p", "input_ids": prompt1, "tags": tags1, "max_tokens": 1, "retain": True})
    assert p1["computed"] == n1 and p1["params"]["num_tokens"] == n1 // ps * ps
    if dtype == "triaxial":  # the old observation travels as INT2 pages
        assert sum(1 for pid in p1["params"]["page_ids"] if pid & (1 << 30)) == 96 // ps
    d1 = decode("t1d", prompt1, tags1, p1["params"])
    pulled1 = (n1 - 1) // ps * ps  # every full prompt page (one token is always computed)
    assert (d1["pulled"], d1["cached"], d1["computed"], d1["fallback"]) == (pulled1, pulled1, n1 - pulled1, None)
    rows = 1 if layout == "page_major" else 4  # NIXL regions per run: the tiny model's 4 layers, or one for all
    st = P.engine.storage
    pb, ib = st.layout.page_bytes, st.int2_layout.page_bytes if st.int2_layout is not None else 0
    assert d1["bytes"] == 4 * (pulled1 // ps * pb - ((96 // ps) * (pb - ib) if dtype == "triaxial" else 0))
    assert d1["regions"] == rows * (2 if dtype == "triaxial" else 1)  # one run (+ one INT2 run) per region row
    assert P.kvt.leases() == []  # the decode worker released P's transfer lease after its pull

    prompt2 = prompt1 + d1["tokens"] + _prompt(new, 2)
    n2 = len(prompt2)
    tags2 = ([OLD_OBS] * 96 + [M1_USER] * (n1 - 96) + [M1_ASSISTANT] * gen + [CUR_USER] * new) if dtype == "triaxial" else None
    retained = d1["params"]
    kept = (n1 + gen - 1) // ps * ps  # the last sampled token has no KV yet
    assert retained["num_tokens"] == kept
    p2 = P.generate({"request_id": "t2p", "input_ids": prompt2, "tags": tags2, "max_tokens": 1, "retain": True, "params": retained})
    local = n1 // ps * ps  # P still caches its own turn-1 prompt pages (in its LRU)
    assert (p2["cached"] - p2["pulled"], p2["pulled"], p2["computed"]) == (local, kept - local, n2 - kept)
    d2 = decode("t2d", prompt2, tags2, p2["params"])
    tail = (n2 - 1) // ps * ps
    assert (d2["cached"] - d2["pulled"], d2["pulled"], d2["computed"]) == (kept, tail - kept, n2 - tail)
    leases = peer.call("leases", name=f"d-{name}")["leases"]  # one lease per conversation: turn 2's
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


# ----------------------------------------------------------------------------- faults
@pytest.fixture(scope="module")
def pf(tiny_model_dir: Path, host: Any, peer: Peer) -> Any:
    """A bf16 prefill worker here and a decode worker in the peer process."""
    peer.call("open", name="d-f", spec=_spec(tiny_model_dir, "bf16", "d-f-1", role="decode"))
    return host.open("p-f", _spec(tiny_model_dir, "bf16", "p-f-1", role="prefill"))


def _turn1(P: Any, peer: Peer, seed: int, *, gen: int = 20, name: str = "d-f") -> tuple[list[int], dict[str, Any]]:
    """Turn 1 through P and the peer's decode worker; returns the prompt and D's result."""
    prompt = _prompt(150, seed)
    p1 = P.generate({"request_id": f"f{seed}p", "input_ids": prompt, "max_tokens": 1, "retain": True})
    d1 = peer.call(
        "generate",
        name=name,
        request_id=f"f{seed}d",
        input_ids=prompt,
        max_tokens=gen,
        params=p1["params"],
        retain=True,
        conversation_key=f"c{seed}",
    )
    assert d1["pulled"] == 144 and d1["fallback"] is None
    return prompt, d1


def _turn2(P: Any, rid: str, prompt: list[int], params: dict[str, Any] | None) -> dict[str, Any]:
    return P.generate({"request_id": rid, "input_ids": prompt, "max_tokens": 8, "params": params})


def test_edited_history_pulls_only_the_common_prefix(tiny_model_dir: Path, pf: Any, peer: Peer) -> None:
    prompt1, d1 = _turn1(pf, peer, 11, gen=40)
    assert d1["params"]["num_tokens"] == 176  # (150 + 40 - 1) // 16 pages
    history = prompt1 + d1["tokens"]
    history[170] = 10 + (history[170] + 1) % 3990  # an edited reply: page [160, 176) differs
    prompt2 = history + _prompt(30, 12)
    r = _turn2(pf, "edit", prompt2, d1["params"])
    # P holds [0, 144) itself; [144, 160) is the only matching page it lacks
    assert (r["fallback"], r["pulled"], r["cached"], r["computed"]) == ("hash_mismatch", 16, 160, len(prompt2) - 160)
    assert r["tokens"] == _fresh(tiny_model_dir, "bf16", prompt2, 8)


def test_expired_or_released_lease_recomputes(tiny_model_dir: Path, pf: Any, peer: Peer) -> None:
    for seed, how in ((13, "expired"), (17, "released")):
        prompt1, d1 = _turn1(pf, peer, seed)
        prompt2 = prompt1 + d1["tokens"] + _prompt(30, seed + 1)
        params = d1["params"]
        if how == "expired":
            params = dict(params, expires_at=time.time() - 1.0)
        else:  # released on the decode worker before its expiry: it answers 404 before any READ
            peer.call("release", name="d-f", lease_id=params["lease_id"])
        r = _turn2(pf, how, prompt2, params)
        assert (r["fallback"], r["pulled"], r["cached"]) == ("lease_expired", 0, 144), how
        assert r["tokens"] == _fresh(tiny_model_dir, "bf16", prompt2, 8)


@pytest.mark.parametrize("case", ["other weights", "page-major KV"])
def test_a_decode_worker_of_other_weights_or_kv_layout_is_a_layout_mismatch(
    tiny_model_dir: Path, tmp_path: Path, pf: Any, peer: Peer, case: str
) -> None:
    """Other weights (same shapes and dtype: the pages would read fine and mean nothing), or every layer's bytes of a page
    together where this worker keeps a buffer per layer: refused before any READ, recomputed."""
    from kvserving.tiny_model import build_tiny_model

    if case == "other weights":
        name, seed, spec = "d-other", 15, _spec(build_tiny_model(tmp_path / "other", seed=1), "bf16", "d-other-1", role="decode")
    else:
        name, seed, spec = "d-pm", 51, _spec(tiny_model_dir, "bf16", "d-pm-1", role="decode", layout="page_major")
    peer.call("open", name=name, spec=spec)
    prompt1 = _prompt(150, seed)  # prompts no other test of the module sends (pf would hold their pages)
    d1 = peer.call("generate", name=name, request_id=f"{name}1", input_ids=prompt1, max_tokens=20, retain=True)
    assert d1["params"]["layout_hash"] != pf.kvt.layout_hash
    prompt2 = prompt1 + d1["tokens"] + _prompt(30, seed + 1)
    r = _turn2(pf, name, prompt2, d1["params"])
    assert (r["fallback"], r["pulled"], r["computed"]) == ("layout_mismatch", 0, len(prompt2))
    assert r["tokens"] == _fresh(tiny_model_dir, "bf16", prompt2, 8)
    bad = dict(d1["params"], layout_hash=pf.kvt.layout_hash, dtype="nvfp4")
    assert _turn2(pf, f"{name}-dtype", prompt2, bad)["fallback"] == "layout_mismatch"


def test_forged_page_ids_are_refused(tiny_model_dir: Path, pf: Any, peer: Peer) -> None:
    """Params naming pages the sender's lease does not hold (made up, or a stale cache) are
    never read: the sender's own record of the lease decides."""
    prompt1, d1 = _turn1(pf, peer, 31)
    _, other = _turn1(pf, peer, 33)  # another conversation's pages on the same decode worker
    prompt2 = prompt1 + d1["tokens"] + _prompt(30, 32)
    forged = dict(d1["params"], page_ids=other["params"]["page_ids"])
    r = _turn2(pf, "forged", prompt2, forged)
    assert (r["fallback"], r["pulled"]) == ("hash_mismatch", 0)
    assert r["tokens"] == _fresh(tiny_model_dir, "bf16", prompt2, 8)


def test_concurrent_pulls_from_one_peer(tiny_model_dir: Path, host: Any) -> None:
    """Four requests pull at once (as a server's threads do) from a peer this decode worker has
    never met: one metadata load, four READs, four pins; each request then reuses its pages."""
    from concurrent.futures import ThreadPoolExecutor

    P = host.open("p-conc", _spec(tiny_model_dir, "bf16", "p-conc-1", role="prefill"))
    D = host.open("d-conc", _spec(tiny_model_dir, "bf16", "d-conc-1", role="decode"))
    prompts = [_prompt(100 + 20 * k, 40 + k) for k in range(4)]
    params = [
        P.generate({"request_id": f"c{k}", "input_ids": ids, "max_tokens": 1, "retain": True})["params"] for k, ids in enumerate(prompts)
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda k: D.kvt.pull(prompts[k], None, KVTransferParams.from_dict(params[k])), range(4)))
    assert [r.pulled_tokens for r in results] == [(len(ids) - 1) // 16 * 16 for ids in prompts]
    assert all(r.fallback is None for r in results) and len({r.admission_pin for r in results}) == 4
    with pytest.raises(ValueError, match="tags"):
        D.kvt.pull(prompts[0], [0], KVTransferParams.from_dict(params[0]))
    assert D.kvt.pull([], None, KVTransferParams.from_dict(params[0])).skipped == "nothing_to_pull"
    with D.lock:
        for k, (ids, r) in enumerate(zip(prompts, results)):
            D.engine.add_request(f"r{k}", ids, _sp(6), admission_pin=r.admission_pin)
        outs: dict[str, list[int]] = {f"r{k}": [] for k in range(4)}
        pulled: dict[str, int] = {}
        while D.engine.has_unfinished():
            for o in D.engine.step():
                outs[o.request_id].extend(o.new_token_ids)
                pulled[o.request_id] = o.num_pulled_tokens
    assert [pulled[f"r{k}"] for k in range(4)] == [r.pulled_tokens for r in results]
    assert [outs[f"r{k}"] for k in range(4)] == [_fresh(tiny_model_dir, "bf16", ids, 6) for ids in prompts]
    assert P.kvt.leases() == []  # every transfer hold released by its puller
    # a new hold of a prompt D caches already: nothing to read, and the hold is released all the same;
    # the 6 pages D holds wait for the request under its admission pin (none of them pulled), as pulled ones do
    again = P.generate({"request_id": "c0-again", "input_ids": prompts[0], "max_tokens": 1, "retain": True})["params"]
    assert len(P.kvt.leases()) == 1
    skip = D.kvt.pull(prompts[0], None, KVTransferParams.from_dict(again))
    assert (skip.pulled_tokens, skip.skipped) == (0, "nothing_to_pull") and skip.admission_pin is not None
    assert P.kvt.leases() == []
    with D.lock:
        pin = D.engine.pool.get_pin(skip.admission_pin)
        assert pin is not None and len(pin.page_ids) == (len(prompts[0]) - 1) // 16
        assert [D.engine.pool.lookup(h) for h in again["page_hashes"][:6]] == list(pin.page_ids)
    D.kvt.drop_admission(skip)  # its request never came
    with D.lock:
        assert D.engine.pool.get_pin(skip.admission_pin) is None


def test_a_pull_into_a_full_pool_waits_then_skips_and_counts_the_tokens_it_missed(tiny_model_dir: Path, host: Any) -> None:
    """A decode worker (transfer_timeout_s 4.0: it waits for pages up to PAGE_WAIT_SHARE of it)
    whose pool is taken whole by running requests. A 150-token prompt offers (150 - 1) // 16 = 9
    full pages: the pull waits its 2 s, skips (``no_free_pages``) and counts the 144 tokens it
    missed; pages freed while the next pull waits give it its 144 tokens. A prefill worker's pull
    skips at once. The counters reach /metrics by their growth."""
    from prometheus_client import CollectorRegistry

    from kvserving.worker.kv.puller import PAGE_WAIT_SHARE
    from kvserving.worker.metrics import WorkerMetrics
    from kvserving.worker.service import lost_before_admission

    P = host.open("p-full", _spec(tiny_model_dir, "bf16", "p-full-1", role="prefill"))
    # seconds, not a fraction of one: the second pull's pages are freed by another thread while it
    # waits, and it reads them from the prefill, each within its share on a loaded machine too
    timeout_s = 4.0
    D = host.open("d-full", _spec(tiny_model_dir, "bf16", "d-full-1", role="decode", transfer_timeout_s=timeout_s))
    ids = _prompt(150, 61)

    def offer(rid: str) -> KVTransferParams:
        return KVTransferParams.from_dict(P.generate({"request_id": rid, "input_ids": ids, "max_tokens": 1, "retain": True})["params"])

    pool = D.engine.pool
    with D.lock:
        taken = pool.allocate([4] * pool.num_free_pages(bits=4))
    assert taken is not None
    t0 = time.monotonic()
    skipped = D.kvt.pull(ids, None, offer("full-1"))
    waited = time.monotonic() - t0
    assert (skipped.skipped, skipped.missed_tokens, skipped.pulled_tokens, skipped.admission_pin) == ("no_free_pages", 144, 0, None)
    assert waited >= PAGE_WAIT_SHARE * timeout_s - 0.1  # the wait's last poll starts within one poll of its end
    c = D.kvt.stats()
    assert c["skips"] == {"nothing_to_pull": 0, "below_threshold": 0, "no_free_pages": 1}
    assert c["missed_tokens"]["no_free_pages"] == 144 and sum(c["missed_tokens"].values()) == 144
    assert c["page_waits"] == 1 and PAGE_WAIT_SHARE * timeout_s - 0.15 <= c["page_wait_seconds"] <= waited
    # what held the pool when the pull's allocation found no room: every page a request's
    held = {"requests": pool.capacity_tokens() // 16, "pins_transfer": 0, "pins_pulling": 0, "pins_retained": 0, "pins_pulled": 0}
    assert (c["no_room"], c["no_room_held_pages"]) == (1, held)

    def free_soon() -> None:  # a request ends while the pull waits: once its allocation found no room
        deadline = time.monotonic() + 30.0
        while D.kvt.stats()["no_room"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        with D.lock:
            pool.free(taken[:20])

    second = offer("full-2")  # the prefill's turn first: on a loaded machine it may outlast any fixed sleep
    threading.Thread(target=free_soon).start()
    got = D.kvt.pull(ids, None, second)
    assert (got.skipped, got.missed_tokens, got.pulled_tokens) == (None, 0, 144)
    # admitted with all 144 from the cache nothing was lost; with 96 (its pin yielded, 3 pages
    # evicted) 48 were; a skipped pull had nothing in place to lose
    assert [lost_before_admission(got, 144), lost_before_admission(got, 96), lost_before_admission(skipped, 0)] == [0, 48, 0]
    D.kvt.drop_admission(got)
    with D.lock:
        pool.free(taken[20:])
    c = D.kvt.stats()
    assert c["page_waits"] == 2 and c["skips"]["no_free_pages"] == 1 and c["pulls"] == 1
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, role="decode")
    # a prefill worker's pull does not wait (its waits would be the turn's TTFT): it skips at once
    P2 = host.open("p-full-2", _spec(tiny_model_dir, "bf16", "p-full-2", role="prefill", transfer_timeout_s=timeout_s))
    with P2.lock:
        full = P2.engine.pool.allocate([4] * P2.engine.pool.num_free_pages(bits=4))
    assert full is not None
    t0 = time.monotonic()
    at_once = P2.kvt.pull(ids, None, offer("full-3"))
    assert (at_once.skipped, at_once.missed_tokens) == ("no_free_pages", 144) and time.monotonic() - t0 < PAGE_WAIT_SHARE * timeout_s
    assert P2.kvt.stats()["page_waits"] == 0 and P2.kvt.stats()["no_room"] == 1
    with P2.lock:
        P2.engine.pool.free(full)
    metrics.observe_transfer(c)
    metrics.observe_transfer(c)  # the same counts again: nothing moves twice
    values = {
        (s.name, s.labels.get("reason")): s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name.startswith("kvserving_worker_kv_pull_") and s.name.endswith("_total")
    }
    assert values[("kvserving_worker_kv_pull_skips_total", "no_free_pages")] == 1
    assert values[("kvserving_worker_kv_pull_missed_tokens_total", "no_free_pages")] == 144
    assert values[("kvserving_worker_kv_pull_page_waits_total", None)] == 2


def test_frozen_killed_and_restarted_peer(tiny_model_dir: Path, host: Any, peer: Peer) -> None:
    """The peer frozen mid-pull (SIGSTOP: our deadline fires), then killed, then restarted on
    the same port and engine id: each pull recomputes with its reason. (Last in the
    file: it ends the module's peer process.)"""
    child = peer
    restarted: Peer | None = None
    try:
        child.call("open", name="d", spec=_spec(tiny_model_dir, "bf16", "d-x-1", role="decode"))
        prompt1 = _prompt(150, 21)
        d1 = child.call("generate", name="d", request_id="x1", input_ids=prompt1, max_tokens=20, retain=True)
        prompt2 = prompt1 + d1["tokens"] + _prompt(30, 22)
        expected = _fresh(tiny_model_dir, "bf16", prompt2, 8)

        def hold_then_freeze(url: str, lease_id: str, digest: str, hold_s: float, consume: bool, wait_s: float) -> dict[str, Any]:
            held = http_hold(url, lease_id, digest, hold_s, consume, wait_s)
            os.kill(child.proc.pid, signal.SIGSTOP)  # frozen between the hold and the READ
            return held

        frozen = host.open("p-frozen", _spec(tiny_model_dir, "bf16", "p-frozen-1", transfer_timeout_s=1.0), hold_remote=hold_then_freeze)
        t0 = time.monotonic()
        r = _turn2(frozen, "frozen", prompt2, d1["params"])
        assert time.monotonic() - t0 < 10.0
        assert (r["fallback"], r["pulled"], r["computed"], r["tokens"]) == ("transfer_timeout", 0, len(prompt2), expected)
        assert frozen.kvt.puller.fallbacks["transfer_timeout"] == 1
        # "auto" learned a rate from the timed-out READ alone: its bytes over at most the 1 s it had
        rate, tokens = frozen.kvt.puller.transfer_bytes_per_s, frozen.kvt.puller.missed_tokens["transfer_timeout"]
        assert rate is not None and tokens > 0
        assert rate >= frozen.kvt.puller.page_nbytes([0] * (tokens // frozen.kvt.puller.page_size)) / 1.0
        named = parse_lease_id(d1["params"]["lease_id"])
        assert named is not None  # a slow peer keeps its agent (dropping it would fail other pulls' READs from it)
        assert frozen.kvt.nixl.remote(d1["params"]["engine_id"], named[1]) is not None
        os.kill(child.proc.pid, signal.SIGCONT)
        # no page leaks: a READ NIXL could not cancel keeps its pages out of use until it ends
        deadline = time.monotonic() + 10.0
        while frozen.kvt.nixl.num_stuck and time.monotonic() < deadline:
            frozen.kvt.puller.reap()
            time.sleep(0.05)
        assert frozen.kvt.nixl.num_stuck == 0 and frozen.engine.pool.num_owned == 0

        # once a prefill is measured, a READ runs at most as long as recomputing its tokens is predicted
        # to take (+ 2 s), not the whole transfer_timeout_s (30 s here)
        bounded = host.open(
            "p-bounded", _spec(tiny_model_dir, "bf16", "p-bounded-1", transfer_timeout_s=30.0), hold_remote=hold_then_freeze
        )
        _turn2(bounded, "warm", _prompt(200, 23), None)
        tps = bounded.kvt.puller.prefill_tokens_per_s
        assert tps is not None
        t0 = time.monotonic()
        r = _turn2(bounded, "bounded", prompt2, d1["params"])
        took = time.monotonic() - t0
        os.kill(child.proc.pid, signal.SIGCONT)
        assert (r["fallback"], r["pulled"], r["tokens"]) == ("transfer_timeout", 0, expected)
        assert took < 10.0, took  # the bound (~2 s at the tiny model's prefill rate) ended the READ, not the 30 s
        deadline = time.monotonic() + 10.0
        while bounded.kvt.nixl.num_stuck and time.monotonic() < deadline:
            bounded.kvt.puller.reap()
            time.sleep(0.05)
        assert bounded.kvt.nixl.num_stuck == 0

        def hold_then_kill(url: str, lease_id: str, digest: str, hold_s: float, consume: bool, wait_s: float) -> dict[str, Any]:
            held = http_hold(url, lease_id, digest, hold_s, consume, wait_s)
            child.proc.kill()  # dies between the hold and the READ
            child.proc.wait(timeout=10)
            return held

        # fresh prefill workers for each step below (a recomputed prompt lands in the prefix cache)
        P = host.open("p-dead", _spec(tiny_model_dir, "bf16", "p-dead-1", transfer_timeout_s=3.0), hold_remote=hold_then_kill)
        P1, P2, P3 = (host.open(f"p-{k}", _spec(tiny_model_dir, "bf16", f"p-{k}-1")) for k in ("before", "stale", "new"))
        port = child.port
        r = _turn2(P, "dead", prompt2, d1["params"])
        assert (r["fallback"], r["pulled"], r["tokens"]) == ("remote_unreachable", 0, expected)
        assert P.engine.pool.num_owned == 0  # the failed READ's pages went back unregistered
        r = _turn2(P1, "dead-before", prompt2, d1["params"])
        assert (r["fallback"], r["pulled"]) == ("remote_unreachable", 0)  # no agent info from a dead peer

        restarted = Peer(port)
        # the same (stable) engine id: the lease id's generation tells the incarnations apart
        restarted.call("open", name="d", spec=_spec(tiny_model_dir, "bf16", "d-x-1", role="decode"))
        r = _turn2(P2, "stale", prompt2, d1["params"])
        assert (r["fallback"], r["pulled"], r["tokens"]) == ("stale_agent", 0, expected)
        # the restarted worker's own params load its fresh metadata and pull fine
        d1b = restarted.call("generate", name="d", request_id="x2", input_ids=prompt1, max_tokens=20, retain=True)
        assert d1b["tokens"] == d1["tokens"]
        r = _turn2(P3, "fresh", prompt2, d1b["params"])
        assert (r["fallback"], r["pulled"], r["computed"], r["tokens"]) == (None, 160, len(prompt2) - 160, expected)
    finally:
        if restarted is not None:
            restarted.stop()

"""The one check before a KV READ: the sender's hold (KVTransfer.hold) compares a digest of the
offered pages with its own lease and pins them for the READ, whatever happens to the lease
meanwhile; the puller's READ deadline counts from its request for the hold; the sender's agent
is fetched once per incarnation. Two engines in one process, real NIXL (UCX over CPU memory)."""

from __future__ import annotations

import math

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserving.config import KVCacheConfig, ModelConfig, ReuseConfig, ServingConfig
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv.leases import HoldRecord, LeaseMismatchError, PinKind
from kvserving.worker.kv.puller import PullResult
from kvserving.worker.kv.transfer import KVTransfer
from kvserving.worker.kv.leases import lease_digest
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.peers import PeerSet
from kvserving.worker.sampling import SamplingParams


def _engine(model: Path, **reuse: Any) -> LLMEngine:
    cfg = ServingConfig(
        model=ModelConfig(path=str(model)),
        kv_cache=KVCacheConfig(memory_bytes=2 << 20),
        reuse=ReuseConfig(retention_ttl_s=60.0, lease_ttl_s=50.0, recompute_threshold_tokens=0, **reuse),
    )
    return LLMEngine(cfg)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(
    kvt: KVTransfer, rid: str, ids: list[int], gen: int, *, retain: bool = True, pull: PullResult | None = None, key: str | None = None
) -> RequestOutput:
    kvt.engine.add_request(
        rid,
        ids,
        SamplingParams(max_tokens=gen, ignore_eos=True),
        retain=kvt.retain_spec(conversation_key=key, input_ids=ids) if retain else None,
        admission_pin=pull.admission_pin if pull else None,
    )
    while True:
        for out in kvt.engine.step():
            if out.request_id == rid and out.finished:
                return out


class Pair:
    """A prefill and a decode KVTransfer wired by direct calls, each call counted; ``slow_hold_s``
    delays the decode's hold answers (a slow or frozen sender)."""

    def __init__(self, model: Path, **reuse: Any) -> None:
        self.calls: Counter[str] = Counter()
        self.slow_hold_s = 0.0
        self.generation_override: int | None = None
        self.w: dict[str, KVTransfer] = {}
        for role in ("prefill", "decode"):
            eng = _engine(model, **reuse)
            self.w[f"local://{role}"] = KVTransfer(
                eng,
                eng.config.reuse,
                engine_id=f"{role}-hold",
                agent_url=f"local://{role}",
                role=role,
                fetch_agent_info=self._agent,
                hold_remote=self._hold,
                release_remote=self._release,
                peers=PeerSet(["local://prefill", "local://decode"]),
            )
        self.p, self.d = self.w["local://prefill"], self.w["local://decode"]

    def _agent(self, url: str) -> dict[str, Any]:
        self.calls["agent"] += 1
        return self.w[url].agent_info()

    def _hold(self, url: str, lease_id: str, digest: str, hold_s: float, consume: bool, wait_s: float) -> dict[str, Any]:
        self.calls["hold"] += 1
        time.sleep(self.slow_hold_s)
        try:
            reply = self.w[url].hold(lease_id, digest=digest, hold_s=hold_s, consume=consume)
        except KeyError:
            return {"refused": "unknown_lease"}
        except LeaseMismatchError:
            return {"refused": "lease_mismatch"}
        if self.generation_override is not None:
            reply["generation"] = self.generation_override
        return reply

    def _release(self, url: str, lease_id: str) -> None:
        self.calls["release"] += 1
        try:
            self.w[url].release(lease_id)
        except KeyError:
            pass

    def close(self) -> None:
        for w in self.w.values():
            w.close()


@pytest.fixture()
def pair(tiny_model_dir: Path) -> Iterator[Pair]:
    p = Pair(tiny_model_dir)
    yield p
    p.close()


def _holds(kvt: KVTransfer) -> list[str]:
    return [pin.pin_id for pin in kvt.engine.pool.pins() if isinstance(pin.record, HoldRecord)]


def _wait_no_holds(kvt: KVTransfer) -> None:
    deadline = time.monotonic() + 10.0
    while _holds(kvt) and time.monotonic() < deadline:  # released by the puller's peer-call thread
        time.sleep(0.01)
    assert _holds(kvt) == []


def test_hold_checks_the_offered_pages_and_pins_them(pair: Pair) -> None:
    d = pair.d
    pool = d.engine.pool
    kept = _run(d, "c1", _ids(100, 1), 20, key="conv").retained
    assert kept is not None and len(kept.page_ids) == 7
    digest = lease_digest(kept.page_ids, kept.page_hashes, kept.num_tokens)
    # other pages (a client's made-up ids), other hashes or another token count: refused
    forged = [
        lease_digest(tuple(p + 1 for p in kept.page_ids), kept.page_hashes, kept.num_tokens),
        lease_digest(kept.page_ids, (1,) + kept.page_hashes[1:], kept.num_tokens),
        lease_digest(kept.page_ids, kept.page_hashes, kept.num_tokens - 16),
    ]
    for bad in forged:
        with pytest.raises(LeaseMismatchError):
            d.hold(kept.lease_id, digest=bad, hold_s=5.0)
    with pytest.raises(KeyError):
        d.hold("kv-0-unknown", digest=digest, hold_s=5.0)
    with pytest.raises(ValueError, match="hold_s"):
        d.hold(kept.lease_id, digest=digest, hold_s=0.0)
    assert all(pool.ref_count(pid) == 1 for pid in kept.page_ids)  # nothing refused took a ref
    reply = d.hold(kept.lease_id, digest=digest, hold_s=5.0)
    assert reply["hold_id"].startswith(PinKind.HOLD.value) and _holds(d) == [reply["hold_id"]]
    assert (reply["engine_id"], reply["generation"]) == (d.engine_id, d.generation)
    assert all(pool.ref_count(pid) == 2 for pid in kept.page_ids)
    # the lease goes (released, reclaimed under pressure): the held pages stay owned, never reused
    assert pool.reclaim_one() == kept.lease_id and d.leases() == []
    assert pool.reclaim_one() is None  # a hold is never reclaimed
    assert all(pool.ref_count(pid) == 1 for pid in kept.page_ids) and pool.num_owned == 7
    d.release(reply["hold_id"])
    assert pool.num_owned == 0 and pool.num_cached == 7  # back to the prefix cache's LRU
    with pytest.raises(KeyError):
        d.release(reply["hold_id"])
    # a hold ends at its expiry too
    kept2 = _run(d, "c2", _ids(100, 2), 20, key="conv2").retained
    assert kept2 is not None
    d.hold(kept2.lease_id, digest=lease_digest(kept2.page_ids, kept2.page_hashes, kept2.num_tokens), hold_s=0.05)
    d.release(kept2.lease_id)
    time.sleep(0.1)
    d.engine.step()  # expires leases
    assert _holds(d) == [] and pool.num_owned == 0


def test_a_pull_takes_one_hold_and_fetches_the_agent_once(pair: Pair) -> None:
    p, d = pair.p, pair.d
    params = []
    for k in range(2):
        po = _run(p, f"p{k}", _ids(150, 10 + k), 1)
        assert po.retained is not None and po.retained.lease_id.startswith("xfer-")
        params.append(p.params_for(po.retained))
    first = d.pull(_ids(150, 10), None, params[0])
    assert (first.pulled_tokens, first.fallback) == (144, None)
    # the hold consumed that single-use transfer lease (the other one waits for its pull)
    assert [le["lease_id"] for le in p.leases()] == [params[1].lease_id]
    second = d.pull(_ids(150, 11), None, params[1])
    assert (second.pulled_tokens, second.fallback) == (144, None)
    assert p.leases() == []
    # one agent fetch for this sender incarnation, one hold per pull, no other call before a READ
    assert (pair.calls["agent"], pair.calls["hold"]) == (1, 2)
    assert {"engine_wait", "plan", "lease_check", "descriptors", "read", "adopt", "contact_hold"} <= set(first.phases)
    assert first.phases["contact_agent"] > 0 and second.phases["contact_agent"] == 0.0
    # the counters the agent bench reads: both READs' seconds, of which the descriptor lists built in Python
    counts = d.puller.counters()
    assert counts["pulls"] == 2 and counts["pulled_regions"] > 0
    assert math.isclose(counts["descriptor_seconds"], first.phases["descriptors"] + second.phases["descriptors"])
    assert 0 < counts["descriptor_seconds"] < counts["transfer_seconds"]
    assert 0 < counts["post_seconds"] < counts["transfer_seconds"] - counts["descriptor_seconds"]
    _wait_no_holds(p)  # each hold released after its READ
    assert p.engine.pool.num_owned == 0
    # the pulled pages serve their requests
    out = _run(d, "d0", _ids(150, 10), 4, retain=False, pull=first)
    assert (out.num_pulled_tokens, out.num_cached_tokens) == (144, 144)


def test_a_late_hold_reads_nothing(tiny_model_dir: Path) -> None:
    """The READ must end within transfer_timeout_s of asking for the hold (which pins the pages
    that long plus HOLD_MARGIN_S): a hold answered after that recomputes, nothing read."""
    pair = Pair(tiny_model_dir, transfer_timeout_s=0.2)
    try:
        p, d = pair.p, pair.d
        po = _run(d, "c", _ids(150, 3), 20, key="c")  # the decode worker's retained conversation
        assert po.retained is not None
        pair.slow_hold_s = 0.3
        res = p.pull(_ids(150, 3)[:144] + [5], None, d.params_for(po.retained))
        assert (res.fallback, res.pulled_tokens, res.admission_pin) == ("transfer_timeout", 0, None)
        assert p.engine.pool.num_owned == 0 and p.puller.pulls == 0
        _wait_no_holds(d)
    finally:
        pair.close()


def test_hold_from_another_incarnation_is_a_stale_agent(pair: Pair) -> None:
    p, d = pair.p, pair.d
    for k, seed in enumerate((4, 5)):
        kept = _run(d, f"c{k}", _ids(150, seed), 20, key=f"c{k}").retained
        assert kept is not None
        if k == 1:  # the process answering the hold is not the one whose agent we cached
            pair.generation_override = d.generation + 1
        res = p.pull(_ids(150, seed)[:144] + [5], None, d.params_for(kept))
        assert res.fallback == (None if k == 0 else "stale_agent")
        p.drop_admission(res)  # (its request never comes)
    assert pair.calls["agent"] == 2  # the second pull fetched the agent again before giving up
    _wait_no_holds(d)
    assert p.engine.pool.num_owned == 0


def test_forged_params_read_nothing(pair: Pair) -> None:
    p, d = pair.p, pair.d
    kept = [_run(d, f"c{k}", _ids(150, 6 + k), 20, key=f"c{k}").retained for k in range(2)]
    assert kept[0] is not None and kept[1] is not None
    params = d.params_for(kept[0])
    forged = KVTransferParams.from_dict(dict(params.to_dict(), page_ids=list(kept[1].page_ids)))
    res = p.pull(_ids(150, 6)[:144] + [5], None, forged)
    assert (res.fallback, res.pulled_tokens, res.admission_pin) == ("hash_mismatch", 0, None)
    assert p.engine.pool.num_owned == 0 and _holds(d) == []


def test_a_pulls_wait_for_the_engine_thread_is_its_own_phase(pair: Pair) -> None:
    """The plan's hop onto the engine thread: the wait for it (a step in flight, calls queued before) is
    ``engine_wait``, the planning on it ``plan``."""
    p, d = pair.p, pair.d
    po = _run(p, "p0", _ids(150, 10), 1)
    assert po.retained is not None
    params = p.params_for(po.retained)
    busy = threading.Event()

    def engine_busy() -> None:  # a 0.3 s step on the decode's engine thread (its private lock here)
        with d._lock:
            busy.set()
            time.sleep(0.3)

    step = threading.Thread(target=engine_busy)
    step.start()
    busy.wait(5.0)
    result = d.pull(_ids(150, 10), None, params)
    step.join()
    assert (result.pulled_tokens, result.fallback) == (144, None)
    assert result.phases["engine_wait"] >= 0.2, result.phases
    assert result.phases["plan"] < 0.2, result.phases

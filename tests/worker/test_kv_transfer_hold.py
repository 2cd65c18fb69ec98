"""The one check before a KV READ: the sender's hold (KVTransfer.hold) compares a digest of the
offered pages with its own lease and pins them for the READ, whatever happens to the lease
meanwhile; the puller's READ deadline counts from its request for the hold; the sender's agent
is fetched once per incarnation. Two engines in one process, real NIXL (UCX over CPU memory)."""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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

T = TypeVar("T")


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
    delays the decode's hold answers (a slow or frozen sender). Each worker's engine thread is its
    lock in ``engine_locks``; ``hops`` counts the calls onto it by role."""

    def __init__(self, model: Path, **reuse: Any) -> None:
        self.calls: Counter[str] = Counter()
        self.hops: Counter[str] = Counter()
        self.engine_locks = {role: threading.RLock() for role in ("prefill", "decode")}
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
                run_on_engine=functools.partial(self.on_engine, role),
                fetch_agent_info=self._agent,
                hold_remote=self._hold,
                release_remote=self._release,
                peers=PeerSet(["local://prefill", "local://decode"]),
            )
        self.p, self.d = self.w["local://prefill"], self.w["local://decode"]

    def on_engine(self, role: str, fn: Callable[[], T]) -> T:
        """``fn()`` on ``role``'s engine thread, counted in ``hops``."""
        with self.engine_locks[role]:
            self.hops[role] += 1
            return fn()

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

    def engine_busy() -> None:  # a 0.3 s step on the decode's engine thread (its lock here)
        with pair.engine_locks["decode"]:
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


def _finish(kvt: KVTransfer, rids: set[str]) -> dict[str, RequestOutput]:
    """Step until every request of ``rids`` finished; their final outputs."""
    done: dict[str, RequestOutput] = {}
    while set(done) != rids:
        for out in kvt.engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _adder(kvt: KVTransfer, rid: str, ids: list[int], log: list[str | None]) -> Callable[[str | None], None]:
    """An ``admit`` (or the caller's own add): the request ``rid`` under the pin it is given, logged."""

    def add(pin: str | None) -> None:
        log.append(pin)
        kvt.engine.add_request(rid, ids, SamplingParams(max_tokens=4, ignore_eos=True), admission_pin=pin)

    return add


def test_a_pull_that_reads_adds_its_request_in_its_adopt_hop(pair: Pair) -> None:
    """Two calls onto the engine thread (plan; adopt with the add), not three: the add waits for no step of its own."""
    p, d = pair.p, pair.d
    pool = d.engine.pool
    params = []
    for k in range(2):
        po = _run(p, f"p{k}", _ids(150, 20 + k), 1)
        assert po.retained is not None
        params.append(p.params_for(po.retained))
    # without ``admit``: the pull's two hops, then the caller's add is a third
    added: list[str | None] = []
    hops = pair.hops["decode"]
    res = d.pull(_ids(150, 20), None, params[0])
    assert (res.pulled_tokens, res.admitted, pair.hops["decode"] - hops) == (144, False, 2)
    assert "caller" not in d.engine.requests and added == []
    pair.on_engine("decode", lambda: _adder(d, "caller", _ids(150, 20), added)(res.admission_pin))
    assert pair.hops["decode"] - hops == 3 and added == [res.admission_pin]
    # with ``admit``: two hops, the add inside the second, under the pin just taken
    in_hop: list[int] = []  # which of the pull's hops the add ran in
    add = _adder(d, "pulled", _ids(150, 21), added)

    def admit(pin: str) -> None:
        in_hop.append(pair.hops["decode"] - hops)
        add(pin)

    hops = pair.hops["decode"]
    res2 = d.pull(_ids(150, 21), None, params[1], admit=admit)
    assert (res2.pulled_tokens, res2.fallback, res2.admitted, pair.hops["decode"] - hops) == (144, None, True, 2)
    assert in_hop == [2] and added == [res.admission_pin, res2.admission_pin]
    assert res2.admission_pin is not None and d.engine.requests["pulled"].admission_pin == res2.admission_pin
    assert len(pool.pin_pages(res2.admission_pin)) == 9  # the 144 pulled tokens' pages, until admission
    outs = _finish(d, {"caller", "pulled"})
    assert [(outs[r].num_pulled_tokens, outs[r].num_cached_tokens) for r in ("caller", "pulled")] == [(144, 144), (144, 144)]
    assert pool.pin_ids() == [] and pool.num_owned == 0
    _wait_no_holds(p)


def test_a_pull_that_reads_nothing_adds_its_request_with_its_local_prefix_pinned(pair: Pair) -> None:
    """Every matched page is held here: nothing READ, the local prefix pinned and the request added in one hop."""
    p, d = pair.p, pair.d
    pool = d.engine.pool
    ids = _ids(150, 30)
    _run(d, "local", ids, 1, retain=False)  # the prompt's 9 full pages cached here
    po = _run(p, "p", ids, 1)
    assert po.retained is not None
    params = p.params_for(po.retained)
    local = [pool.lookup(h) for h in params.page_hashes]
    assert None not in local and len(local) == 9
    added: list[str | None] = []
    hops = pair.hops["decode"]
    res = d.pull(ids, None, params, admit=_adder(d, "again", ids, added))
    assert (res.skipped, res.pulled_tokens, res.local_tokens, res.admitted) == ("nothing_to_pull", 0, 144, True)
    assert pair.hops["decode"] - hops == 2 and added == [res.admission_pin]
    assert res.admission_pin is not None and sorted(pool.pin_pages(res.admission_pin)) == sorted(local)
    assert d.engine.requests["again"].admission_pin == res.admission_pin
    out = _finish(d, {"again"})["again"]
    assert (out.num_pulled_tokens, out.num_cached_tokens) == (0, 144)
    assert pool.pin_ids() == [] and pool.num_owned == 0
    assert p.leases() == []  # the hold consumed the prefill's single-use lease all the same
    _wait_no_holds(p)


def test_a_pull_without_an_adopt_hop_leaves_the_add_to_its_caller(pair: Pair) -> None:
    """No params (no hop at all), nothing matched and nothing held here (the plan's hop only): ``admit`` never runs."""
    p, d = pair.p, pair.d
    kept = [_run(p, f"p{k}", _ids(150, 40 + k), 1).retained for k in range(2)]
    assert kept[0] is not None and kept[1] is not None
    other = p.params_for(kept[1])  # another prompt's pages: no hash matches, nothing pinned
    called: list[str | None] = []
    for params, want_hops, want_fallback in ((None, 0, None), (other, 1, "hash_mismatch")):
        hops = pair.hops["decode"]
        res = d.pull(_ids(150, 40), None, params, admit=called.append)
        assert (res.admitted, res.admission_pin, res.fallback, pair.hops["decode"] - hops) == (False, None, want_fallback, want_hops)
    assert called == [] and d.engine.pool.pin_ids() == []


@pytest.mark.parametrize("read", [True, False])
def test_an_admit_that_raises_releases_its_pin_and_reaches_the_caller(pair: Pair, read: bool) -> None:
    """The engine refuses the add: the admission pin is released in the same engine call, no page stays
    owned or pinned, and the error leaves ``pull`` (with and without pages READ)."""
    p, d = pair.p, pair.d
    pool = d.engine.pool
    ids = _ids(150, 50)
    if not read:
        _run(d, "local", ids, 1, retain=False)
    po = _run(p, "p", ids, 1)
    assert po.retained is not None
    free, cached = pool.num_free_pages(bits=4), pool.num_cached
    given: list[str] = []

    def refuse(pin: str) -> None:
        given.append(pin)
        raise ValueError("refused by the engine")

    hops = pair.hops["decode"]
    with pytest.raises(ValueError, match="refused by the engine"):
        d.pull(ids, None, p.params_for(po.retained), admit=refuse)
    assert pair.hops["decode"] - hops == 2 and len(given) == 1 and pool.get_pin(given[0]) is None
    assert pool.pin_ids() == [] and pool.num_owned == 0 and d.engine.requests == {}
    assert pool.num_free_pages(bits=4) == free and pool.num_cached == cached + (9 if read else 0)  # READ pages stay cached
    assert d.puller.pulls == (1 if read else 0)  # the READ counts whatever the add does
    _wait_no_holds(p)

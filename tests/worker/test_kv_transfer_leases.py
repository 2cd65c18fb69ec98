"""Retained KV and its leases on one engine (no peer): what a finished request keeps,
renew caps, release and expiry back to the prefix cache's LRU, a newer turn
replacing its conversation's lease (only its own: a request naming another
conversation's key leaves that lease alone), and a `both` worker reusing its own
retained conversation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserving.config import KVCacheConfig, ModelConfig, ReuseConfig, ServingConfig
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv.transfer import KVTransfer
from kvserving.worker.kv.leases import RetainSpec, pin_for_admission, release_admission
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.sequence import Sequence
from kvserving.worker.sampling import SamplingParams


def _kvt(model: Path, role: str, **reuse: Any) -> KVTransfer:
    cfg = ServingConfig(
        model=ModelConfig(path=str(model)),
        kv_cache=KVCacheConfig(memory_bytes=2 << 20),
        reuse=ReuseConfig(retention_ttl_s=60.0, lease_ttl_s=50.0, **reuse),
    )
    eng = LLMEngine(cfg)
    return KVTransfer(eng, cfg.reuse, engine_id=f"{role}-test", agent_url="http://127.0.0.1:1", role=role)


@pytest.fixture()
def decode(tiny_model_dir: Path) -> Iterator[KVTransfer]:
    kvt = _kvt(tiny_model_dir, "decode")
    yield kvt
    kvt.close()


_tokens: dict[str, list[int]] = {}  # request id -> generated tokens


def _run(kvt: KVTransfer, rid: str, ids: list[int], gen: int, spec: RetainSpec | None) -> RequestOutput:
    kvt.engine.add_request(rid, ids, SamplingParams(max_tokens=gen, ignore_eos=True), retain=spec)
    _tokens[rid] = []
    while True:
        for out in kvt.engine.step():
            _tokens[out.request_id].extend(out.new_token_ids)
            if out.request_id == rid and out.finished:
                return out


def _seq(ids: list[int]) -> Sequence:
    return Sequence("hashes", ids, SamplingParams(), torch.Generator())


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_retained_pages_are_pinned_listed_and_renewed(decode: KVTransfer) -> None:
    pool = decode.engine.pool
    out = _run(decode, "r1", _ids(100, 1), 20, decode.retain_spec(conversation_key="conv", input_ids=_ids(100, 1)))
    kept = out.retained
    assert kept is not None and kept.lease_id.startswith("kv-")
    assert (len(kept.page_ids), kept.num_tokens) == (7, 112)  # (100 + 20 - 1) // 16 full pages
    assert all(pool.ref_count(pid) == 1 for pid in kept.page_ids)  # the lease's ref, nothing else
    assert pool.num_owned == 7
    [lease] = decode.leases()
    assert (lease["lease_id"], lease["conversation_key"], lease["num_pages"], lease["num_tokens"]) == (kept.lease_id, "conv", 7, 112)
    assert lease["expires_at"] == pytest.approx(time.time() + 60.0, abs=2.0)
    params = lease["kv_transfer_params"]
    assert params["page_ids"] == list(kept.page_ids) and params["layout_hash"] == decode.layout_hash
    assert decode.leases(conversation_key="other") == []
    assert decode.renew(kept.lease_id, 5.0) == pytest.approx(time.time() + 5.0, abs=1.0)
    assert decode.renew(kept.lease_id, 10_000.0) == pytest.approx(time.time() + 60.0, abs=1.0)  # capped
    with pytest.raises(KeyError):
        decode.renew("kv-unknown")
    with pytest.raises(KeyError):
        decode.release("kv-unknown")
    with pytest.raises(ValueError, match="ttl_s"):
        decode.renew(kept.lease_id, -1.0)


def test_release_and_newer_turn_send_pages_to_the_lru(decode: KVTransfer) -> None:
    pool = decode.engine.pool
    ids = _ids(100, 2)
    first = _run(decode, "t1", ids, 20, decode.retain_spec(conversation_key="c", input_ids=ids))
    assert first.retained is not None
    turn2 = ids + _tokens["t1"] + _ids(40, 4)  # the conversation goes on: its history, then new text
    second = _run(decode, "t2", turn2, 8, decode.retain_spec(conversation_key="c", input_ids=turn2))
    assert second.retained is not None
    assert [le["lease_id"] for le in decode.leases()] == [second.retained.lease_id]  # the continuation replaces it
    # the superseded lease's pages live on in the newer one (its leading pages)
    assert second.retained.page_ids[: len(first.retained.page_ids)] == first.retained.page_ids
    decode.release(second.retained.lease_id)
    assert decode.leases() == [] and pool.num_owned == 0
    assert pool.num_cached >= len(second.retained.page_ids)
    # still reusable locally: the same prompt hits every full page but the last token's
    again = _run(decode, "t3", turn2, 1, None)
    assert again.num_cached_tokens == (len(turn2) - 1) // 16 * 16


def test_a_request_naming_another_conversations_key_keeps_that_conversations_lease(decode: KVTransfer) -> None:
    """A conversation key is only a name: a retain under the victim's key whose pages do not
    continue the victim's history adds a lease beside the victim's, which stays whole (its
    pages pinned, its next turn reusing all of them)."""
    pool = decode.engine.pool
    victim_ids = _ids(100, 20)
    victim = _run(decode, "v1", victim_ids, 20, decode.retain_spec(conversation_key="user:victim", input_ids=victim_ids))
    assert victim.retained is not None
    attacker = _run(decode, "a1", _ids(100, 21), 20, decode.retain_spec(conversation_key="user:victim", input_ids=_ids(100, 21)))
    assert attacker.retained is not None
    by_id = {le["lease_id"]: le for le in decode.leases(conversation_key="user:victim")}
    assert sorted(by_id) == sorted([victim.retained.lease_id, attacker.retained.lease_id])
    assert by_id[victim.retained.lease_id]["kv_transfer_params"]["page_ids"] == list(victim.retained.page_ids)
    assert all(pool.ref_count(p) >= 1 for p in victim.retained.page_ids)
    # the victim's next turn: every page of its history from the kept lease, which it then replaces
    turn2 = victim_ids + _tokens["v1"] + _ids(30, 22)
    second = _run(decode, "v2", turn2, 4, decode.retain_spec(conversation_key="user:victim", input_ids=turn2))
    assert second.num_cached_tokens == victim.retained.num_tokens == 112
    assert second.retained is not None
    assert sorted(le["lease_id"] for le in decode.leases()) == sorted([second.retained.lease_id, attacker.retained.lease_id])


def test_prefill_hold_expires_into_the_lru(tiny_model_dir: Path) -> None:
    kvt = _kvt(tiny_model_dir, "prefill", transfer_timeout_s=0.3)
    try:
        before = time.time()
        out = _run(kvt, "p", _ids(64, 5), 1, kvt.retain_spec())
        assert out.retained is not None and out.retained.lease_id.startswith("xfer-")
        # the hold's expiry is the transfer timeout after the retain, which came between the two clock reads
        assert before + 0.3 <= kvt.params_for(out.retained).expires_at <= time.time() + 0.3
        time.sleep(0.4)
        assert kvt.leases() == []  # expired (no engine step needed)
        pool = kvt.engine.pool
        assert pool.num_owned == 0 and pool.num_cached == 4
        with pytest.raises(KeyError):
            kvt.renew(out.retained.lease_id)
    finally:
        kvt.close()


def test_both_worker_reuses_its_own_retained_conversation(decode: KVTransfer) -> None:
    ids = _ids(150, 6)
    t1 = _run(decode, "b1", ids, 20, decode.retain_spec(conversation_key="b", input_ids=ids))
    assert t1.retained is not None and t1.retained.num_tokens == 160  # (150 + 20 - 1) // 16 pages
    turn2 = ids + _tokens["b1"] + _ids(50, 7)
    t2 = _run(decode, "b2", turn2, 8, decode.retain_spec(conversation_key="b", input_ids=turn2))
    assert (t2.num_cached_tokens, t2.num_pulled_tokens) == (160, 0)
    fresh = LLMEngine(decode.engine.config).generate([turn2], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert _tokens["b2"] == fresh


def test_admission_pin_is_released_on_abort(decode: KVTransfer) -> None:
    pool = decode.engine.pool
    pages = pool.allocate([4, 4])
    assert pages is not None
    pin = pin_for_admission(pool, pages, pulled=pages, ttl_s=30.0)
    pool.free(pages)
    decode.engine.add_request("ab", _ids(40, 8), SamplingParams(max_tokens=2), admission_pin=pin)
    decode.engine.abort("ab")
    assert pool.pin_ids() == [] and pool.num_owned == 0


def test_an_admission_whose_pin_went_first_is_counted(decode: KVTransfer) -> None:
    # a request whose pulled pages' pin expired or yielded whole before it ran: counted once, at its
    # admission; a pin that gave up only its tail is not gone
    pool, stats = decode.engine.pool, decode.engine.stats
    before = stats.admission_pins_gone
    gone = 0
    for rid, seed, trimmed in (("kept", 9, 0), ("trimmed", 11, 1), ("gone", 10, 2)):
        pages = pool.allocate([4, 4])
        assert pages is not None
        pin = pin_for_admission(pool, pages, pulled=pages, ttl_s=30.0)
        pool.free(pages)
        if trimmed:
            pool.trim_pin(pin, trimmed)
        gone += trimmed == 2
        decode.engine.add_request(rid, _ids(40, seed), SamplingParams(max_tokens=1), admission_pin=pin)
        while decode.engine.has_unfinished():
            decode.engine.step()
        assert stats.admission_pins_gone - before == gone, rid
    assert pool.pin_ids() == []


def test_a_pull_pins_the_pages_held_here_past_the_first_one_it_pulls(tiny_model_dir: Path) -> None:
    # the prompt's pages 0-5 are cached here but page 2 was evicted: a pull READs page 2 only, and
    # pages 3-5 must stay until the request is admitted, else its match ends at 3 and the READ is wasted
    decode = _kvt(tiny_model_dir, "decode", recompute_threshold_tokens=0)
    try:
        _pull_past_a_missing_page(decode)
    finally:
        decode.close()


def _pull_past_a_missing_page(decode: KVTransfer) -> None:
    pool, kv = decode.engine.pool, decode.engine.kv
    ids = _ids(100, 11)
    _run(decode, "cached", ids, 1, None)
    hashes = kv.page_hashes(_seq(ids), [4] * 6)
    pids = [pool.lookup(h) for h in hashes]
    assert None not in pids and pool.num_owned == 0
    # evict page 2 alone: pages 3-5 pinned, the free pages taken, then one allocation evicts the LRU's
    # head (a sequence's pages queue last page first: 2, then 1, 0)
    hold = pin_for_admission(pool, pids[3:], pulled=(), ttl_s=30.0)
    filler = pool.allocate([4] * sum(n for _, n in pool.free_runs()))
    extra = pool.allocate([4])
    assert filler is not None and extra is not None and pool.lookup(hashes[2]) is None
    release_admission(pool, hold, ())
    pool.free(filler + extra)
    params = KVTransferParams(
        engine_id="sender",
        agent_url="http://127.0.0.1:1",
        lease_id="lease",
        page_ids=tuple(range(500, 506)),
        page_hashes=tuple(hashes),
        num_tokens=100,
        page_size=16,
        dtype=decode.dtype,
        layout_hash=decode.layout_hash,
        expires_at=time.time() + 60,
    )
    plan = decode.puller._plan(ids, [], params)
    assert (plan.local_pids, plan.want, plan.held_between) == (pids[:2], [2], pids[3:])
    assert plan.local_pin is not None and sorted(pool.pin_pages(plan.local_pin)) == sorted(pids[:2] + pids[3:])
    assert plan.local is not None and len(plan.local) == 1  # the page to READ page 2 into
    # every other page of the pool taken: the kept pages stay cached under their hashes
    pool.allocate([4] * pool.num_free_pages(bits=4))
    assert [pool.lookup(h) for h in hashes[:2] + hashes[3:]] == pids[:2] + pids[3:]


def test_a_pull_reclaims_retained_conversations_when_the_pool_is_full(decode: KVTransfer) -> None:
    # Fill the pool with retained conversations, then ask for pages to READ a pulled prompt into:
    # the retained leases yield, least recently active first, instead of the pull being refused.
    pool = decode.engine.pool
    leases = []
    n = 0
    while pool.num_free_pages(bits=4) >= 8:
        out = _run(decode, f"fill{n}", _ids(100, 100 + n), 20, decode.retain_spec(conversation_key=f"c{n}", input_ids=_ids(100, 100 + n)))
        assert out.retained is not None
        leases.append(out.retained.lease_id)
        n += 1
    free_before = pool.num_free_pages(bits=4)  # allocate can give this much without a lease going
    want = free_before + 7  # more than the free list and the evictable cache can give
    before = pool.reclaimed_pins
    got = decode.puller.allocate_for_pull([4] * want)
    assert got is not None and len(got) == want
    reclaimed = pool.reclaimed_pins - before
    assert reclaimed >= 1
    held = {le["lease_id"] for le in decode.leases()}
    assert held == set(leases[reclaimed:])  # the oldest retained conversations went first


def test_a_pull_does_not_take_the_pages_pulled_for_a_request_waiting_to_be_admitted(decode: KVTransfer) -> None:
    # Pages pulled for a request not yet admitted stay pinned against another pull: taken, that
    # request would compute them again (the pull waits for pages instead). A retained conversation
    # still yields.
    pool = decode.engine.pool
    retained = _run(decode, "kept", _ids(100, 7), 20, decode.retain_spec(conversation_key="kept", input_ids=_ids(100, 7))).retained
    pulled = _run(decode, "pulled", _ids(100, 8), 1, None)
    assert retained is not None and pulled.retained is None
    seq_pages = [pool.lookup(h) for h in decode.engine.kv.page_hashes(_seq(_ids(100, 8)), [4] * 6)]
    pages = [p for p in seq_pages if p is not None]
    assert len(pages) == 6  # (100 - 1) // 16 full pages cached
    pin = pin_for_admission(pool, pages, pulled=pages, ttl_s=60.0)
    taken = pool.allocate([4] * (pool.num_free_pages(bits=4) - 7))  # the free list and the cache, but 7 pages
    assert taken is not None
    # 7 free + the retained conversation's 7 pages: 14 at most without the admission pin's 6
    assert decode.puller.allocate_for_pull([4] * 15) is None
    # nothing yields for a pull that would not fit even then
    assert pool.get_pin(pin) is not None and [le["conversation_key"] for le in decode.leases()] == ["kept"]
    got = decode.puller.allocate_for_pull([4] * 14)
    # the retained conversation yielded, the admission pin did not
    assert got is not None and pool.get_pin(pin) is not None and decode.leases() == []
    pool.free(got)
    pool.free(taken)
    release_admission(pool, pin, ())


def test_a_pull_into_a_full_pool_waits_for_pages_until_its_deadline(decode: KVTransfer) -> None:
    # Every page owned by running requests: the pull's pages come when one of them ends, not a
    # recompute that would need as many pages; with none ending, it gives up at its deadline.
    pool = decode.engine.pool
    taken = pool.allocate([4] * pool.num_free_pages(bits=4))
    assert taken is not None and pool.num_free_pages(bits=4) == 0
    assert decode.puller.allocate_for_pull([4] * 3) is None
    start = time.monotonic()
    assert decode.puller.wait_for_pages([4] * 3, until=start + 0.3) is None
    assert time.monotonic() - start >= 0.25  # waited (polls of 20 ms) until the deadline's last poll
    got: list[list[int] | None] = []
    waiter = threading.Thread(target=lambda: got.append(decode.puller.wait_for_pages([4] * 3, until=time.monotonic() + 30.0)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive() and not got  # still waiting: nothing was freed
    pool.free(taken[:5])  # a request ended
    waiter.join(timeout=30.0)
    assert got and got[0] is not None and len(got[0]) == 3 and set(got[0]) <= set(taken[:5])  # the freed pages
    pool.free(got[0])
    pool.free(taken[5:])


def test_a_pull_that_read_nothing_had_only_its_leading_local_pages_in_place() -> None:
    from kvserving.worker.kv.puller import PullResult
    from kvserving.worker.service import lost_before_admission

    # 6 pages matched: 2 leading ones held here, page 2 to pull (skipped), pages 3-5 held here past it:
    # the request's match ends at page 2, so only the 2 leading pages were in place
    skipped = PullResult(matched_tokens=96, local_tokens=32, missed_tokens=16, skipped="below_threshold")
    assert [lost_before_admission(skipped, 32), lost_before_admission(skipped, 16)] == [0, 16]
    read = PullResult(pulled_tokens=16, matched_tokens=96, local_tokens=32)
    assert [lost_before_admission(read, 96), lost_before_admission(read, 48)] == [0, 48]


def test_a_pull_waits_for_the_senders_hold_as_long_as_recomputing_would_take(decode: KVTransfer) -> None:
    puller, stats = decode.puller, decode.engine.stats
    assert puller.prefill_tokens_per_s is None and puller.hold_wait_s(10_000) == decode.reuse.peer_timeout_s == 1.0
    stats.prompt_tokens_computed, stats.prefill_seconds = 4_000, 2.0  # a measured prefill: 2,000 tokens/s
    assert [puller.hold_wait_s(n) for n in (500, 2_000, 6_000)] == [1.0, 1.0, 3.0]

"""Pure routing policies (gateway/router.py), asserted by name."""

from __future__ import annotations

import random

import pytest

from kvserving.gateway.router import Decision, WorkerView, choose_decode, choose_prefill, prefill_load_bound, prefix_key

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def test_decode_goes_to_the_lease_holder_when_healthy_and_not_overloaded() -> None:
    workers = [WorkerView(A, True, 0), WorkerView(B, True, 5)]
    assert choose_decode(workers, lease_url=B, max_inflight=8) == Decision(B, "lease")


def test_decode_leaves_an_overloaded_lease_holder_for_the_least_loaded() -> None:
    workers = [WorkerView(A, True, 1), WorkerView(B, True, 8), WorkerView(C, True, 0)]
    assert choose_decode(workers, lease_url=B, max_inflight=8) == Decision(C, "lease_overloaded")


def test_decode_ignores_an_unhealthy_lease_holder() -> None:
    workers = [WorkerView(A, True, 3), WorkerView(B, False, 0)]
    assert choose_decode(workers, lease_url=B, max_inflight=8) == Decision(A, "least_loaded")


def test_decode_least_loaded_breaks_ties_by_retained_conversations_then_url() -> None:
    workers = [WorkerView(B, True, 1, leases=0), WorkerView(A, True, 1, leases=2), WorkerView(C, True, 2)]
    assert choose_decode(workers, lease_url=None, max_inflight=8) == Decision(B, "least_loaded")
    workers = [WorkerView(B, True, 0), WorkerView(A, True, 0)]
    assert choose_decode(workers, lease_url=None, max_inflight=8) == Decision(A, "least_loaded")


def test_no_healthy_worker_is_no_decision() -> None:
    assert choose_decode([WorkerView(A, False, 0)], lease_url=None, max_inflight=8) is None
    assert choose_prefill([WorkerView(A, False, 0)], key=b"k") is None
    assert choose_decode([], lease_url=A, max_inflight=8) is None


def test_prefill_same_first_pages_same_worker_whatever_the_rest() -> None:
    workers = [WorkerView(u, True, 0) for u in (A, B, C)]
    system = list(range(100, 164))  # 64 tokens: the shared system prompt
    picks = {choose_prefill(workers, key=prefix_key(system + tail)).url for tail in ([1], [2, 3], list(range(500)))}  # type: ignore[union-attr]
    assert len(picks) == 1
    spread = {choose_prefill(workers, key=prefix_key([i] * 64)).url for i in range(60)}  # type: ignore[union-attr]
    assert spread == {A, B, C}  # different prompts spread over the workers


def test_prefill_hash_choice_is_stable_when_another_worker_leaves() -> None:
    workers = [WorkerView(u, True, 0) for u in (A, B, C)]
    keys = [prefix_key([i] * 64) for i in range(60)]
    before = {k: choose_prefill(workers, key=k).url for k in keys}  # type: ignore[union-attr]
    without_c = [WorkerView(A, True, 0), WorkerView(B, True, 0), WorkerView(C, False, 0)]
    after = {k: choose_prefill(without_c, key=k).url for k in keys}  # type: ignore[union-attr]
    # rendezvous hashing: only C's prompts move
    assert all(after[k] == before[k] for k in keys if before[k] != C)
    assert all(after[k] in (A, B) for k in keys)


def _hash_order(key: bytes) -> list[str]:
    """A, B, C in the key's rendezvous order, read off the router itself (drop the winner, ask again)."""
    order: list[str] = []
    for _ in range(3):
        d = choose_prefill([WorkerView(u, u not in order, 0) for u in (A, B, C)], key=key)
        assert d is not None and d.reason == "prefix_hash"
        order.append(d.url)
    return order


def test_prefill_load_bound_values() -> None:
    assert prefill_load_bound(0, 3, eps=0.0) == 1  # ceil(1 / 3)
    assert prefill_load_bound(4, 3, eps=0.0) == 2  # ceil(5 / 3)
    assert prefill_load_bound(4, 3, eps=0.25) == 3  # ceil(6.25 / 3)
    assert prefill_load_bound(63, 16, eps=0.0) == 4  # exactly the mean: no rounding
    assert prefill_load_bound(63, 16, eps=0.25) == 5
    with pytest.raises(ValueError, match="eps"):
        choose_prefill([WorkerView(A, True, 0)], key=b"k", eps=-0.1)


def test_prefill_keeps_the_first_choice_within_the_bound_and_overflows_in_hash_order() -> None:
    key = prefix_key([7] * 64)
    o1, o2, o3 = _hash_order(key)
    # loads 2, 1, 1: total 4 of 3 workers
    state = [WorkerView(o1, True, 2), WorkerView(o2, True, 1), WorkerView(o3, True, 1)]
    assert choose_prefill(state, key=key, eps=0.25) == Decision(o1, "prefix_hash")  # 3 <= ceil(6.25/3) = 3
    assert choose_prefill(state, key=key, eps=0.0) == Decision(o2, "prefix_overflow")  # 3 > ceil(5/3) = 2 >= 1 + 1
    # overflow goes to the next in the hash order, not to the least loaded
    state = [WorkerView(o1, True, 4), WorkerView(o2, True, 2), WorkerView(o3, True, 0)]
    assert choose_prefill(state, key=key, eps=0.0) == Decision(o2, "prefix_overflow")  # bound ceil(7/3) = 3
    state = [WorkerView(o1, True, 4), WorkerView(o2, True, 3), WorkerView(o3, True, 0)]
    assert choose_prefill(state, key=key, eps=0.0) == Decision(o3, "prefix_overflow")  # bound ceil(8/3) = 3
    assert choose_prefill(state, key=key, eps=1.0) == Decision(o1, "prefix_hash")  # 5 <= ceil(16/3) = 6


def test_prefill_skips_unhealthy_workers_and_their_load() -> None:
    key = prefix_key([7] * 64)
    o1, o2, o3 = _hash_order(key)
    # o1 down: o2 is the first choice among the healthy; o1's 100 requests do not raise the bound
    state = [WorkerView(o1, False, 100), WorkerView(o2, True, 0), WorkerView(o3, True, 0)]
    assert choose_prefill(state, key=key, eps=0.0) == Decision(o2, "prefix_hash")
    state = [WorkerView(o1, False, 100), WorkerView(o2, True, 1), WorkerView(o3, True, 0)]
    assert choose_prefill(state, key=key, eps=0.0) == Decision(o3, "prefix_overflow")  # 2 > ceil(2/2) = 1


def test_prefill_equal_loads_and_input_order_do_not_change_the_choice() -> None:
    key = prefix_key([7] * 64)
    o1, o2, o3 = _hash_order(key)
    for load in (0, 3):
        for urls in ((A, B, C), (C, B, A), (B, C, A)):
            state = [WorkerView(u, True, load) for u in urls]
            assert choose_prefill(state, key=key, eps=0.0) == Decision(o1, "prefix_hash")  # load + 1 <= ceil((3 load + 1)/3)
    # the first choice exactly at the bound is kept; one more and it overflows
    at = [WorkerView(o1, True, 2), WorkerView(o2, True, 2), WorkerView(o3, True, 1)]  # bound ceil(6/3) = 2: o1 and o2 would hold 3
    assert choose_prefill(at, key=key, eps=0.0) == Decision(o3, "prefix_overflow")
    at = [WorkerView(o1, True, 2), WorkerView(o2, True, 2), WorkerView(o3, True, 2)]  # bound ceil(7/3) = 3
    assert choose_prefill(at, key=key, eps=0.0) == Decision(o1, "prefix_hash")


def test_prefill_one_shared_prompt_spreads_within_the_bound() -> None:
    """The simulator's hotspot: every agent has the same first pages. Requests that never finish
    fill the workers to the bound in hash order; no worker is ever more than ceil((1 + eps) mean)."""
    urls = [f"http://p{i}:8000" for i in range(16)]
    key = prefix_key(list(range(64)))
    for eps in (0.0, 0.25):
        load = dict.fromkeys(urls, 0)
        for n in range(1, 65):
            d = choose_prefill([WorkerView(u, True, load[u]) for u in urls], key=key, eps=eps)
            assert d is not None
            load[d.url] += 1
            assert max(load.values()) <= prefill_load_bound(n - 1, 16, eps=eps)
        assert sorted(load.values(), reverse=True) == ([4] * 16 if eps == 0 else [5] * 12 + [4] + [0] * 3)


def test_prefill_choice_meets_the_bound_on_random_states() -> None:
    rng = random.Random(3)
    for _ in range(300):
        state = [WorkerView(u, rng.random() > 0.2, rng.randrange(0, 9)) for u in (A, B, C)]
        key = bytes(rng.randrange(256) for _ in range(16))
        eps = rng.choice([0.0, 0.25, 1.0])
        d = choose_prefill(state, key=key, eps=eps)
        healthy = [w for w in state if w.healthy]
        if not healthy:
            assert d is None
            continue
        assert d is not None
        bound = prefill_load_bound(sum(w.inflight for w in healthy), len(healthy), eps=eps)
        order = _hash_order(key)
        ranked = [w for u in order for w in healthy if w.url == u]
        first_ok = next(w for w in ranked if w.inflight + 1 <= bound)
        assert d == Decision(first_ok.url, "prefix_hash" if first_ok is ranked[0] else "prefix_overflow")

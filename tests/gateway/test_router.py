"""Pure routing policies (gateway/router.py), asserted by name."""

from __future__ import annotations

from kvserving.gateway.router import Decision, WorkerView, choose_decode, choose_prefill, prefix_key

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


def test_prefill_leaves_a_busy_hash_choice_for_the_least_loaded() -> None:
    key = prefix_key([7] * 64)
    idle = [WorkerView(u, True, 0) for u in (A, B)]
    preferred = choose_prefill(idle, key=key)
    assert preferred is not None and preferred.reason == "prefix_hash"
    other = B if preferred.url == A else A
    busy = [WorkerView(preferred.url, True, 5), WorkerView(other, True, 0)]
    assert choose_prefill(busy, key=key, slack=4) == Decision(other, "least_loaded")
    assert choose_prefill(busy, key=key, slack=5) == Decision(preferred.url, "prefix_hash")

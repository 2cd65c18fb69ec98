"""The conversation store: one record per conversation, one budget, one LRU; a record with a
turn in flight is never evicted; an evicted record takes its indexes' entries with it and
hands its lease over to be released."""

from __future__ import annotations

from array import array

import pytest

from kvserving.gateway.conversations import Conversations
from kvserving.gateway.exact_history import Held
from kvserving.gateway.leases import LeaseTable


def held(n: int) -> Held:
    return Held(array("i", range(n)), array("i", range(n)), "x" * n, ",".join(map(str, range(n))))


def test_records_are_least_recently_used_first_out_within_the_count() -> None:
    store = Conversations(max_conversations=2)
    for key in "abc":
        store.open(key, scope="")
    assert [c.key for c in store] == ["b", "c"]
    store.open("b", scope="")  # used again: "c" is now the least recent
    store.open("d", scope="")
    assert [c.key for c in store] == ["b", "d"]


def test_a_record_is_charged_its_longest_form_and_the_budget_evicts() -> None:
    store = Conversations(max_tokens=100)
    a = store.open("a", scope="")
    store.hold(a, held(60))
    assert (a.charge, store.tokens) == (60, 60)
    b = store.open("b", scope="")
    store.hold(b, held(30))
    assert store.tokens == 90
    store.hold(b, held(50))  # b grew: a, the least recently used, goes
    assert [c.key for c in store] == ["b"] and store.tokens == 50
    alone = store.open("c", scope="")
    store.hold(alone, held(500))  # over the budget alone: kept (its next turn needs it), the rest go
    assert [c.key for c in store] == ["c"] and store.tokens == 500
    store.forget("c")
    assert len(store) == 0 and store.tokens == 0


def test_a_record_with_a_turn_in_flight_is_never_evicted() -> None:
    store = Conversations(max_conversations=1)
    a = store.open("a", scope="")
    store.begin_turn(a, now=0.0)
    store.open("b", scope="")
    assert [c.key for c in store] == ["a", "b"]  # over the count while "a" runs
    store.end_turn(a, now=1.0)
    store.open("c", scope="")
    assert [c.key for c in store] == ["c"]


def test_an_evicted_records_lease_is_handed_over_and_the_lease_table_reads_the_records() -> None:
    store = Conversations(max_conversations=2)
    table = LeaseTable(store, lease_ttl_s=10.0, heartbeat_s=2.0, max_leases=100)
    table.put("a", worker_url="http://w1", params={"lease_id": "la", "expires_at": 50.0}, now=0.0)
    table.put("b", worker_url="http://w2", params={"lease_id": "lb", "expires_at": 5.0}, now=0.0)
    a = store.get("a")
    assert a is not None and a.lease is table.get("a") and dict(table.per_worker) == {"http://w1": 1, "http://w2": 1}
    assert table.live(now=6.0) == 1  # "b"'s worker lease ended at 5
    store.open("c", scope="")  # "a" is the least recently used record
    assert [lease.lease_id for lease in store.take_evicted_leases()] == ["la"]
    assert store.take_evicted_leases() == [] and table.keys() == ["b"] and dict(table.per_worker) == {"http://w2": 1}


def test_bad_bounds_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_conversations"):
        Conversations(max_conversations=0)
    with pytest.raises(ValueError, match="max_tokens"):
        Conversations(max_tokens=0)

"""The lease store over the pool's one pin table (worker/kv/leases.py): pure Python, a tiny pool."""

from __future__ import annotations

import pytest

from kvserving.worker.kv.leases import (
    AdmissionRecord,
    HoldRecord,
    LeaseMismatchError,
    LeaseRecord,
    LeaseStore,
    PinKind,
    RetainSpec,
    lease_digest,
    new_pin_id,
    parse_lease_id,
    pin_for_admission,
    release_admission,
    retain,
)
from kvserving.worker.kv.page_pool import RECLAIM_FIRST, RECLAIM_LAST, RECLAIM_NEVER, PagePool


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(role: str = "decode") -> tuple[PagePool, LeaseStore, Clock]:
    clock = Clock()
    pool = PagePool(16, page_size=4, clock=clock)
    store = LeaseStore(pool, role=role, generation=0xABC, transfer_ttl_s=5.0, retention_ttl_s=60.0, max_hold_s=10.0)
    return pool, store, clock


def finished(pool: PagePool, n: int, first_hash: int = 1000) -> tuple[list[int], list[int]]:
    """A request's ``n`` full, published pages (the sequence still holds its refs)."""
    pages = pool.allocate([4] * n)
    assert pages is not None
    hashes = [first_hash + i for i in range(n)]
    for pid, h in zip(pages, hashes):
        pool.register(pid, h)
    return pages, hashes


def test_lease_ids_keep_their_wire_form_and_parse_back_to_kind_and_generation() -> None:
    kept = new_pin_id(PinKind.RETAINED, generation=0xABC)
    xfer = new_pin_id(PinKind.TRANSFER, generation=7)
    hold = new_pin_id(PinKind.HOLD)
    assert kept.startswith("kv-abc-") and xfer.startswith("xfer-7-") and hold.startswith("hold-")
    assert parse_lease_id(kept) == (PinKind.RETAINED, 0xABC)
    assert parse_lease_id(xfer) == (PinKind.TRANSFER, 7)
    assert [parse_lease_id(s) for s in (hold, "kv-zz-1", "kv-1", "pull-1-2", "")] == [None] * 5
    with pytest.raises(ValueError, match="generation"):
        new_pin_id(PinKind.RETAINED)


def test_the_role_picks_the_kind_ttl_and_reclaim_of_a_retain_spec() -> None:
    _, decode, _ = make("decode")
    _, prefill, _ = make("prefill")
    d = decode.retain_spec(conversation_key="c", input_ids=[1, 2])
    p = prefill.retain_spec(input_ids=[1, 2])
    assert (d.kind, d.ttl_s, d.reclaim, d.prompt) == (PinKind.RETAINED, 60.0, RECLAIM_FIRST, (1, 2))
    assert (p.kind, p.ttl_s, p.reclaim) == (PinKind.TRANSFER, 5.0, RECLAIM_NEVER)
    with pytest.raises(ValueError, match="RETAINED or TRANSFER"):
        RetainSpec("x", 1.0, kind=PinKind.HOLD)


def test_a_lease_lives_in_the_pool_pin_table_only() -> None:
    pool, store, clock = make()
    pages, hashes = finished(pool, 3)
    spec = store.retain_spec(conversation_key="c", input_ids=list(range(12)))
    kept = retain(pool, spec, pages, hashes, 4)
    assert kept is not None and (kept.page_ids, kept.page_hashes, kept.num_tokens) == (tuple(pages), tuple(hashes), 12)
    pin = pool.get_pin(kept.lease_id)
    assert pin is not None and isinstance(pin.record, LeaseRecord) and pin.reclaim == RECLAIM_FIRST
    assert store.leases() == [kept] and store.leases("other") == [] and store.totals() == (1, 12)
    # the pool reclaiming it is the store forgetting it: nothing to keep in sync
    assert pool.reclaim_one() == kept.lease_id and store.leases() == []
    pages2, hashes2 = finished(pool, 2, 2000)
    kept2 = retain(pool, store.retain_spec(), pages2, hashes2, 4)
    assert kept2 is not None
    clock.t += 60.0
    assert store.leases() == [] and pool.pin_ids() == []  # expired


def test_a_continuing_prompt_replaces_its_conversations_older_lease_and_a_foreign_one_does_not() -> None:
    pool, store, _ = make()
    old_pages, old_hashes = finished(pool, 2)
    old = retain(pool, store.retain_spec(conversation_key="c", input_ids=[1, 2, 3]), old_pages, old_hashes, 4)
    pages, hashes = finished(pool, 2, 3000)
    foreign = retain(pool, store.retain_spec(conversation_key="c", input_ids=[9, 2, 3, 4]), pages, hashes, 4)
    assert old is not None and foreign is not None
    assert [le.lease_id for le in store.leases("c")] == [old.lease_id, foreign.lease_id]
    pages3, hashes3 = finished(pool, 2, 4000)
    nxt = retain(pool, store.retain_spec(conversation_key="c", input_ids=[1, 2, 3, 7]), pages3, hashes3, 4)
    assert nxt is not None
    assert [le.lease_id for le in store.leases("c")] == [foreign.lease_id, nxt.lease_id]
    assert retain(pool, store.retain_spec(), [], [], 4) is None  # no full page: nothing kept


def test_renew_is_capped_and_refuses_what_is_not_a_lease() -> None:
    pool, store, clock = make()
    pages, hashes = finished(pool, 1)
    kept = retain(pool, store.retain_spec(), pages, hashes, 4)
    assert kept is not None
    assert store.renew(kept.lease_id, 5.0) == clock.t + 5.0
    assert store.renew(kept.lease_id) == clock.t + 60.0 and store.renew(kept.lease_id, 1e9) == clock.t + 60.0
    admission = pin_for_admission(pool, pages, pulled=pages, ttl_s=5.0)
    for pin_id in ("kv-1-2", admission):
        with pytest.raises(KeyError):
            store.renew(pin_id)
    with pytest.raises(ValueError, match="ttl_s"):
        store.renew(kept.lease_id, 0.0)


def test_a_hold_checks_the_digest_pins_the_pages_and_consumes_only_a_transfer_lease() -> None:
    pool, store, clock = make("prefill")
    pages, hashes = finished(pool, 2)
    kept = retain(pool, store.retain_spec(), pages, hashes, 4)
    assert kept is not None
    pool.free(pages)  # the request is done: the lease's ref is the only one
    digest = lease_digest(kept.page_ids, kept.page_hashes, kept.num_tokens)
    with pytest.raises(LeaseMismatchError):
        store.hold(kept.lease_id, digest=lease_digest(kept.page_ids, kept.page_hashes, 4), hold_s=1.0)
    with pytest.raises(KeyError):
        store.hold("xfer-1-2", digest=digest, hold_s=1.0)
    hold_id, expires = store.hold(kept.lease_id, digest=digest, hold_s=100.0, consume=True)
    pin = pool.get_pin(hold_id)
    assert pin is not None and pin.record == HoldRecord(kept.lease_id) and pin.record.kind is PinKind.HOLD
    assert expires == clock.t + 10.0  # capped at max_hold_s
    assert store.leases() == [] and [pool.ref_count(p) for p in pages] == [1, 1]  # consumed: the hold's ref only
    store.release(hold_id)
    assert pool.pin_ids() == [] and [pool.ref_count(p) for p in pages] == [0, 0]
    with pytest.raises(KeyError):
        store.release(hold_id)


def test_a_hold_leaves_a_retained_lease_in_place() -> None:
    pool, store, _ = make("decode")
    pages, hashes = finished(pool, 1)
    kept = retain(pool, store.retain_spec(), pages, hashes, 4)
    assert kept is not None
    hold_id, _ = store.hold(kept.lease_id, digest=lease_digest(kept.page_ids, kept.page_hashes, 4), hold_s=1.0, consume=True)
    assert [le.lease_id for le in store.leases()] == [kept.lease_id] and pool.pin_ids() == [kept.lease_id, hold_id]


def test_an_admission_pin_counts_the_pulled_pages_its_request_took() -> None:
    pool, store, _ = make()
    local, _ = finished(pool, 2)
    pulled, _ = finished(pool, 2, 5000)
    pin_id = pin_for_admission(pool, local + pulled, pulled=pulled, ttl_s=5.0)
    pin = pool.get_pin(pin_id)
    assert pin is not None and pin.record == AdmissionRecord(frozenset(pulled)) and pin.reclaim == RECLAIM_LAST
    with pytest.raises(KeyError):
        store.release(pin_id)  # not a lease nor a hold: a peer cannot drop it
    assert release_admission(pool, pin_id, local + pulled[:1]) == 1
    assert pool.get_pin(pin_id) is None and release_admission(pool, pin_id, pulled) == 0


def test_a_prefill_worker_counts_how_its_transfer_leases_ended_and_how_long_they_held() -> None:
    pool, store, clock = make("prefill")
    leases = []
    for i in range(3):
        pages, hashes = finished(pool, 2, first_hash=2000 + 10 * i)
        kept = retain(pool, store.retain_spec(), pages, hashes, 4)
        assert kept is not None
        pool.free(pages)
        leases.append(kept)
    clock.t += 1.5  # a READ hold takes the first over (single use): it held its pages 1.5 s
    store.hold(
        leases[0].lease_id, digest=lease_digest(leases[0].page_ids, leases[0].page_hashes, leases[0].num_tokens), hold_s=5.0, consume=True
    )
    clock.t += 0.5
    store.release(leases[1].lease_id)  # let go unread after 2 s
    clock.t += 4.5  # the third is past its 5 s TTL; the first's READ hold (5 s from 101.5) expires now
    pool.expire_pins()
    life = store.transfer_lifetimes
    assert life.ended == {"consumed": 1, "released": 1, "expired": 1, "hold_released": 0, "hold_expired": 1}
    assert life.seconds == pytest.approx({"consumed": 1.5, "released": 2.0, "expired": 6.5, "hold_released": 0.0, "hold_expired": 5.0})
    pages, hashes = finished(pool, 2, first_hash=3000)
    kept = retain(pool, store.retain_spec(), pages, hashes, 4)
    assert kept is not None
    hold_id, _ = store.hold(kept.lease_id, digest=lease_digest(kept.page_ids, kept.page_hashes, kept.num_tokens), hold_s=5.0, consume=True)
    clock.t += 0.25
    store.release(hold_id)  # the reader let go after its READ
    assert (life.ended["hold_released"], life.seconds["hold_released"]) == (1, pytest.approx(0.25))


def test_a_decode_worker_counts_no_transfer_lease() -> None:
    pool, store, clock = make("decode")
    pages, hashes = finished(pool, 2)
    kept = retain(pool, store.retain_spec(), pages, hashes, 4)
    assert kept is not None and pool.on_release is None
    store.release(kept.lease_id)
    assert sum(store.transfer_lifetimes.ended.values()) == 0

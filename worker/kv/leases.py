"""Leases: a finished request's pages kept under an id a peer can name, and the one store
that retains, renews, holds, releases and lists them. Pure Python, no torch.

Pages outlive their request through pins of the pool (``PagePoolBase.pin``); each pin's
record says which of three things it is (``PinKind``)::

    lease           RETAINED  a decode worker's finished turn, kept for the conversation's
                              next turn (``reuse.retention_ttl_s``, yields to live requests)
                    TRANSFER  a prefill worker's finished prompt, kept for the one pull of its
                              decode (``reuse.transfer_timeout_s``, single use)
    hold            HOLD      a peer's pin of a lease's pages for one READ (never reclaimed)
    admission pin   ADMISSION pages a pull READ, or found here, kept until their request is
                              admitted (yields last)

Only a lease is called a lease. The pool's pin table is the one table: what this module
knows of a pin is the pin's ``record`` (``LeaseRecord``, ``HoldRecord``, ``AdmissionRecord``),
so a released or expired pin takes its record with it and nothing is kept in sync by hand.

Lease and hold ids go over the wire (``kv_transfer_params.lease_id``, a hold's ``hold_id``)
and keep their form: ``kv-<generation>-<hex>``, ``xfer-<generation>-<hex>``, ``hold-<hex>``.
The kind of a pin here is its record's; ``parse_lease_id`` is the one reader of a peer's id.

Every function and ``LeaseStore`` method runs on the engine thread (it changes the pool).
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvserving.worker.kv.page_pool import RECLAIM_FIRST, RECLAIM_LAST, RECLAIM_NEVER, PagePoolBase, Pin

HOLD_MARGIN_S = 2.0  # a puller's hold outlives its READ deadline by this much


class PinKind(enum.Enum):
    """What a pin of the pool keeps pages for; the value is its id's prefix on the wire."""

    RETAINED = "kv-"
    TRANSFER = "xfer-"
    HOLD = "hold-"
    ADMISSION = "pull-"


class LeaseMismatchError(ValueError):
    """A hold named a lease whose pages are not the ones the puller was offered (HTTP 409)."""


def new_pin_id(kind: PinKind, *, generation: int | None = None) -> str:
    """A fresh id of ``kind``. A lease's names this process's ``generation``: a peer that
    restarted since is told apart even when its engine id is stable."""
    if kind in (PinKind.RETAINED, PinKind.TRANSFER):
        if generation is None:
            raise ValueError(f"a {kind.name} lease id names its generation")
        return f"{kind.value}{generation:x}-{uuid.uuid4().hex}"
    return f"{kind.value}{uuid.uuid4().hex}"


def parse_lease_id(lease_id: str) -> tuple[PinKind, int] | None:
    """The kind and sender generation a peer's lease id names (``kv-<gen>-<hex>`` or
    ``xfer-<gen>-<hex>``); None for any other id."""
    parts = lease_id.split("-")
    if len(parts) != 3:
        return None
    kind = {k.value: k for k in (PinKind.RETAINED, PinKind.TRANSFER)}.get(parts[0] + "-")
    try:
        return (kind, int(parts[1], 16)) if kind is not None else None
    except ValueError:
        return None


def prompt_digest(token_ids: Sequence[int]) -> str:
    """blake2b-128 of a prompt's token ids (what proves a later prompt starts with it)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16, person=b"kvserving.prompt").hexdigest()


def lease_digest(page_ids: Sequence[int], page_hashes: Sequence[int], num_tokens: int) -> str:
    """What a hold compares instead of shipping the page lists back: blake2b-128 over the
    lease's page ids, page hashes and token count (equal digests = equal lists)."""
    h = hashlib.blake2b(digest_size=16, person=b"kvserving.lease")
    h.update(struct.pack("<qq", len(page_ids), num_tokens))
    h.update(struct.pack(f"<{len(page_ids)}q", *page_ids))
    h.update(struct.pack(f"<{len(page_hashes)}q", *page_hashes))
    return h.hexdigest()


# --------------------------------------------------------------------------- records
@dataclass(slots=True)
class LeaseRecord:
    """What a lease's pin keeps beside its page ids."""

    kind: PinKind  # RETAINED or TRANSFER
    page_hashes: tuple[int, ...]
    num_tokens: int
    ttl_s: float  # what a renewal without a ttl extends it by
    conversation_key: str | None = None
    prompt: tuple[int, str] | None = None  # (length, ``prompt_digest``) of the prompt that made it
    digest: str | None = None  # ``lease_digest`` of its pages, computed at the first hold
    consumed: bool = False  # a single-use (TRANSFER) lease a READ hold took over (``LeaseStore.hold``)


@dataclass(slots=True, frozen=True)
class HoldRecord:
    lease_id: str  # the lease whose pages it holds
    kind: PinKind = PinKind.HOLD


@dataclass(slots=True, frozen=True)
class AdmissionRecord:
    pulled: frozenset[int]  # of the pin's pages, the ones READ for the request (the rest were here)
    kind: PinKind = PinKind.ADMISSION


# A pool's pages by holder where a pull finds no room (``Puller``; the simulator counts the same): the
# never-reclaimed pins split by kind (``never_pin_kind``)
NO_ROOM_HOLDERS = ("requests", "pins_transfer", "pins_pulling", "pins_retained", "pins_pulled")


def never_pin_kind(pin: Pin) -> str:
    """``PagePoolBase.page_holders``' name of a never-reclaimed pin: ``pins_pulling`` for the pages a
    pull in progress pinned (its request's local prefix), else ``pins_transfer`` (a prefill's transfer
    lease waiting for the decode's READ, and the peers' READ holds)."""
    return "pins_pulling" if isinstance(pin.record, AdmissionRecord) else "pins_transfer"


@dataclass(slots=True, frozen=True)
class RetainedKV:
    """A lease's pages: token order, chained hashes (``RequestOutput.retained``, listings)."""

    lease_id: str
    page_ids: tuple[int, ...]
    page_hashes: tuple[int, ...]
    num_tokens: int
    expires_at: float  # on the pool's clock (time.monotonic by default)
    conversation_key: str | None = None

    @classmethod
    def of(cls, pin: Pin) -> RetainedKV:
        rec = pin.record
        assert isinstance(rec, LeaseRecord)
        return cls(pin.pin_id, pin.page_ids, rec.page_hashes, rec.num_tokens, pin.expires_at, rec.conversation_key)


@dataclass(slots=True, frozen=True)
class RetainSpec:
    """Keep a request's full pages (prompt + generated) under lease ``lease_id`` for ``ttl_s``
    when it finishes (``retain``). ``prompt``: the request's prompt, which lets the lease
    replace its conversation's older one. ``reclaim``: whether and when the pool may release
    the lease early when pages run out (``page_pool.RECLAIM_*``)."""

    lease_id: str
    ttl_s: float
    conversation_key: str | None = None
    prompt: tuple[int, ...] = ()
    kind: PinKind = PinKind.RETAINED
    reclaim: int = RECLAIM_NEVER

    def __post_init__(self) -> None:
        if not self.lease_id:
            raise ValueError("lease_id must not be empty")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if self.kind not in (PinKind.RETAINED, PinKind.TRANSFER):
            raise ValueError(f"a lease is RETAINED or TRANSFER, got {self.kind}")


# --------------------------------------------------------------------------- the engine's side
def retain(pool: PagePoolBase, spec: RetainSpec, page_ids: list[int], page_hashes: list[int], page_size: int) -> RetainedKV | None:
    """Pin the leading full, published pages ``page_ids`` (with their ``page_hashes``) under
    ``spec``'s lease; call before the sequence frees its pages. None when no page is full.

    The lease replaces an older lease of the same conversation key only when this prompt
    continues the older one's. A conversation key is a name any caller can put in a
    request, so naming one proves nothing: the older lease goes only when this prompt
    starts with the whole prompt that made it (equal ``prompt_digest`` over that many
    tokens), i.e. the caller already had that conversation's history, as its own next turn
    does. Token ids, not page hashes: a triaxial page's hash also covers its precision,
    which a later turn's tags may change. Cost: one digest of the older prompt's length,
    only when a lease of the same key exists."""
    n = min(len(page_ids), len(page_hashes))
    if n == 0:
        return None
    key, prompt = spec.conversation_key, spec.prompt
    if key is not None and prompt:
        for pin in pool.pins():
            rec = pin.record
            if isinstance(rec, LeaseRecord) and rec.conversation_key == key and rec.prompt is not None:
                length, digest = rec.prompt
                if length <= len(prompt) and prompt_digest(prompt[:length]) == digest:
                    pool.release(pin.pin_id)
    record = LeaseRecord(
        spec.kind,
        tuple(page_hashes[:n]),
        n * page_size,
        spec.ttl_s,
        key,
        (len(prompt), prompt_digest(prompt)) if key is not None and prompt else None,
    )
    pool.pin(spec.lease_id, page_ids[:n], ttl_s=spec.ttl_s, reclaim=spec.reclaim, record=record)
    kept = pool.get_pin(spec.lease_id)
    assert kept is not None
    return RetainedKV.of(kept)


def pin_for_admission(
    pool: PagePoolBase, page_ids: Sequence[int], *, pulled: Sequence[int], ttl_s: float, reclaim: int = RECLAIM_LAST
) -> str:
    """Pin pages for a request not yet admitted (``pulled``: those READ for it); its id."""
    pin_id = new_pin_id(PinKind.ADMISSION)
    pool.pin(pin_id, page_ids, ttl_s=ttl_s, reclaim=reclaim, record=AdmissionRecord(frozenset(pulled)))
    return pin_id


def release_admission(pool: PagePoolBase, pin_id: str, held_page_ids: Sequence[int]) -> int:
    """Drop admission pin ``pin_id`` once its request holds its own refs; how many of the
    pulled pages the request took. A pin that expired or yielded whole counts 0; one trimmed
    (``PagePoolBase.trim_pin``) counts the pulled pages the request holds all the same."""
    pin = pool.get_pin(pin_id)
    if pin is None:
        return 0
    rec = pin.record
    assert isinstance(rec, AdmissionRecord), f"{pin_id!r} is not an admission pin"
    pool.release(pin_id)
    return sum(1 for pid in held_page_ids if pid in rec.pulled)


# --------------------------------------------------------------------------- the store
TRANSFER_ENDS = ("consumed", "released", "expired", "hold_released", "hold_expired")


class TransferLifetimes:
    """How a prefill worker's transfer leases ended and how long they held their pages: ``consumed``
    (a decode worker's READ hold took them over), ``released`` (let go unread), ``expired``; and the
    READ holds that took them over, ``hold_released`` (the reader let go) or ``hold_expired``. A
    consumed lease's pages stay pinned for its lifetime plus its hold's. Fed by the pool's
    ``on_release``; the seconds are on the pool's clock."""

    def __init__(self) -> None:
        self.ended = dict.fromkeys(TRANSFER_ENDS, 0)
        self.seconds = dict.fromkeys(TRANSFER_ENDS, 0.0)

    def __call__(self, pin: Pin, now: float) -> None:
        rec = pin.record
        expired = pin.expires_at <= now
        if isinstance(rec, HoldRecord):
            end = "hold_expired" if expired else "hold_released"
        elif isinstance(rec, LeaseRecord) and rec.kind is PinKind.TRANSFER:
            end = "consumed" if rec.consumed else "expired" if expired else "released"
        else:
            return
        self.ended[end] += 1
        self.seconds[end] += now - pin.created_at


class LeaseStore:
    """A worker's leases and the holds on them, over ``pool``'s pin table (engine thread only).

    ``role`` picks the kind a ``retain_spec`` makes (prefill: TRANSFER, else RETAINED);
    ``retention_ttl_s`` caps every renewal; ``max_hold_s`` caps every hold."""

    def __init__(
        self, pool: PagePoolBase, *, role: str, generation: int, transfer_ttl_s: float, retention_ttl_s: float, max_hold_s: float
    ) -> None:
        self.pool = pool
        self.role = role
        self.generation = generation
        self.transfer_ttl_s = transfer_ttl_s
        self.retention_ttl_s = retention_ttl_s
        self.max_hold_s = max_hold_s
        self.transfer_lifetimes = TransferLifetimes()
        if role == "prefill":
            pool.on_release = self.transfer_lifetimes

    def retain_spec(self, *, conversation_key: str | None = None, input_ids: Sequence[int] = ()) -> RetainSpec:
        """A new lease for a request's pages when it finishes. Pure: safe on any thread."""
        if self.role == "prefill":
            kind = PinKind.TRANSFER
            return RetainSpec(new_pin_id(kind, generation=self.generation), self.transfer_ttl_s, conversation_key, tuple(input_ids), kind)
        # a retained conversation yields its pages to live requests when the pool runs out
        kind = PinKind.RETAINED
        return RetainSpec(
            new_pin_id(kind, generation=self.generation),
            self.retention_ttl_s,
            conversation_key,
            tuple(input_ids),
            kind,
            reclaim=RECLAIM_FIRST,
        )

    def _lease(self, lease_id: str) -> tuple[Pin, LeaseRecord]:
        pin = self.pool.get_pin(lease_id)
        if pin is None or not isinstance(pin.record, LeaseRecord):
            raise KeyError(lease_id)
        return pin, pin.record

    def leases(self, conversation_key: str | None = None) -> list[RetainedKV]:
        """Every live lease, optionally of one conversation, oldest first."""
        self.pool.expire_pins()
        return [
            RetainedKV.of(pin)
            for pin in self.pool.pins()
            if isinstance(pin.record, LeaseRecord) and (conversation_key is None or pin.record.conversation_key == conversation_key)
        ]

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        """Extend a lease to ``ttl_s`` from now (default: its own TTL; at most ``retention_ttl_s``);
        the new expiry on the pool's clock. KeyError when unknown or expired."""
        if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
        self.pool.expire_pins()
        _, rec = self._lease(lease_id)
        return self.pool.renew(lease_id, ttl_s=min(ttl_s if ttl_s is not None else rec.ttl_s, self.retention_ttl_s))

    def hold(self, lease_id: str, *, digest: str, hold_s: float, consume: bool = False) -> tuple[str, float]:
        """Pin lease ``lease_id``'s pages for one READ by a peer: for ``hold_s`` (at most
        ``max_hold_s``), never reclaimed, whatever happens to the lease meanwhile; released by
        ``release(hold_id)`` or at expiry. Returns ``(hold_id, expires_at)``.

        ``digest`` must equal ``lease_digest`` of the lease's pages, hashes and tokens
        (LeaseMismatchError: the puller was offered other pages; NIXL reads any page of a
        registered region, so this is the check that it reads the lease's). ``consume``: a
        TRANSFER lease ends now, its pages held only by the hold (single use). KeyError
        when the lease is unknown."""
        if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not math.isfinite(hold_s) or hold_s <= 0:
            raise ValueError(f"hold_s must be a finite number > 0, got {hold_s!r}")
        self.pool.expire_pins()
        pin, rec = self._lease(lease_id)
        if rec.digest is None:
            rec.digest = lease_digest(pin.page_ids, rec.page_hashes, rec.num_tokens)
        if digest != rec.digest:
            raise LeaseMismatchError(f"lease {lease_id!r} holds other pages than the ones offered")
        hold_id = new_pin_id(PinKind.HOLD)
        expires = self.pool.pin(hold_id, pin.page_ids, ttl_s=min(float(hold_s), self.max_hold_s), record=HoldRecord(lease_id))
        if consume and rec.kind is PinKind.TRANSFER:
            rec.consumed = True
            self.pool.release(lease_id)
        return hold_id, expires

    def release(self, pin_id: str) -> None:
        """Drop a lease or a hold now (its pages go back to the prefix cache's LRU). KeyError
        when there is neither of that id."""
        self.pool.expire_pins()
        pin = self.pool.get_pin(pin_id)
        if pin is None or not isinstance(pin.record, (LeaseRecord, HoldRecord)):
            raise KeyError(pin_id)
        self.pool.release(pin_id)

    def totals(self) -> tuple[int, int]:
        """(leases, tokens they hold)."""
        leases = self.leases()
        return len(leases), sum(le.num_tokens for le in leases)

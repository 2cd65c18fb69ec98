"""Engine-side KV leases: what a finished request keeps (retain) and the short pin
that holds pulled pages until their request is admitted. Pure Python, no torch.

The pool (``page_pool``) owns pins, expiry and LRU; this module decides which
pages a sequence hands to a lease and reports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserving.worker.kv.page_pool import RECLAIM_NEVER, PagePoolBase


@dataclass(slots=True, frozen=True)
class RetainedKV:
    """The full pages a lease holds after a request finished: token order, chained hashes."""

    lease_id: str
    page_ids: tuple[int, ...]
    page_hashes: tuple[int, ...]
    num_tokens: int
    expires_at: float  # on the pool's clock (time.monotonic by default)
    conversation_key: str | None = None


@dataclass(slots=True, frozen=True)
class RetainSpec:
    """Keep a request's full pages (prompt + generated) under ``lease_id`` for ``ttl_s`` when it finishes.

    ``on_retained`` runs on the engine thread right after the pin (inside ``step``).
    ``reclaim``: whether and when the pool may release the lease early when
    pages run out (``page_pool.RECLAIM_*``, ``PagePoolBase.reclaim_one``).
    """

    lease_id: str
    ttl_s: float
    conversation_key: str | None = None
    on_retained: Callable[[RetainedKV], None] | None = None
    reclaim: int = RECLAIM_NEVER

    def __post_init__(self) -> None:
        if not self.lease_id:
            raise ValueError("lease_id must not be empty")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")


def retain_pages(
    pool: PagePoolBase, spec: RetainSpec, page_ids: list[int], page_hashes: list[int], page_size: int
) -> RetainedKV | None:
    """Pin the leading full, published pages ``page_ids`` (with their ``page_hashes``) under ``spec``.

    Call before the sequence frees its pages. None when no page is full (nothing to keep).
    """
    n = min(len(page_ids), len(page_hashes))
    if n == 0:
        return None
    pids = tuple(page_ids[:n])
    expires_at = pool.pin(spec.lease_id, pids, ttl_s=spec.ttl_s, reclaim=spec.reclaim)
    kept = RetainedKV(spec.lease_id, pids, tuple(page_hashes[:n]), n * page_size, expires_at, spec.conversation_key)
    if spec.on_retained is not None:
        spec.on_retained(kept)
    return kept


def release_pin(pool: PagePoolBase, lease_id: str, held_page_ids: list[int]) -> int:
    """Drop the pull pin ``lease_id`` (and ``lease_id + ".local"``, the pin on the local prefix
    it extends) once its request holds its own refs; returns how many of the pulled pages the
    request took. An expired pin counts 0."""
    live = set(pool.lease_ids())
    used = 0
    if lease_id in live:
        pinned = set(pool.lease_pages(lease_id))
        used = sum(1 for pid in held_page_ids if pid in pinned)
        pool.release(lease_id)
    if lease_id + ".local" in live:
        pool.release(lease_id + ".local")
    return used

"""A snapshot of an engine's KV pool, leases and queue: what `/internal/kv/stats`
returns and what the worker's gauges are set from.

``collect`` reads engine state, so it runs on the engine thread
(``AsyncEngine.call``); the snapshot it returns is plain data.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from kvserving.kernels.page_ids import page_id_bits
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.cache import KVCache
from kvserving.worker.precision import stored_bits

# Bits of one stored value of each one-precision format, scales left out (nvfp4: E2M1 + a shared fp8 scale
# per 16 values is 4.5 with metadata).
FORMAT_BITS = {"bf16": 16.0, "fp8_e4m3": 8.0, "nvfp4": 4.0}


@dataclass(slots=True, frozen=True)
class PrecisionStats:
    """Pages of one stored precision: how many fit the whole pool, how many are in use."""

    capacity_pages: int  # pages of this precision the pool holds if every page had it
    capacity_tokens: int
    owned_pages: int  # held by running requests or leases
    cached_pages: int  # unowned, kept for their prefix hash (evictable)


@dataclass(slots=True, frozen=True)
class KVStats:
    dtype: str
    page_size: int
    usage_ratio: float  # owned fraction of the pool's bytes
    free_pages: int  # pages an allocation can get now (free + evictable)
    precisions: dict[str, PrecisionStats]
    num_leases: int
    leased_pages: int
    leased_tokens: int
    running: int
    waiting: int
    steps: int
    prompt_tokens_computed: int
    decode_tokens: int
    preemptions: int
    admission_pins_gone: int  # requests admitted after their pulled pages' pin expired or yielded, since start
    step_counts: dict[str, int]  # engine steps by kind ("decode", "mixed"), since start
    step_seconds: dict[str, float]  # their wall time
    evicted_pages: int  # cached pages evicted to make room, since start
    reclaimed_leases: int  # reclaimable pins released before expiry to make room, since start
    admission_pages_trimmed: int  # pages admission pins gave up from their tails to make room, since start
    capacity_tokens: int  # triaxial: at the expected INT2 share (KVCache.capacity_tokens)
    aged_pages: int = 0  # triaxial: 4-bit pages re-stored at 2 bits (age-down), since start
    age_down_skipped_pages: int = 0  # triaxial: matched pages wanted at 2 bits, kept at 4 for want of INT2 room, since start
    # admissions placed with fewer cached pages than they matched (Scheduler._admit), since start: those placed
    # from scratch, and the cached tokens all of them gave up (computed again)
    admissions_from_scratch: int = 0
    admission_dropped_tokens: int = 0
    # Average bits per KV value over the pages held now (owned and cached, each page whole):
    # nominal (2 / 4) and with the fp16 scales and zeros (the page's bytes over its values).
    # None while the pool holds no page.
    stored_bits: float | None = None
    stored_bits_with_metadata: float | None = None
    owned_stored_bits: float | None = None  # the same over owned pages only: what the controller holds
    bit_budget: float | None = None  # triaxial: the budget the pool is held to; None for a fixed table or format
    bits_cut: float | None = None  # triaxial with bit_budget_control "hold": the controller's cut (BitBudgetController)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def collect(engine: LLMEngine) -> KVStats:
    """Snapshot ``engine`` (call on the engine thread). Expired leases are released first."""
    pool = engine.pool
    pool.expire_pins()
    page_size = engine.storage.page_size
    live = [p for pid in _live_ids(engine) if (p := pool.page(pid)) is not None]
    leased = {pid for lid in pool.pin_ids() for pid in pool.pin_pages(lid)}
    precisions: dict[str, PrecisionStats] = {}
    kv = engine.kv_cache
    used_bytes = 0
    for bits, page_bytes in sorted(kv.page_bytes.items(), reverse=True):
        # one precision: named after the dtype; triaxial: "int4" and "int2"
        name = kv.dtype if len(kv.page_bytes) == 1 else f"int{bits}"
        pages = [p for p in live if page_id_bits(p.page_id) == bits]
        cap = kv.num_pages[bits]
        owned = sum(1 for p in pages if p.ref_count > 0)
        used_bytes += owned * page_bytes
        precisions[name] = PrecisionStats(cap, cap * page_size, owned, len(pages) - owned)
    usage = used_bytes / kv.storage.total_bytes
    held = {bits: sum(1 for p in live if page_id_bits(p.page_id) == bits) for bits in kv.page_bytes}
    owned_by_bits = {bits: sum(1 for p in live if page_id_bits(p.page_id) == bits and p.ref_count > 0) for bits in kv.page_bytes}
    # nominal bits of a value: triaxial's page precisions, else the format's element
    nominal = {bits: float(bits) for bits in kv.page_bytes} if len(kv.page_bytes) > 1 else {4: FORMAT_BITS[kv.dtype]}
    control = kv.manager.controller
    sched = engine.scheduler
    stats = engine.stats
    return KVStats(
        dtype=engine.storage.kv_dtype,
        page_size=page_size,
        usage_ratio=usage,
        free_pages=pool.num_free,
        precisions=precisions,
        num_leases=len(pool.pin_ids()),
        leased_pages=len(leased),
        leased_tokens=len(leased) * page_size,
        running=len(sched.running),
        waiting=len(sched.waiting),
        steps=stats.steps,
        prompt_tokens_computed=stats.prompt_tokens_computed,
        decode_tokens=stats.decode_tokens,
        preemptions=stats.preemptions,
        admission_pins_gone=stats.admission_pins_gone,
        step_counts=dict(stats.step_counts),
        step_seconds=dict(stats.step_seconds),
        evicted_pages=pool.evicted_pages,
        reclaimed_leases=pool.reclaimed_pins,
        admission_pages_trimmed=pool.trimmed_pages,
        capacity_tokens=engine.capacity_tokens,
        aged_pages=engine.kv.aged_pages,
        age_down_skipped_pages=engine.kv.age_down_skipped_pages,
        admissions_from_scratch=sched.from_scratch_admissions,
        admission_dropped_tokens=sched.dropped_cached_tokens,
        stored_bits=stored_bits(held, nominal),
        stored_bits_with_metadata=stored_bits(held, kv.bits_per_value),
        owned_stored_bits=stored_bits(owned_by_bits, nominal),
        bit_budget=kv.bit_budget,
        bits_cut=control.cut if control is not None else None,
    )


def page_ids_stored_bits(kv: KVCache, page_ids: Iterable[int]) -> tuple[float | None, float | None]:
    """(nominal, with metadata) bits per value over ``page_ids`` of ``kv`` (each page whole; None, None
    for no page): what a bench reports beside a row, e.g. over every page its sequences hold."""
    counts: dict[int, int] = dict.fromkeys(kv.page_bytes, 0)
    for pid in page_ids:
        counts[page_id_bits(pid)] += 1
    nominal = {bits: float(bits) for bits in kv.page_bytes} if len(kv.page_bytes) > 1 else {4: FORMAT_BITS[kv.dtype]}
    return stored_bits(counts, nominal), stored_bits(counts, kv.bits_per_value)


def _live_ids(engine: LLMEngine) -> list[int]:
    return engine.pool.live_page_ids()

"""The engine's KV cache, assembled in one place: storage (bytes), pool (page
ids) and manager (sequences -> pages), and the numbers a server reports.

``build_kv_cache`` is the only code that knows how the three fit together.
The storage says whether the format has INT2 pages (triaxial); only here does
that choose a pool and a bits table, and everything above asks the pool
(``pool.precisions``, ``pool.allocate(page_bits)``) instead.

Pages for KV transfer: ``import_pages`` and ``register`` receive pulled KV;
what keeps pages past their request (leases, holds, admission pins: pins of
the pool) is ``kv/leases.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvserving import agent_pages_data
from kvserving.bits import bits_table_for_budget, default_sensitivity, default_stored_bits, format_bits_table, greedy_order
from kvserving.calibration import Calibration
from kvserving.config import KVCacheConfig
from kvserving.tags import NUM_TAGS, validate_bits_table
from kvserving.worker.bit_budget import BitBudgetController, cut_for, rank_of
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.kv.page_pool import PagePool, PagePoolBase
from kvserving.worker.kv.storage import KVShape, KVStorage
from kvserving.worker.triaxial_pool import TriaxialPagePool

# KV budget on a machine without a GPU when the config names no byte count.
DEFAULT_CPU_KV_BYTES = 256 * 2**20


class KVCache:
    """Storage + pool + manager of one engine (build it with ``build_kv_cache``)."""

    def __init__(
        self,
        storage: KVStorage,
        pool: PagePoolBase,
        manager: KVCacheManager,
        *,
        bit_budget: float | None,
        table_source: str = "default",
        scales_source: str = "static",
        stored_bits: float | None = None,
    ) -> None:
        self.storage = storage
        self.pool = pool
        self.manager = manager
        # The budget the bits table was derived from; None for an explicit table or a one-precision format.
        self.bit_budget = bit_budget
        # Where the bits table came from: "default" (kvserving.bits), "calibrated" (kv_cache.calibration), "explicit".
        self.table_source = table_source
        # Where the fp8/nvfp4 global scales came from: "static" (1.0) or "calibration" (the file's).
        self.scales_source = scales_source
        # Average bits per token the bits table is expected to store (pages counted as the
        # pool stores them); None: ``default_stored_bits`` of the table (agent pages).
        table = manager.bits_table
        if stored_bits is None:
            stored_bits = 4.0 if table is None else default_stored_bits(table)
        self._stored_bits = stored_bits

    # -- shape and capacity ---------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return self.storage.kv_dtype

    @property
    def page_size(self) -> int:
        return self.storage.page_size

    @property
    def bits_table(self) -> tuple[int, ...] | None:
        """Tag -> bits; None when every page is 4-bit (formats without INT2 pages)."""
        return self.manager.bits_table

    @property
    def page_bytes(self) -> dict[int, int]:
        """Bytes of one page in one layer, by precision (4: the format's only or INT4 pages)."""
        out = {4: self.storage.layout.page_bytes}
        if self.storage.int2_layout is not None:
            out[2] = self.storage.int2_layout.page_bytes
        return out

    @property
    def bits_per_value(self) -> dict[int, float]:
        """Bits one KV value costs in a page of each precision, scales and zeros included
        (the page's bytes over its values: 5 for triaxial INT4, 3 for INT2; 16 for bf16)."""
        out = {}
        for bits, layout in ((4, self.storage.layout), (2, self.storage.int2_layout)):
            if layout is not None:
                out[bits] = 8.0 * layout.page_bytes / (2 * layout.page_size * layout.kv_heads * layout.head_dim)
        return out

    @property
    def controller(self) -> BitBudgetController | None:
        """The bit-budget controller (triaxial, ``bit_budget_control: hold``), else None."""
        return self.manager.controller

    @property
    def num_pages(self) -> dict[int, int]:
        """Pages the buffer holds when all of them are at one precision, by precision."""
        return {bits: self.storage.total_bytes // size for bits, size in self.page_bytes.items()}

    @property
    def stored_bits(self) -> float:
        """Average bits per token the cache is expected to store: what the bits table stores
        on the calibration file's pages, or on the agent pages of ``kvserving.bits`` (a page
        is INT2 only when all of its tokens are 2-bit); 4 for formats without INT2 pages."""
        return self._stored_bits

    @property
    def int2_share(self) -> float:
        """Expected share of INT2 pages (from ``stored_bits``); 0 for formats without INT2 pages."""
        return (4.0 - self.stored_bits) / 2.0

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache holds at the expected INT2 share."""
        return self.pool.capacity_tokens(self.int2_share)

    def capacity_tokens_at(self, frac_int2: float) -> int:
        """Tokens the cache holds when ``frac_int2`` of the pages are INT2 (0: all 4-bit)."""
        return self.pool.capacity_tokens(frac_int2)

    def describe(self) -> str:
        """One line for the log: format, pages, capacity and the bits table."""
        sizes = ", ".join(f"INT{b} {n} B" for b, n in sorted(self.page_bytes.items(), reverse=True))
        if len(self.page_bytes) == 1:
            sizes = f"{self.page_bytes[4]} B"
        line = (
            f"kv cache {self.dtype}: page {self.page_size} tokens, {self.storage.shape.num_layers} layers x "
            f"{self.storage.total_bytes} B ({sizes} per page per layer), "
            f"capacity {self.capacity_tokens} tokens"
        )
        if self.scales_source != "static":
            line += f"; global scales from {self.scales_source}"
        table = self.bits_table
        if table is None:
            return line
        source = f"{self.table_source} table for bit budget {self.bit_budget:g}" if self.bit_budget is not None else "explicit table"
        return (
            f"{line} at INT2 share {self.int2_share:.2f} ({self.capacity_tokens_at(0.0)} all-INT4); "
            f"{source} -> {self.stored_bits:.2f} stored bits; bits table: {format_bits_table(table)}"
        )

    # -- pages for KV transfer ------------------------------------------------------------
    def import_pages(self, page_bits: Seq[int]) -> list[int] | None:
        """Pages to receive pulled KV: one per entry of ``page_bits``, ref 1 each, all or
        nothing. Fill them, then ``register`` their hashes and ``free`` them (they stay
        cached), or ``free`` them unregistered on a failed transfer (they go back free)."""
        return self.pool.allocate(page_bits)

    def register(self, page_ids: Seq[int], page_hashes: Seq[int]) -> None:
        """Publish owned, filled pages to the prefix cache under their chained hashes."""
        if len(page_ids) != len(page_hashes):
            raise ValueError(f"page_hashes has {len(page_hashes)} entries for {len(page_ids)} pages")
        for pid, h in zip(page_ids, page_hashes):
            self.pool.register(pid, h)

    def free(self, page_ids: Seq[int]) -> None:
        """Drop one ref per page (see ``PagePoolBase.free``)."""
        self.pool.free(page_ids)


def kv_budget_bytes(kv_config: KVCacheConfig, *, device: torch.device, reserved_bytes: int = 0) -> int:
    """Bytes for the KV pool: ``memory_bytes`` if set, else ``memory_fraction`` of the GPU's
    free memory minus ``reserved_bytes`` (what is allocated after the pool), else of
    ``DEFAULT_CPU_KV_BYTES`` on a machine without a GPU."""
    if kv_config.memory_bytes is not None:
        return kv_config.memory_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * kv_config.memory_fraction) - reserved_bytes
    return int(DEFAULT_CPU_KV_BYTES * kv_config.memory_fraction)


def build_kv_cache(
    kv_config: KVCacheConfig,
    model_shape: KVShape,
    *,
    budget_bytes: int,
    device: torch.device | str,
    model_dtype: torch.dtype,
    bits_table: Seq[int] | None = None,
) -> KVCache:
    """Storage, pool and manager for ``kv_config`` in ``budget_bytes``.

    Triaxial: ``bits_table`` if given, else the table for ``kv_config.effective_bit_budget``
    from ``kv_config.calibration`` when set, else the one ``kvserving.bits`` derives.
    Other formats have one precision and refuse a table; fp8/nvfp4 with
    ``global_scale: calibrated`` take the calibration file's per-layer scales when it has them.
    """
    page_size = kv_config.effective_page_size
    storage = KVStorage(
        kv_config.dtype,
        model_shape,
        page_size=page_size,
        budget_bytes=budget_bytes,
        device=device,
        model_dtype=model_dtype,
        page_major=kv_config.layout == "page_major",
    )
    calibration = Calibration.load(kv_config.calibration) if kv_config.calibration else None
    if calibration is not None and (calibration.num_layers, calibration.num_kv_heads, calibration.head_dim) != (
        model_shape.num_layers,
        model_shape.num_kv_heads,
        model_shape.head_dim,
    ):
        raise ValueError(
            f"calibration {kv_config.calibration} is for {calibration.num_layers} layers x {calibration.num_kv_heads} "
            f"KV heads x {calibration.head_dim}, the model has {model_shape.num_layers} x {model_shape.num_kv_heads} x "
            f"{model_shape.head_dim}"
        )
    if storage.int2_layout is None:
        if bits_table is not None:
            raise ValueError(f"bits_table is only used by kv_cache.dtype 'triaxial', got {kv_config.dtype!r}")
        scales_source = "static"
        scales = calibration.scales_for(kv_config.dtype, model_shape.num_layers) if calibration is not None else None
        if scales is not None and kv_config.global_scale == "calibrated":
            storage.k_scales, storage.v_scales = list(scales.k), list(scales.v)
            scales_source = f"calibration {kv_config.calibration} ({scales.method})"
        pool: PagePoolBase = PagePool(storage.num_pages, page_size=page_size)
        return KVCache(storage, pool, KVCacheManager(pool, page_size=page_size), bit_budget=None, scales_source=scales_source)
    budget = None
    source = "explicit"
    stored: float | None = None
    if bits_table is not None:
        table = validate_bits_table(list(bits_table))
    else:
        budget = kv_config.effective_bit_budget
        assert budget is not None  # set for triaxial
        if calibration is not None:
            table, how = calibration.table_for_budget(budget)
            source = f"calibrated ({how}, {kv_config.calibration})"
            stored = calibration.stored_bits(table) if calibration.pages else None
        else:
            table, source = bits_table_for_budget(budget), "default"
    controller = None
    if kv_config.bit_budget_control == "hold" and budget is not None:
        controller = budget_controller(budget, calibration, page_size=page_size)
    pool = TriaxialPagePool(
        storage.total_bytes,
        int4_page_bytes=storage.layout.page_bytes,
        int2_page_bytes=storage.int2_layout.page_bytes,
        page_size=page_size,
    )
    manager = KVCacheManager(
        pool,
        page_size=page_size,
        bits_table=table,
        requantize=storage.requantize_to_int2 if kv_config.age_down else None,
    )
    manager.controller = controller
    return KVCache(
        storage,
        pool,
        manager,
        bit_budget=budget,
        table_source=source,
        # held: the pool averages the budget whatever the traffic
        stored_bits=float(budget) if controller is not None and budget is not None else stored,
    )


def budget_controller(budget: float, calibration: Calibration | None, *, page_size: int) -> BitBudgetController:
    """The controller for ``budget``: the greedy order of the calibration's priorities (on its
    pages when it has them) or of the default sensitivities on the agent pages, starting at
    the cut that averages ``budget`` on those pages."""
    d = agent_pages_data
    gain = calibration.priorities() if calibration is not None else default_sensitivity()
    pages, residual = (calibration.pages, calibration.residual) if calibration is not None and calibration.pages else (d.PAGES, d.RESIDUAL)
    order = greedy_order(gain, pages, page_size=page_size)
    rank = rank_of(order)
    hist = [0.0] * NUM_TAGS
    for n, mix in pages:
        hist[min(rank[c] for c, _ in mix)] += n
    cut = cut_for(hist, residual / page_size, budget)
    return BitBudgetController(budget, order, cut=cut, page_size=page_size)

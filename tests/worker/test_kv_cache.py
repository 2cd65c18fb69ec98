"""build_kv_cache: one object with storage, pool and manager; the bits table and
the capacity follow the bit budget; imported pages join the prefix cache."""

from __future__ import annotations

import pytest
import torch

from kvserving.bits import bits_table_for_budget, default_stored_bits
from kvserving.config import KVCacheConfig
from kvserving.kernels.page_ids import INT2_PAGE_FLAG as F
from kvserving.tags import NUM_TAGS
from kvserving.worker.kv.cache import DEFAULT_CPU_KV_BYTES, KVCache, build_kv_cache, kv_budget_bytes
from kvserving.worker.kv.storage import KVShape
from kvserving.worker.kv.page_pool import PagePool
from kvserving.worker.triaxial_pool import TriaxialPagePool

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=64)
MIB = 1 << 20


def build(dtype: str = "triaxial", *, budget: float | None = None, table: list[int] | None = None, control: str = "fixed") -> KVCache:
    """A pool with the bits table fixed (``control``: kv_cache.bit_budget_control)."""
    return build_kv_cache(
        KVCacheConfig(dtype=dtype, bit_budget=budget, bit_budget_control=control),
        SHAPE,
        budget_bytes=MIB,
        device="cpu",
        model_dtype=torch.float32,
        bits_table=table,
    )


def test_plain_formats_get_a_one_precision_pool() -> None:
    kv = build("nvfp4")
    assert isinstance(kv.pool, PagePool) and kv.pool.precisions == (4,)
    assert kv.manager.pool is kv.pool and kv.bits_table is None
    # nvfp4, 16 tokens x 2 heads x 64 dims: K and V data 2 x 1024 B + scales 2 x 128 B
    assert kv.page_bytes == {4: 2304}
    assert kv.num_pages == {4: (MIB // 2) // 2304} == {4: 227}
    assert kv.capacity_tokens == 227 * 16 == kv.capacity_tokens_at(0.0)
    assert kv.describe() == ("kv cache nvfp4: page 16 tokens, 2 layers x 523008 B (2304 B per page per layer), capacity 3632 tokens")
    with pytest.raises(ValueError, match="bits_table is only used by kv_cache.dtype 'triaxial', got 'nvfp4'"):
        build("nvfp4", table=[4] * NUM_TAGS)


def test_triaxial_table_and_capacity_follow_the_budget() -> None:
    low, high = build(budget=2.5), build(budget=3.5)
    assert isinstance(low.pool, TriaxialPagePool) and low.pool.precisions == (2, 4)
    assert low.bits_table == bits_table_for_budget(2.5) and high.bits_table == bits_table_for_budget(3.5)
    assert low.bits_table != high.bits_table
    assert low.page_bytes == {4: 5120, 2: 3072}
    assert low.num_pages == {4: 102, 2: 170}  # 512 KiB per layer
    # expected INT2 share = (4 - stored bits) / 2, the stored bits counted in pages on the agent pages
    assert low.stored_bits == pytest.approx(default_stored_bits(low.bits_table)) == pytest.approx(2.496, abs=5e-4)
    assert low.int2_share == pytest.approx((4 - low.stored_bits) / 2)
    assert high.int2_share == pytest.approx((4 - 3.462) / 2, abs=5e-4)
    # whole slabs per precision: 83 INT4 pages (28 slabs) + 30 INT2 (6) at 3.5 bits
    assert (low.capacity_tokens, high.capacity_tokens, low.capacity_tokens_at(0.0)) == (4672, 3616, 3264)
    assert low.capacity_tokens == low.pool.capacity_tokens(low.int2_share)
    assert build().bits_table == bits_table_for_budget(2.7)  # the config's default budget
    assert "bit budget 2.5 -> 2.50 stored bits; bits table: current text IU..C.. image .......;" in low.describe()


def test_an_explicit_table_overrides_the_budget() -> None:
    table = [4] * NUM_TAGS
    kv = build(budget=2.5, table=table)
    assert kv.bits_table == tuple(table) and kv.bit_budget is None
    assert kv.int2_share == 0.0 and kv.capacity_tokens == 3264
    assert "explicit table -> 4.00 stored bits" in kv.describe()
    with pytest.raises(ValueError, match="56 entries"):
        build(table=[4])


def test_imported_pages_join_the_prefix_cache() -> None:
    kv = build(budget=2.5)
    ids = kv.import_pages([2, 4, 2])
    assert ids == [F | 0, 0, F | 1]
    kv.register(ids, [11, 12, 13])
    kv.free(ids)
    assert [kv.pool.lookup(h) for h in (11, 12, 13)] == ids
    assert kv.pool.num_owned == 0 and sorted(kv.pool.cached_page_ids()) == sorted(ids)
    # a failed transfer: unregistered pages go straight back to the free list
    again = kv.import_pages([4])
    assert again == [1]
    kv.free(again)
    assert kv.pool.ref_count(1) == 0 and kv.pool.page(1) is None
    with pytest.raises(ValueError, match="page_hashes has 1 entries for 2 pages"):
        kv.register([0, 1], [5])
    # all or nothing: more INT4 pages than the buffer holds
    assert kv.import_pages([4] * 103) is None


def test_budget_bytes_come_from_the_config_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert kv_budget_bytes(KVCacheConfig(memory_bytes=12345), device=cpu) == 12345
    assert kv_budget_bytes(KVCacheConfig(memory_fraction=0.5), device=cpu) == DEFAULT_CPU_KV_BYTES // 2


def test_stored_bits_count_the_pages_held_with_and_without_metadata() -> None:
    from kvserving.worker.precision import stored_bits

    kv = build(budget=2.7)
    # G = 32: an fp16 scale and zero per 32 values add 1 bit (INT2 keys: per channel over the page's 32 tokens)
    assert kv.bits_per_value == {4: 5.0, 2: 3.0}
    assert build("bf16").bits_per_value == {4: 32.0}  # model_dtype float32: bf16 pages hold float32 on CPU
    ids = kv.pool.allocate([4, 4, 4, 2])
    assert ids is not None
    held = {b: kv.pool.held_pages(bits=b) for b in (2, 4)}
    assert held == {4: 3, 2: 1}
    assert stored_bits(held, {2: 2.0, 4: 4.0}) == 3.5
    assert stored_bits(held, kv.bits_per_value) == 4.5
    assert stored_bits({2: 0, 4: 0}, kv.bits_per_value) is None
    assert kv.manager.held_bits() == 3.5


def test_hold_control_starts_at_the_cut_that_averages_the_budget_on_the_agent_pages() -> None:
    from kvserving import agent_pages_data as d
    from kvserving.bits import pages_stored_bits

    for budget in (2.5, 2.7, 3.0):
        kv = build_kv_cache(
            KVCacheConfig(dtype="triaxial", bit_budget=budget, bit_budget_control="hold"),
            SHAPE,
            budget_bytes=MIB,
            device="cpu",
            model_dtype=torch.float32,
        )
        c = kv.controller
        assert c is not None and c.budget == budget and kv.stored_bits == budget
        # the whole classes above the cut store at most the budget on the agent pages
        assert pages_stored_bits(c.table(), d.PAGES, page_size=32, residual=d.RESIDUAL) <= budget + 1e-9
    assert build(budget=2.7).controller is None  # "fixed": the table, no controller
    assert KVCacheConfig(dtype="triaxial").bit_budget_control == "hold"  # the default: the budget is what is stored
    assert (
        build_kv_cache(KVCacheConfig(dtype="triaxial"), SHAPE, budget_bytes=MIB, device="cpu", model_dtype=torch.float32).controller
        is not None
    )
    # an explicit table is no budget: nothing to hold
    assert build(table=[4] * NUM_TAGS, control="hold").controller is None
    assert build(budget=2.7, control="hold").controller is not None

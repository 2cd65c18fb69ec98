"""The Gluon decode's split planners (triton_common.plan_waves, resident_programs, pick_plan): pure functions.

Exact split counts on given occupancy, at the benchmark's shapes on an H200's 132 SMs (32 query / 8 kv heads:
batch_heads = batch x 8; 16-token pages, 32 for triaxial; 4 pages a step), and the residency arithmetic of one
sm_90 SM; and the benchmark's forced plans (bench/decode_gpu.py forced_plan).
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from bench_module import load_bench
import torch

from kvserving.kernels import gluon_decode, triton_common
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.triton_common import (
    WAVE_MAX_SPLITS,
    busiest_sm_cost,
    pick_plan,
    plan_waves,
    resident_programs,
    wave_cost,
)

SMS = 132  # H200


def test_resident_programs_take_the_least_of_registers_shared_memory_warps_and_slots() -> None:
    # nvfp4: 123 registers -> 4096 a warp (units of 256) -> 16 warps = 8 programs of 2; 18 KB of ring allows 11
    assert resident_programs(regs=123, warps=2, shared=18432) == 8
    # fp8: 8 by registers, but 32 KB + 1 KB reserved a program: 6 in 228 KB
    assert resident_programs(regs=126, warps=2, shared=32768) == 6
    # triaxial: 163 registers -> 5376 a warp -> 12 warps = 3 programs of 4
    assert resident_programs(regs=163, warps=4, shared=40960) == 3
    # 16 heads per kv head, uncapped: 196 -> 10 warps (5 programs), 229 -> 8 warps (2 programs of 4)
    assert resident_programs(regs=196, warps=2, shared=18432) == 5
    assert resident_programs(regs=229, warps=4, shared=40960) == 2
    # few registers: 64 warps, then 32 programs, bound
    assert resident_programs(regs=32, warps=4, shared=0) == 16
    assert resident_programs(regs=16, warps=1, shared=0) == 32


def test_gl_tuning_residency_matches_the_arithmetic_of_the_compiled_resources() -> None:
    # the registers and shared memory of the compiled kernels (triton 3.6 offline, triaxial with LEAN; the compile test in
    # test_gluon_decode.py checks the pinned Triton, the gpu test the device's)
    compiled = {"nvfp4": ((123, 18432), (196, 18432)), "int4": ((128, 40960), (202, 40960)),
                "fp8_e4m3": ((126, 32768), (200, 32768))}  # fmt: skip
    for fmt, ((r8, s8), (r16, s16)) in compiled.items():
        cfg = gluon_decode.GL_TUNING[fmt]
        assert cfg["RES"] == resident_programs(regs=r8, warps=cfg["num_warps"], shared=s8), fmt
        assert cfg["RES16"] == resident_programs(regs=r16, warps=cfg["num_warps"], shared=s16), fmt


def test_wave_planner_ends_the_grid_on_a_whole_wave_of_each_formats_residents() -> None:
    # 64 x 4K (512 sequence-heads, 256 pages). nvfp4, 8 per SM: 2 splits = 1024 programs, 0.97 of a wave (the
    # min-length planner's 3 splits are 1.45 waves: slower)
    assert plan_waves(512, 256, 4, SMS, resident=8, warps=2, triaxial=False) == (2, 128)
    # fp8, 6 per SM: 1024 programs would be 1.29 waves; 3 splits = 1536, 1.94 waves (2 splits are slower)
    assert plan_waves(512, 256, 4, SMS, resident=6, warps=2, triaxial=False) == (3, 88)
    # triaxial (128 pages of 32 tokens, 3 per SM): 2 splits + the INT2 / INT4 boundary's one, 3.9 waves
    assert plan_waves(512, 128, 4, SMS, resident=3, warps=4, triaxial=True) == (3, 64)
    # 32 x 32K: one wave of long splits for nvfp4 and fp8; triaxial's uneven INT2 / INT4 splits stay short
    assert plan_waves(256, 2048, 4, SMS, resident=8, warps=2, triaxial=False) == (4, 512)
    assert plan_waves(256, 2048, 4, SMS, resident=6, warps=2, triaxial=False) == (3, 684)
    assert plan_waves(256, 1024, 4, SMS, resident=3, warps=4, triaxial=True) == (17, 64)
    # 4 x 128K
    assert plan_waves(32, 8192, 4, SMS, resident=8, warps=2, triaxial=False) == (33, 252)
    assert plan_waves(32, 8192, 4, SMS, resident=6, warps=2, triaxial=False) == (24, 344)
    assert plan_waves(32, 4096, 4, SMS, resident=3, warps=4, triaxial=True) == (37, 116)
    # 1 x 128K: nvfp4 912 programs (0.86 of a wave; the min-length planner's: 688, 0.65), fp8 784 (0.99), triaxial 384
    assert plan_waves(8, 8192, 4, SMS, resident=8, warps=2, triaxial=False) == (114, 72)
    assert plan_waves(8, 8192, 4, SMS, resident=6, warps=2, triaxial=False) == (98, 84)
    assert plan_waves(8, 4096, 4, SMS, resident=3, warps=4, triaxial=True) == (48, 88)


def test_wave_planner_keeps_small_grids_at_two_steps_a_split_or_more() -> None:
    # 1 x 4K: 32 splits of 8 pages (2 steps; 64 splits of 1 step are slower)
    assert plan_waves(8, 256, 4, SMS, resident=8, warps=2, triaxial=False) == (32, 8)
    # 1 x 8K: still 32 splits, now of 16 pages (the best of 16 / 32 / 64)
    assert plan_waves(8, 512, 4, SMS, resident=8, warps=2, triaxial=False) == (32, 16)
    # 4 x 4K: 16 splits of 16 pages (faster than 8 of 32)
    assert plan_waves(32, 256, 4, SMS, resident=8, warps=2, triaxial=False) == (16, 16)
    # a sequence shorter than a step: one split
    assert plan_waves(8, 3, 4, SMS, resident=8, warps=2, triaxial=False) == (1, 4)
    assert plan_waves(8, 3, 4, SMS, resident=3, warps=4, triaxial=True) == (2, 4)


@pytest.mark.parametrize("triaxial", [False, True])
def test_wave_planner_covers_every_page_within_the_one_step_merge(triaxial: bool) -> None:
    for bh, pages, ppi, res, warps in [(1, 1, 4, 8, 2), (7, 333, 4, 3, 4), (64, 100, 8, 6, 2), (3, 10_000, 4, 8, 2),
                                       (8, 8192, 4, 3, 4), (2048, 64, 4, 8, 2)]:  # fmt: skip
        s, pps = plan_waves(bh, pages, ppi, SMS, resident=res, warps=warps, triaxial=triaxial)
        plain = s - (1 if triaxial else 0)
        assert pps % ppi == 0 and plain * pps >= pages > (plain - 1) * pps, (bh, pages, s, pps)
        assert s <= WAVE_MAX_SPLITS, (bh, pages, s)
        # the choice is the least cost of every (splits, pages per split) the page table allows within the merge
        plans = {((-(-pages // pps)) + (1 if triaxial else 0), pps) for pps in range(ppi, pages + ppi, ppi)}
        best = min(wave_cost(bh, pages, k, q, ppi, SMS, resident=res, warps=warps) for k, q in plans if k <= WAVE_MAX_SPLITS)
        assert wave_cost(bh, pages, s, pps, ppi, SMS, resident=res, warps=warps) <= best * (1 + 1e-9), (bh, pages, s)


def test_pick_plan_keeps_the_min_length_plan_where_its_busiest_sm_is_cheaper() -> None:
    # triaxial (3 per SM, fill 3/4 of a program a wave), 32 x 32K: 10 x 116 is 20 programs an SM of 102.4 pages on
    # average (+ 8: two steps) in 7 waves, 2,207.5; 17 x 64 is 33 of 60.2 in 11 waves, 2,251.5 (measured 4.5% slower)
    tri = dict(resident=3, fill=0.75)
    assert busiest_sm_cost(256, 1024, 10, SMS, 4, **tri) == pytest.approx((102.4 + 8) * (20 + 7 * 0.75))
    assert pick_plan(256, 1024, 4, SMS, wave=(17, 64), old=(10, 116), **tri) == (10, 116)
    # 128 x 4K: 4 x 44 (32 programs an SM of 32 pages) over 5 x 32 (39 of 25.6; measured 5.8% slower)
    assert pick_plan(1024, 128, 4, SMS, wave=(5, 32), old=(4, 44), **tri) == (4, 44)
    # where the wave plan has fewer, longer splits it stays (4 x 128K, 16 x 32K, 64 x 4K, 16 x 4K: 3-15% faster)
    assert pick_plan(32, 4096, 4, SMS, wave=(37, 116), old=(65, 64), **tri) == (37, 116)
    assert pick_plan(128, 1024, 4, SMS, wave=(9, 128), old=(17, 64), **tri) == (9, 128)
    assert pick_plan(512, 128, 4, SMS, wave=(3, 64), old=(4, 44), **tri) == (3, 64)
    assert pick_plan(128, 128, 4, SMS, wave=(3, 64), old=(4, 44), **tri) == (3, 64)
    # fp8 (6 per SM, fill 0: memory saturates at 3 programs an SM), 16 x 4K: 3 programs of 93.3 pages (280) over 6
    # of 50.7 (304; measured 4.7% slower); 8 x 4K: 4 of 40 (160) over 3 of 59.2 (178; 4.5% faster)
    fp8 = dict(resident=6, fill=0.0)
    assert pick_plan(128, 256, 4, SMS, wave=(6, 44), old=(3, 88), **fp8) == (3, 88)
    assert pick_plan(64, 256, 4, SMS, wave=(8, 32), old=(5, 52), **fp8) == (8, 32)
    assert pick_plan(8, 8192, 4, SMS, wave=(98, 84), old=(86, 96), **fp8) == (98, 84)
    # nvfp4 (8 per SM, fill 1.5: latency-bound, more programs a wave pay): 16 x 4K 8 x 32 (380) over 3 x 88 (420)
    nv = dict(resident=8, fill=1.5)
    assert pick_plan(128, 256, 4, SMS, wave=(8, 32), old=(3, 88), **nv) == (8, 32)
    assert pick_plan(32, 256, 4, SMS, wave=(16, 16), old=(8, 32), **nv) == (16, 16)
    assert pick_plan(256, 2048, 4, SMS, wave=(4, 512), old=(9, 228), **nv) == (4, 512)
    # equal plans, equal costs: the wave plan
    assert pick_plan(8, 256, 4, SMS, wave=(32, 8), old=(32, 8), **nv) == (32, 8)


# (batch, context) -> the launched plan (splits, pages per split) per format, on 132 SMs; "old" where the
# min-length plan wins over plan_waves'
LAUNCHED = {
    "nvfp4": {(1, 4096): (32, 8), (4, 4096): (16, 16), (16, 4096): (8, 32), (64, 4096): (2, 128),
              (128, 4096): (1, 256), (32, 32768): (4, 512), (4, 131072): (33, 252), (1, 131072): (114, 72)},
    "fp8_e4m3": {(4, 4096): (8, 32), (8, 4096): (8, 32), (16, 4096): (3, 88), (64, 4096): (3, 88),
                 (1, 32768): (32, 64), (32, 32768): (3, 684), (4, 131072): (24, 344), (1, 131072): (98, 84)},
    "triaxial": {(16, 4096): (4, 44), (64, 4096): (3, 64), (128, 4096): (4, 44), (16, 32768): (8, 148),
                 (32, 32768): (8, 148), (4, 131072): (33, 128), (1, 131072): (65, 64)},
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(LAUNCHED))
def test_gluon_decode_launches_pick_plans_choice_at_the_bench_shapes(fmt: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(triton_common, "sm_count", lambda device: SMS)  # the min-length planner's H200
    monkeypatch.setattr(gluon_decode, "sm_count", lambda device: SMS)
    for (b, ctx), want in LAUNCHED[fmt].items():
        got, old, wave = (_plan(fmt, b, ctx, f) for f in (gluon_decode.split_plan, gluon_decode.min_length_plan,
                                                          gluon_decode.wave_plan))  # fmt: skip
        assert got == want and got in (old, wave), (b, ctx, got, old, wave)


def _plan(fmt: str, batch: int, ctx: int, planner: Any) -> tuple[int, int]:
    tri = fmt == "triaxial"
    layout = PageLayout.build("int4" if tri else fmt, page_size=32 if tri else 16, kv_heads=8, head_dim=128)
    kv: Any = SimpleNamespace(layout=layout, triaxial=tri)
    q, table = torch.empty(batch, 32, 128), torch.empty(batch, ctx // layout.page_size, dtype=torch.int32)
    return tuple(planner(q, kv, table, gluon_decode.GL_TUNING[layout.fmt]))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """bench/decode_gpu.py (its forced_plan: the plans the benchmark times beside the planners')."""
    return load_bench("decode_gpu")


def _forced(bench: ModuleType, fmt: str, ctx: int, splits: int) -> tuple[int, int]:
    cfg = gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt]
    pages = ctx // (32 if fmt == "triaxial" else 16)
    return tuple(bench.forced_plan(pages, cfg["num_warps"] * cfg["PPW"], splits, triaxial=fmt == "triaxial"))


def test_forced_splits_launch_ceil_pages_over_splits_rounded_to_a_step(bench: ModuleType) -> None:
    # fp8 128 x 4K (256 pages, 4 a step): 2 x 128 is pick_plan's, 3 x 88 the min-length planner's
    for k, want in [(1, (1, 256)), (2, (2, 128)), (3, (3, 88)), (4, (4, 64)), (5, (5, 52)), (6, (6, 44))]:
        assert _forced(bench, "fp8_e4m3", 4096, k) == want
    # rounded up to a whole step, the grid can have fewer splits than asked: 100 -> 3 pages -> 4, 64 splits
    assert _forced(bench, "nvfp4", 4096, 100) == (64, 4)
    assert _forced(bench, "nvfp4", 4096, 7) == (7, 40)


def test_forced_triaxial_splits_count_the_int2_int4_boundary_split(bench: ModuleType) -> None:
    # SPLITS is the grid's split count as the planners print it: k - 1 chunks of the page table plus the boundary's
    # split, so the min-length and the wave plans come back by their printed counts
    assert _forced(bench, "triaxial", 32768, 10) == (10, 116)  # min-length plan
    assert _forced(bench, "triaxial", 32768, 17) == (17, 64)  # wave plan
    assert _forced(bench, "triaxial", 4096, 4) == (4, 44)
    assert _forced(bench, "triaxial", 4096, 5) == (5, 32)
    assert _forced(bench, "triaxial", 4096, 2) == (2, 128)  # one chunk: the INT2 pages, then the INT4 ones


@pytest.mark.parametrize("pages", [1, 5, 37, 128, 1024])
@pytest.mark.parametrize("splits", [2, 3, 10, 50])
def test_forced_triaxial_plan_covers_every_row_split_into_int2_and_int4_chunks(bench: ModuleType, pages: int,
                                                                              splits: int) -> None:  # fmt: skip
    s, pps = bench.forced_plan(pages, 4, splits, triaxial=True)
    assert pps % 4 == 0 and s <= splits
    for n2 in range(pages + 1):  # the kernel: ceil(n2 / pps) INT2 splits, then ceil(n4 / pps) INT4 ones
        assert -(-n2 // pps) + -(-(pages - n2) // pps) <= s, (n2, s, pps)


def test_forced_splits_below_the_least_are_refused_naming_the_key(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="SPLITS must be >= 1, got 0"):
        _forced(bench, "fp8_e4m3", 4096, 0)
    with pytest.raises(ValueError, match="SPLITS must be >= 1"):
        bench.forced_plan(256, 4, -3, triaxial=False)
    with pytest.raises(ValueError, match="SPLITS must be >= 2 for triaxial pages.*got 1"):
        _forced(bench, "triaxial", 32768, 1)

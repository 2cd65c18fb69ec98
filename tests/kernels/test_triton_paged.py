"""Triton paged-KV kernels against the torch references (paged_ref) and the codecs.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) with the
portable arithmetic decoders, on tiny shapes. The ``gpu`` tests run the same
checks at real shapes on the device machine, with both the inline-assembly
(default there) and the arithmetic decoders.

Bounds: writes and the extend gather must be bit-identical to the reference.
Decode attention dequantizes to fp16 (bf16 pages: bf16) for ``tl.dot`` and
rounds the softmax weights to that type, so against fp64 attention over the
codec-dequantized K/V its relative error is a few units of fp16/bf16
rounding: 3e-3 (fp16 paths) and 1e-2 (bf16 pages), with fp32 q and output.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_paged_ref import (
    SCALES,
    Pool,
    dense_attention,
    expected_kv,
    fill_sequences,
    make_pool,
    rel_err,
)

from kvserving.kernels import gluon_decode, paged_ops, paged_ref, triton_common, triton_decode, triton_gather, triton_write
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.kernels.paged_kv import PagedKV

# The tiny-shape tests run the kernels on CPU tensors, which only the interpreter can do;
# on a CUDA machine the gpu tests below cover the same ground at real shapes.
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)

FORMATS = ["bf16", "fp8_e4m3", "nvfp4", "int4"]
CASES = FORMATS + ["triaxial"]
BOUND = {"bf16": 1e-2, "fp8_e4m3": 3e-3, "nvfp4": 3e-3, "int4": 3e-3, "triaxial": 3e-3}


def edge_tokens(t: int, h: int, d: int) -> torch.Tensor:
    """Random tokens plus rows that hit the codecs' corners: zeros, constants, outliers, tiny values, E2M1 ties."""
    x = torch.randn(t, h, d) * 2
    x[0] = 0.0  # zero blocks / groups (scale 0 -> codes 0; int scale 1)
    x[1] = 0.75  # constant groups: max == min
    x[2, :, ::7] *= 400  # saturates fp8 at 448 with small scales, large nvfp4 block scales
    x[3] = torch.randn(h, d) * 1e-6  # E4M3 subnormals and underflow to zero
    ties = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.0])
    x[4, :, :16] = ties  # block scale exactly 1: every E2M1 midpoint, ties to even
    return x[:t]


def _clone(pool: Pool) -> Pool:
    return Pool(pool.layout, pool.int2, pool.buffer.clone(), pool.num_pages, pool.num_int2_pages)


# ----------------------------------------------------------------------------
# quantize-on-write and INT2 pages: bytes identical to the reference
# ----------------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_bytes_equal_reference(fmt: str) -> None:
    # 21 tokens: several 16-row programs; 3 and 1: a decode step's rows (write_shape cuts the program to them)
    for t in (21, 3, 1):
        pool = make_pool(fmt, num_pages=5, page_size=8, kv_heads=2, head_dim=64)
        ref = _clone(pool)
        k, v = edge_tokens(21, 2, 64)[:t], edge_tokens(21, 2, 64).flip(0)[:t]  # corner rows first (k), random rows (v)
        dst = torch.randperm(5 * 8)[:t]  # scattered (page, slot) pairs, pages out of order
        pages, slots = (dst // 8).int(), (dst % 8).int()
        ks, vs = SCALES[fmt], SCALES[fmt] * 3
        for dtype in (torch.float32, torch.bfloat16):
            triton_write.write_kv(pool.kv(ks, vs), k.to(dtype), v.to(dtype), pages, slots)
            paged_ref.write_kv(ref.kv(ks, vs), k.to(dtype), v.to(dtype), pages, slots)
            assert torch.equal(pool.buffer, ref.buffer), (t, dtype)  # written bytes equal, untouched bytes untouched


def test_write_shape_cuts_token_rows_to_the_tokens_written() -> None:
    assert triton_write.write_shape("nvfp4", 1) == (1, 1)
    assert triton_write.write_shape("fp8_e4m3", 3) == (4, 4)
    assert triton_write.write_shape("bf16", 64) == (4, 16)
    assert triton_write.write_shape("int4", 1) == (triton_write.WRITE_TUNING["int4"]["num_warps"], 0)  # int4 groups keep their shape


@interpreter_only
def test_write_int2_pages_bytes_equal_reference() -> None:
    pool = make_pool("int4", num_pages=1, page_size=8, kv_heads=2, head_dim=64, num_int2_pages=4)
    ref = _clone(pool)
    k = edge_tokens(16, 2, 64).reshape(2, 8, 2, 64)
    v = edge_tokens(16, 2, 64).flip(0).reshape(2, 8, 2, 64)
    ids = torch.tensor([3 | INT2_PAGE_FLAG, 1 | INT2_PAGE_FLAG], dtype=torch.int32)
    triton_write.write_int2_pages(pool.kv(), k, v, ids)
    paged_ref.write_int2_pages(ref.kv(), k, v, ids)
    assert torch.equal(pool.buffer, ref.buffer)


# ----------------------------------------------------------------------------
# extend gather: bit-identical workspace, nothing written past num_tokens
# ----------------------------------------------------------------------------


def _filled_pool(case: str, lens: list[int], *, device: str = "cpu", d: int = 64, h: int = 2, p: int = 8, ops: object = triton_write):
    n2 = None
    if case == "triaxial":
        n2 = [min(i % 3, n // p) for i, n in enumerate(lens)]
        pool = make_pool("int4", num_pages=sum(-(-n // p) for n in lens) + 2, page_size=p, kv_heads=h, head_dim=d,
                         num_int2_pages=sum(n2) + 1, device=device)  # fmt: skip
        scale = 1.0
    else:
        pool = make_pool(case, num_pages=sum(-(-n // p) for n in lens) + 2, page_size=p, kv_heads=h, head_dim=d, device=device)
        scale = SCALES[case]
    filled = fill_sequences(pool, lens, int2_pages=n2, k_scale=scale, v_scale=scale, ops=ops)
    return pool, filled, scale


@interpreter_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gather_kv_equals_reference_and_leaves_the_rest(case: str, out_dtype: torch.dtype) -> None:
    lens = [1, 8, 19]
    pool, filled, scale = _filled_pool(case, lens)
    for i, n in enumerate(lens):
        out_k = torch.full((n + 5, 2, 64), float("nan"), dtype=out_dtype)
        out_v = torch.full((n + 5, 2, 64), float("nan"), dtype=out_dtype)
        triton_gather.gather_kv(pool.kv(scale, scale), filled.page_table[i], n, out_k, out_v)
        ek, ev = expected_kv(pool, filled, i, k_scale=scale, v_scale=scale)
        assert torch.equal(out_k[:n], ek.to(out_dtype)) and torch.equal(out_v[:n], ev.to(out_dtype))
        assert out_k[n:].isnan().all() and out_v[n:].isnan().all()


# ----------------------------------------------------------------------------
# decode attention
# ----------------------------------------------------------------------------


def _check_decode(case: str, lens: list[int], *, device: str = "cpu", d: int = 64, h: int = 2, g: int = 4, p: int = 8,
                  splits: tuple[int, int] | None = None, kernel: str = "tl", fast: bool | None = None) -> None:  # fmt: skip
    """Decode through one kernel ("tl", "gluon", or "auto": paged_ops' choice) against dense attention; ``splits``
    (splits, pages per split) launches that plan instead of the planner's."""
    pool, filled, scale = _filled_pool(case, lens, device=device, d=d, h=h, p=p)
    q = torch.randn(len(lens), h * g, d, device=device)
    kv = pool.kv(scale, scale)
    args = (q, kv, filled.page_table, filled.seq_lens)
    if kernel == "auto":
        assert splits is None and fast is None
        out = paged_ops.decode_attention(*args, sm_scale=d**-0.5, num_int2_pages=filled.num_int2, options=KernelOptions())
    elif kernel == "gluon":
        assert gluon_decode.supported(kv, q)
        if splits is None:
            out = gluon_decode.decode_attention(*args, sm_scale=d**-0.5, num_int2_pages=filled.num_int2)
        else:
            out, _ = gluon_decode.launch_decode(*args, sm_scale=d**-0.5, num_int2_pages=filled.num_int2,
                                                cfg=gluon_decode.GL_TUNING[kv.layout.fmt], plan=splits)  # fmt: skip
    else:
        fast = KernelOptions.from_env().fast_decoders(q.device) if fast is None else fast
        out, _ = triton_decode.launch_decode(*args, sm_scale=d**-0.5, num_int2_pages=filled.num_int2, fast=fast,
                                             cfg=triton_decode.TUNING[kv.layout.fmt], plan=splits)  # fmt: skip
    assert out.dtype == q.dtype and out.shape == q.shape
    for i in range(len(lens)):
        ek, ev = expected_kv(pool, filled, i, k_scale=scale, v_scale=scale)
        err = rel_err(out[i].cpu(), dense_attention(q[i].cpu(), ek, ev, d**-0.5))
        assert err < BOUND[case], (case, i, lens[i], err)


@interpreter_only
@pytest.mark.parametrize("case", CASES)
def test_decode_matches_dense_attention_ragged_partial_pages(case: str) -> None:
    # one-token sequence, exactly one page, one past a page, partial last page; tables padded and scattered
    _check_decode(case, [1, 8, 9, 30])


@interpreter_only
@pytest.mark.parametrize(
    ("case", "splits"),  # the merge takes them in one step of 16 / 64 splits, or 130 in two steps of 128
    [("nvfp4", (12, 2)), ("triaxial", (12, 2)), ("nvfp4", (40, 1)), ("triaxial", (40, 1)), ("nvfp4", (130, 1))],
)
def test_decode_merges_many_splits_including_empty_ones(case: str, splits: tuple[int, int]) -> None:
    # few pages per split: short sequences leave most splits empty, the long one spans several
    _check_decode(case, [3, 40, 17], splits=splits)


@interpreter_only
def test_decode_zero_length_sequence_gives_zeros() -> None:
    pool, filled, _ = _filled_pool("bf16", [5, 0])
    q = torch.randn(2, 4, 64)
    out = triton_decode.decode_attention(q, pool.kv(), filled.page_table, filled.seq_lens, sm_scale=0.1, fast=False)
    assert torch.equal(out[1], torch.zeros(4, 64))


@interpreter_only
def test_split_planner_covers_every_page_and_keeps_splits_long_enough() -> None:
    cpu = torch.device("cpu")  # 4 "SMs" off the GPU
    # 16 programs per SM over 2 sequence-heads: 32 splits wanted, of 4096 pages -> 128 pages (a multiple of 4) each
    assert triton_common.plan_splits(2, 4096, 4, cpu, triaxial=False) == (32, 128)
    # no split shorter than min_pages: 4096 / 512 = 8 splits
    assert triton_common.plan_splits(2, 4096, 4, cpu, triaxial=False, min_pages=512) == (8, 512)
    # triaxial: one more split, for the INT2 / INT4 boundary inside a sequence
    assert triton_common.plan_splits(2, 4096, 4, cpu, triaxial=True, min_pages=512) == (9, 512)
    for bh, pages, ppi, mp in [(1, 1, 4, 96), (7, 333, 4, 48), (64, 100, 8, 1), (3, 10_000, 4, 96)]:
        s, pps = triton_common.plan_splits(bh, pages, ppi, cpu, triaxial=False, min_pages=mp)
        assert pps % ppi == 0 and s * pps >= pages > (s - 1) * pps, (bh, pages, s, pps)
        assert s == 1 or pps >= min(mp, pages), (bh, pages, s, pps)


@interpreter_only
def test_split_planner_fills_the_sms_before_keeping_splits_long() -> None:
    cpu = torch.device("cpu")  # 4 "SMs"
    # 1 sequence-head over 256 pages, splits of >= 96 pages: 3 splits = 3 programs on 4 SMs
    assert triton_common.plan_splits(1, 256, 4, cpu, triaxial=False, min_pages=96) == (3, 88)
    # at least 2 programs per SM: 8 splits of 32 pages
    assert triton_common.plan_splits(1, 256, 4, cpu, triaxial=False, min_pages=96, min_fill=2) == (8, 32)
    # never shorter than ppi pages: 8 pages of ppi 4 give 2 splits however empty the SMs are
    assert triton_common.plan_splits(1, 8, 4, cpu, triaxial=False, min_pages=96, min_fill=2) == (2, 4)
    # a grid that already fills the SMs keeps its long splits: 8 sequence-heads x 3 splits >= 2 x 4
    assert triton_common.plan_splits(8, 256, 4, cpu, triaxial=False, min_pages=96, min_fill=2) == (3, 88)
    # triaxial: the extra boundary split comes on top
    assert triton_common.plan_splits(1, 256, 4, cpu, triaxial=True, min_pages=96, min_fill=2) == (9, 32)


def test_paged_ops_dispatches_to_triton_when_asked() -> None:
    pool, filled, _ = _filled_pool("fp8_e4m3", [10], ops=paged_ops)
    q = torch.randn(1, 4, 64)
    kv = pool.kv(SCALES["fp8_e4m3"], SCALES["fp8_e4m3"])
    ref = paged_ops.decode_attention(q, kv, filled.page_table, filled.seq_lens, sm_scale=0.1)
    tri = paged_ops.decode_attention(q, kv, filled.page_table, filled.seq_lens, sm_scale=0.1, backend="triton")
    assert rel_err(tri, ref) < 3e-3 and not torch.equal(tri, ref)  # two implementations, one answer
    via_options = paged_ops.decode_attention(
        q, kv, filled.page_table, filled.seq_lens, sm_scale=0.1, options=KernelOptions(backend="triton")
    )
    assert torch.equal(via_options, tri)
    with pytest.raises(ValueError, match="out of range"):
        bad = filled.page_table.clone()
        bad[0, 0] = 10_000
        paged_ops.decode_attention(q, kv, bad, filled.seq_lens, sm_scale=0.1, backend="triton")


def test_paged_ops_is_the_one_place_that_picks_the_decode_kernel() -> None:
    pool = make_pool("nvfp4", num_pages=2, page_size=8, kv_heads=2, head_dim=64)
    q = torch.randn(1, 4, 64)
    kv = pool.kv()
    assert paged_ops.decode_kernel(q, kv, options=KernelOptions()) == "reference"  # CPU tensors
    assert paged_ops.decode_kernel(q, kv, backend="triton", options=KernelOptions()) == "tl"  # no Gluon off a GPU
    assert paged_ops.decode_kernel(q, kv, options=KernelOptions(backend="triton", decode_kernel="tl")) == "tl"
    with pytest.raises(ValueError, match="decode_kernel='gluon'"):
        paged_ops.decode_kernel(q, kv, options=KernelOptions(backend="triton", decode_kernel="gluon"))
    fp32 = make_pool("fp32", num_pages=2, page_size=8, kv_heads=2, head_dim=64)
    assert paged_ops.decode_kernel(q, fp32.kv(), backend="triton") == "reference"  # fp32 pages: reference only


def test_kernel_options_read_the_environment_once_and_refuse_bad_values() -> None:
    env = {"KVSERVING_PAGED_BACKEND": "triton", "KVSERVING_CHECK_VALUES": "1", "KVSERVING_DECODE_KERNEL": "tl",
           "KVSERVING_TRITON_FAST": "0", "TRITON_INTERPRET": "1"}  # fmt: skip
    assert KernelOptions.from_env(env) == KernelOptions(
        backend="triton", check_values=True, decode_kernel="tl", triton_fast=False, interpret=True
    )
    assert KernelOptions.from_env({}) == KernelOptions()
    assert KernelOptions.from_env({"KVSERVING_PDL": "1"}) == KernelOptions(pdl=True)
    assert KernelOptions().bf16_gemv and KernelOptions.from_env({"KVSERVING_BF16_GEMV": "0"}) == KernelOptions(bf16_gemv=False)
    with pytest.raises(ValueError, match="KVSERVING_BF16_GEMV='on'"):
        KernelOptions.from_env({"KVSERVING_BF16_GEMV": "on"})
    assert KernelOptions().fused_merge and KernelOptions.from_env({"KVSERVING_FUSED_MERGE": "1"}) == KernelOptions()
    assert KernelOptions.from_env({"KVSERVING_FUSED_MERGE": "0"}) == KernelOptions(fused_merge=False)
    with pytest.raises(ValueError, match="KVSERVING_FUSED_MERGE='yes'"):
        KernelOptions.from_env({"KVSERVING_FUSED_MERGE": "yes"})
    gpu = torch.device("cuda")
    assert KernelOptions().fast_decoders(gpu) and not KernelOptions(interpret=True).fast_decoders(gpu)
    assert not KernelOptions(triton_fast=False).fast_decoders(gpu) and KernelOptions(triton_fast=True).fast_decoders(torch.device("cpu"))
    with pytest.raises(ValueError, match="KVSERVING_PAGED_BACKEND='cuda'"):
        KernelOptions.from_env({"KVSERVING_PAGED_BACKEND": "cuda"})
    with pytest.raises(ValueError, match="KVSERVING_DECODE_KERNEL='fast'"):
        KernelOptions.from_env({"KVSERVING_DECODE_KERNEL": "fast"})
    with pytest.raises(ValueError, match="decode_kernel='fast'"):
        KernelOptions(decode_kernel="fast")
    with pytest.raises(ValueError, match="KVSERVING_TRITON_FAST='yes'"):
        KernelOptions.from_env({"KVSERVING_TRITON_FAST": "yes"})


# ----------------------------------------------------------------------------
# GPU: real shapes (Qwen3-8B-like heads), both decoder paths
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fast", [True, False], ids=["asm", "arith"])
def test_gpu_decode_real_shapes(case: str, fast: bool) -> None:
    p = 32 if case == "triaxial" else 16
    lens = [1, p, p + 1, 1000, 2047, 4096, 333, 77]
    _check_decode(case, lens, device="cuda", d=128, h=8, g=4, p=p, fast=fast)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_decode_through_paged_ops(case: str) -> None:
    p = 32 if case == "triaxial" else 16
    _check_decode(case, [1, p + 1, 1000, 4096], device="cuda", d=128, h=8, g=4, p=p, kernel="auto")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_write_and_gather_equal_reference(case: str) -> None:
    p = 32 if case == "triaxial" else 16
    lens = [1, p + 3, 700, 1500]
    pool, filled, scale = _filled_pool(case, lens, device="cuda", d=128, h=8, p=p)  # written by the kernels
    cpu = Pool(pool.layout, pool.int2, pool.buffer.cpu(), pool.num_pages, pool.num_int2_pages)
    for i, n in enumerate(lens):
        out_k = torch.full((n, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        out_v = torch.full_like(out_k, float("nan"))
        triton_gather.gather_kv(pool.kv(scale, scale), filled.page_table[i], n, out_k, out_v)
        ref_k = torch.empty(n, 8, 128, dtype=torch.bfloat16)
        ref_v = torch.empty_like(ref_k)
        paged_ref.gather_kv(cpu.kv(scale, scale), filled.page_table[i].cpu(), n, ref_k, ref_v)
        ek, ev = expected_kv(pool, filled, i, k_scale=scale, v_scale=scale)
        assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v)
        assert torch.equal(ref_k, ek.bfloat16()) and torch.equal(ref_v, ev.bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_write_kv_bytes_equal_reference(fmt: str) -> None:
    pool = make_pool(fmt, num_pages=300, page_size=16, kv_heads=8, head_dim=128, device="cuda")
    ref = pool.buffer.cpu()
    for t in (3000, 5, 1):  # prefill-sized and decode-sized writes (write_shape)
        k, v = edge_tokens(max(t, 5), 8, 128)[:t], torch.randn(t, 8, 128) * 5  # edge_tokens' corner rows need 5
        dst = torch.randperm(300 * 16)[:t]
        pages, slots = (dst // 16).int(), (dst % 16).int()
        ks, vs = SCALES[fmt], SCALES[fmt] * 3
        triton_write.write_kv(pool.kv(ks, vs), k.cuda().bfloat16(), v.cuda().bfloat16(), pages.cuda(), slots.cuda())
        paged_ref.write_kv(PagedKV(ref, pool.layout, ks, vs), k.bfloat16(), v.bfloat16(), pages, slots)
        assert torch.equal(pool.buffer.cpu(), ref), t


@pytest.mark.gpu
def test_gpu_write_int2_pages_bytes_equal_reference() -> None:
    pool = make_pool("int4", num_pages=2, page_size=32, kv_heads=8, head_dim=128, num_int2_pages=64, device="cuda")
    ref = pool.buffer.cpu()
    k = torch.cat([edge_tokens(32, 8, 128)[None], torch.randn(39, 32, 8, 128) * 3])
    v = torch.randn(40, 32, 8, 128)
    ids = (torch.randperm(64)[:40] | INT2_PAGE_FLAG).int()
    triton_write.write_int2_pages(pool.kv(), k.cuda(), v.cuda(), ids.cuda())
    paged_ref.write_int2_pages(PagedKV(ref, pool.layout, int2_layout=pool.int2), k, v, ids)
    assert torch.equal(pool.buffer.cpu(), ref)


# ----------------------------------------------------------------------------
# exact division by an fp16 scale and the rounding edges of the INT writers
# ----------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvserving.kernels import triton_codec  # noqa: E402


@triton.jit
def _div_f16_kernel(d_ptr, s_ptr, inv_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    d = tl.load(d_ptr + i, mask=m, other=0.0)
    s = tl.load(s_ptr + i, mask=m, other=1.0)
    inv = tl.load(inv_ptr + i, mask=m, other=1.0)
    tl.store(out_ptr + i, triton_codec.div_f16(d, s, inv), mask=m)


def _nudge(x: torch.Tensor, ulps: torch.Tensor) -> torch.Tensor:
    """fp32 x moved by a signed number of ulps (through the bit pattern; x > 0)."""
    return (x.view(torch.int32) + ulps.to(torch.int32)).view(torch.float32)


def _hard_quotients(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, s) fp32: every positive finite fp16 scale s, dividends whose quotient is on or within
    a few ulps of a .5 tie or of an arbitrary fp32 midpoint, plus signed zeros, huge and tiny d."""
    s_all = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.float16).float()  # every positive fp16
    n = s_all.numel()
    parts_d, parts_s = [], []
    # quotient (k + 0.5) exactly (k + 0.5 and s have few bits: the product is exact), then nudged
    k = torch.randint(-2, 40, (n,), generator=gen).float() + 0.5
    d = k * s_all
    for ulps in (0, 1, -1, 3):
        parts_d.append(torch.where(d > 0, _nudge(d.abs(), torch.full((n,), ulps)), -_nudge(d.abs(), torch.full((n,), ulps))))
        parts_s.append(s_all)
    # quotient next to a random fp32 midpoint q + ulp(q)/2 (the hard case of any division)
    q = torch.rand(n, generator=gen) * 20 + 2**-10
    mid = q.double() + (torch.nextafter(q, torch.tensor(float("inf"))) - q).double() / 2
    d = (mid * s_all.double()).float()
    for ulps in (0, 1, -1):
        parts_d.append(_nudge(d, torch.full((n,), ulps)))
        parts_s.append(s_all)
    # random signs and magnitudes, signed zeros, the largest inputs the codec accepts
    m = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 6, (n,), generator=gen).float()
    m[:4] = torch.tensor([0.0, -0.0, 131008.0, -131008.0])
    parts_d.append(m)
    parts_s.append(s_all[torch.randperm(n, generator=gen)])
    return torch.cat(parts_d), torch.cat(parts_s)


def _check_div_f16(device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    d, s = _hard_quotients(gen)
    # any reciprocal within 2^-20 will do: exact, and off by up to 8 ulps (1.0 / s on a GPU is within 2)
    inv = (1.0 / s.double()).float()
    inv = _nudge(inv, torch.randint(-8, 9, inv.shape, generator=gen))
    out = torch.empty_like(d)
    dd, ss, ii, oo = (t.to(device) for t in (d, s, inv, out))
    _div_f16_kernel[(triton.cdiv(d.numel(), 4096),)](dd, ss, ii, oo, d.numel(), BLOCK=4096)
    expect = d / s  # IEEE fp32 division on the CPU
    # bit-equal, except that a zero quotient is +0 (adding +0 turns -0 into +0 and leaves the rest alone)
    assert torch.equal((oo.cpu() + 0.0).view(torch.int32), (expect + 0.0).view(torch.int32))


@interpreter_only
def test_div_f16_equals_ieee_division_near_every_kind_of_midpoint() -> None:
    _check_div_f16("cpu")


def _edge_groups(num: int, levels: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 [num, 32]: groups whose INT quotients (x - min) / scale sit on or next to .5 ties, and corner groups.

    A group holding lo = -m*s and hi = lo + L*s gets scale s exactly (s an fp16
    value), and lo + (k + 0.5) * s is an exact tie; half the groups use a
    power-of-two s so the ties survive rounding to bf16.
    """
    s16 = torch.randint(1, 0x6800, (num,), dtype=torch.int16, generator=gen).view(torch.float16).float()  # s <= 2048: |x| < 65504
    pow2 = 2.0 ** torch.randint(-24, 8, (num,), generator=gen).float()
    s = torch.where(torch.arange(num) % 2 == 0, pow2, s16)[:, None]
    lo = -(2.0 ** torch.randint(-1, 3, (num, 1), generator=gen).float()).floor() * s  # 0, -s, -2s, -4s: fp16 values, so zero == lo
    k = torch.randint(0, levels, (num, 32), generator=gen).float() + 0.5  # inside [lo, hi]: the group keeps scale s
    x = lo + k * s  # exact
    ulps = torch.randint(-1, 2, (num, 32), generator=gen)  # one ulp off a tie: a naive x * (1/s) misrounds ~5% of these
    x = torch.where(x > 0, _nudge(x.abs(), ulps), torch.where(x < 0, -_nudge(x.abs(), ulps), x))
    x[:, 0] = lo[:, 0]
    x[:, 1] = (lo + levels * s)[:, 0]
    x = x[:, torch.randperm(32, generator=gen)]
    corners = [
        torch.full((32,), -0.0),  # negative zeros only: zero -0.0, scale 1
        torch.zeros(32),
        torch.full((32,), 0.75),  # max == min
        torch.full((32,), 0.1),  # max == min, min not an fp16 value (fp32 input)
        torch.full((32,), 1000.3),  # nearest fp16 to min (1000.5) above it: zero steps down to 1000
        1000.3 + torch.arange(32) * 2.0**-9,  # the same with a narrow range: scale covers 1000 .. max
        1000.2 + torch.arange(32) * 2.0**-9,  # nearest fp16 1000 below min (rounded to nearest, codes clamped at L)
        torch.tensor([1000.2] * 16 + [1000.3] * 16),  # issue 14's group: scale rounds up to cover max
        torch.tensor([65280.0, -65280.0] * 16),  # the largest inputs in fp16 range in both fp32 and bf16
        torch.tensor([65270.0] * 31 + [65280.0]),  # nearest fp16 65280 above min: zero 65248
        torch.tensor([-1e-10] + [0.5] * 31),  # nearest fp16 -0 above min: zero -2^-24
        torch.cat([torch.tensor([0.0, levels * 2.0**-24]), (torch.arange(30) % (levels + 1) + 0.5) * 2.0**-24]),  # subnormal fp16 scale
        torch.cat([torch.tensor([-3.0, -0.0, 0.0]), torch.randn(29)]),  # signed zeros above the min
    ]
    x[: len(corners)] = torch.stack(corners)
    return x


def _check_int_writes_on_edges(device: str, *, h: int, d: int, p: int, pages: int) -> None:
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        # int4 rows: write_kv, every launch shape the bench may time
        t = pages * p
        k = _edge_groups(t * h * d // 32, 15, gen).reshape(t, h, d)
        v = _edge_groups(t * h * d // 32, 15, gen).reshape(t, h, d).flip(0)
        dst = torch.randperm(pages * p, generator=gen)[: t - 3]
        pg, sl = (dst // p).int(), (dst % p).int()
        for warps in (None, 8):  # WRITE_TUNING's shape, and 8 warps a program
            pool = make_pool("int4", num_pages=pages, page_size=p, kv_heads=h, head_dim=d, device=device)
            ref = pool.buffer.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
            kk, vv = k[: t - 3].to(dtype), v[: t - 3].to(dtype)
            args = (pool.kv(), kk.to(device), vv.to(device), pg.to(device), sl.to(device))
            if warps is None:
                triton_write.write_kv(*args)
            else:
                triton_write.launch_write_kv(*args, num_warps=warps, bt=0)
            paged_ref.write_kv(PagedKV(ref, pool.layout), kk, vv, pg, sl)
            assert torch.equal(pool.buffer.cpu(), ref), (dtype, warps)
        # whole INT2 pages: keys per channel over the page's tokens, values per token group
        kc = _edge_groups(pages * h * d * p // 32, 3, gen).reshape(pages, h, d, p).permute(0, 3, 1, 2)  # channel-wise edges
        vg = _edge_groups(pages * p * h * d // 32, 3, gen).reshape(pages, p, h, d)
        ids = (torch.randperm(pages + 2, generator=gen)[:pages] | INT2_PAGE_FLAG).int()
        for shape in (None, (2, 2, 8)):  # INT2_TUNING's shapes, and 2 heads / 2 warps a keys program, 8 warps values
            pool = make_pool("int4", num_pages=1, page_size=p, kv_heads=h, head_dim=d, num_int2_pages=pages + 2, device=device)
            ref = pool.buffer.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
            kk, vv = kc.contiguous().to(dtype), vg.to(dtype)
            if shape is None:
                triton_write.write_int2_pages(pool.kv(), kk.to(device), vv.to(device), ids.to(device))
            else:
                triton_write.launch_int2_keys(pool.kv(), kk.to(device), ids.to(device), heads=shape[0], num_warps=shape[1])
                triton_write.launch_int2_values(pool.kv(), vv.to(device), ids.to(device), num_warps=shape[2])
            paged_ref.write_int2_pages(PagedKV(ref, pool.layout, int2_layout=pool.int2), kk, vv, ids)
            assert torch.equal(pool.buffer.cpu(), ref), (dtype, shape)


@interpreter_only
def test_int_writes_equal_reference_on_rounding_edges() -> None:
    _check_int_writes_on_edges("cpu", h=2, d=64, p=8, pages=3)


@pytest.mark.gpu
def test_gpu_div_f16_equals_ieee_division() -> None:
    _check_div_f16("cuda")


@pytest.mark.gpu
def test_gpu_int_writes_equal_reference_on_rounding_edges() -> None:
    _check_int_writes_on_edges("cuda", h=8, d=128, p=32, pages=24)

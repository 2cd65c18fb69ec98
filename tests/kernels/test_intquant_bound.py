"""The INT4/INT2 codec's parameters and error bound (kernels/intquant.py), on the reference and through the
Triton writers, gather and decode.

For every group (per token: 32 channels; INT2 keys: one channel over a page's tokens):

* zero is the largest fp16 <= min, and scale the smallest fp16 s with
  L * s >= fl32(max - zero) (1 when that is 0);
* |x - x^| <= scale/2 + 2^-22 |x - zero| + 2^-24 |x^|, x^ = code * scale + zero in fp32.

The groups are offset outlier channels (large offset, narrow range: the case
that broke the old round-to-nearest rule), two-valued groups, fp16-subnormal
groups, groups near +-65504, the whole fp16 range, heavy tails, constants; in
fp32, bf16 and fp16.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_paged_ref import Filled, dense_attention, expected_kv, make_pool, rel_err

from kvserving.kernels import paged_ref, triton_decode, triton_gather, triton_write
from kvserving.kernels.intquant import dequantize_groups, dequantize_int2_keys, quantize_groups, quantize_int2_keys
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.kernels.paged_kv import PagedKV

F32 = torch.float32
F16_MAX = 65504.0
BF16_MAX = 65280.0  # the largest bf16 <= 65504
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)

# The issue's group: 16 values 1000.2 and 16 values 1000.3. Rounded to nearest,
# zero was 1000 and scale 0.1/15 = 0.0066643: every code clamped to 15, error 0.2.
OUTLIER = torch.tensor([1000.2] * 16 + [1000.3] * 16)
OUTLIER_SCALE = 1311 * 2.0**-16  # 0.0200043: the smallest fp16 >= 0.300049 / 15


def check_group_stats(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> None:
    """x [..., G] (one group per row), scale/zero [...]: the parameters are the ones the rule names."""
    lo, hi = x.float().amin(-1), x.float().amax(-1)
    assert bool((zero.float() <= lo).all()), "zero above the group minimum"
    with np.errstate(over="ignore"):  # the fp16 above 65504 is inf
        above = torch.from_numpy(np.nextafter(zero.numpy(), np.float16(np.inf))).float()
    assert bool((above > lo).all()), "zero not the largest fp16 <= min"
    span = hi - zero.float()  # fp32, as the codec computes it
    constant = span == 0
    assert bool((scale[constant] == 1).all())
    s = scale.numpy()
    below = torch.from_numpy(np.nextafter(s, np.float16(0))).float()
    assert bool(((scale.float() * levels >= span) | constant).all()), "the codes do not cover the group"
    assert bool(((below * levels < span) | constant).all()), "scale not the smallest that covers the group"


def check_bound(x: torch.Tensor, x_hat: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """|x - x^| <= scale/2 + 2^-22 |x - zero| + 2^-24 |x^| (x, x^ [..., G]; scale, zero [...])."""
    xd, hd = x.double(), x_hat.double()
    sd, zd = scale.double().unsqueeze(-1), zero.double().unsqueeze(-1)
    bound = sd / 2 + 2.0**-22 * (xd - zd).abs() + 2.0**-24 * hd.abs()
    err = (xd - hd).abs()
    assert bool((err <= bound).all()), f"error {float((err - bound).max()):.3g} above the bound"


def check_groups(x: torch.Tensor, bits: int) -> None:
    """Quantize x [N, D] per token group and check parameters and bound."""
    codes, scale, zero = quantize_groups(x, bits)
    x_hat = dequantize_groups(codes, scale, zero, bits, F32)
    shape = (*x.shape[:-1], x.shape[-1] // 32, 32)
    check_group_stats(x.reshape(shape), scale, zero, 2**bits - 1)
    check_bound(x.reshape(shape), x_hat.reshape(shape), scale, zero)


def check_keys(k: torch.Tensor) -> None:
    """Quantize k [..., P, D] per channel over P and check parameters and bound."""
    codes, scale, zero = quantize_int2_keys(k)
    k_hat = dequantize_int2_keys(codes, scale, zero, F32)
    check_group_stats(k.transpose(-1, -2), scale, zero, 3)
    check_bound(k.transpose(-1, -2), k_hat.transpose(-1, -2), scale, zero)


def sweep_groups(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 [n, 32]: n groups of eight kinds (by row % 8) over many scales and offsets, all within +-65504."""

    def u(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen)

    sign = torch.where(u(n, 1) < 0.5, -1.0, 1.0)
    off = sign * 10.0 ** (u(n, 1) * 4.8)  # 1 .. 63000
    rel = 10.0 ** (-1 - u(n, 1) * 6)  # width / |offset|: 1e-7 .. 1e-1
    kinds = [
        off + off.abs() * rel * u(n, 32),  # outlier channel: large offset, narrow range
        off + off.abs() * rel * (u(n, 32) < 0.5).float(),  # two values, as in the issue
        torch.randn(n, 32, generator=gen) * 2.0 ** (-14 - u(n, 1) * 12),  # fp16 subnormals and below
        sign * (F16_MAX - u(n, 32) * 10.0 ** (u(n, 1) * 4.5)),  # near +-65504
        (u(n, 32) * 2 - 1) * F16_MAX,  # the whole fp16 range
        torch.randn(n, 32, generator=gen) * 10.0 ** (u(n, 1) * 8 - 4),  # normal, 1e-4 .. 1e4
        torch.tan(torch.pi * (u(n, 32) - 0.5)) * 10.0 ** (u(n, 1) * 4 - 2) + off,  # Cauchy: heavy tails
        off * (1 + 2.0**-20 * torch.randint(0, 2, (n, 1), generator=gen)).expand(n, 32),  # constant (often not fp16)
    ]
    pick = (torch.arange(n) % len(kinds))[:, None]
    x = torch.zeros(n, 32)
    for i, kind in enumerate(kinds):
        x = torch.where(pick == i, kind, x)
    return x.clamp(-F16_MAX, F16_MAX)


def as_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype``, clamped to the largest value of that dtype inside fp16 range (bf16 rounds 65504 up)."""
    lim = BF16_MAX if dtype == torch.bfloat16 else F16_MAX
    return x.to(dtype).clamp(-lim, lim)


# ----------------------------------------------------------------------------
# the reference codec
# ----------------------------------------------------------------------------


def test_issue_outlier_group_int4() -> None:
    codes, scale, zero = quantize_groups(OUTLIER, 4)
    assert (scale.tolist(), zero.tolist()) == ([OUTLIER_SCALE], [1000.0])
    # (1000.2 - 1000) / scale = 9.9985 -> 10, (1000.3 - 1000) / scale = 14.999 -> 15: nothing clamps
    assert codes.tolist() == [0xAA] * 8 + [0xFF] * 8
    err = (dequantize_groups(codes, scale, zero, 4, F32) - OUTLIER).abs().max()
    assert float(err) < 1e-4  # one fp32 ulp at 1000; rounded to nearest the old parameters gave 0.2
    check_groups(OUTLIER[None], 4)


def test_issue_outlier_group_int2_values_and_keys() -> None:
    codes, scale, zero = quantize_groups(OUTLIER, 2)
    assert (scale.tolist(), zero.tolist()) == ([1639 * 2.0**-14], [1000.0])  # smallest fp16 >= 0.300049 / 3
    assert codes.tolist() == [0xAA] * 4 + [0xFF] * 4  # 1000.2 -> 2 (1.9995), 1000.3 -> 3
    check_groups(OUTLIER[None], 2)
    # keys: the outlier is a channel (5) over the page's 32 tokens, the rest ordinary
    k = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    k[:, 5] = OUTLIER
    codes, scale, zero = quantize_int2_keys(k)
    assert (float(scale[5]), float(zero[5])) == (1639 * 2.0**-14, 1000.0)
    check_keys(k)


def test_zero_rounds_down_and_scale_up_on_hand_worked_groups() -> None:
    # min = 1 + 0.75 * 2^-10 is nearest to the fp16 1 + 2^-10, above it: zero steps down to 1.
    # span = 15/16 + 0.75 * 2^-10; span / 15 = 0.0625488 is nearest to 1025 * 2^-14, which covers it.
    lo = 1 + 0.75 * 2.0**-10
    x = torch.tensor([lo, lo + 15 / 16] + [lo] * 30)
    codes, scale, zero = quantize_groups(x, 4)
    assert (scale.tolist(), zero.tolist(), codes.tolist()) == ([1025 * 2.0**-14], [1.0], [0xF0] + [0x00] * 15)
    # 2049 is nearest to (and above) the fp16 2048; span 1 + 15/64 = 1.234375: the nearest fp16 to
    # span / 15, 1348 * 2^-14, falls short (15 * it = 1.23413), so scale is one step up
    x = torch.tensor([2049.0, 2049 + 15 / 64] * 16)
    codes, scale, zero = quantize_groups(x, 4)
    assert (scale.tolist(), zero.tolist(), codes.tolist()) == ([1349 * 2.0**-14], [2048.0], [0xFC] * 16)  # 12, 15
    # a tiny negative min: fp16 nearest is -0, above it, so zero is -2^-24
    x = torch.tensor([-1e-10] + [1.0] * 31)
    _, scale, zero = quantize_groups(x, 2)
    # span = fl32(1 + 2^-24) = 1; the nearest fp16 to 1/3, 1365 * 2^-12, is short of it
    assert zero.tolist() == [-(2.0**-24)] and scale.tolist() == [1366 * 2.0**-12]
    # +-65504 and nearly: zero -65504, scale the smallest fp16 >= 131008 / 15 (a multiple of 8 there)
    x = torch.tensor([-65500.0, 65504.0] * 16)
    codes, scale, zero = quantize_groups(x, 4)
    assert (scale.tolist(), zero.tolist(), codes.tolist()) == ([8736.0], [-65504.0], [0xF0] * 16)
    for bits in (2, 4):
        check_groups(torch.tensor([[65500.0] * 31 + [65504.0], [-65504.0] * 32]), bits)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.float16])
def test_bound_on_a_seeded_sweep_of_scales_and_offsets(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2026)
    x = as_input(sweep_groups(8192, gen), dtype)  # [8192, 32]
    for bits in (2, 4):
        check_groups(x.reshape(-1, 128), bits)
    # keys: each group becomes one channel of a 32-token page
    check_keys(x.reshape(-1, 128, 32).transpose(-1, -2))


@pytest.mark.parametrize("bits", [2, 4])
def test_bound_on_activation_like_data(bits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(4, 32, 128, generator=gen)
    heavy = (torch.randn(4, 32, 128, generator=gen) * torch.exp(2 * torch.randn(4, 32, 128, generator=gen))).clamp(-1e4, 1e4)
    outlier = torch.randn(4, 32, 128, generator=gen)
    outlier[..., 5] = outlier[..., 5] * 0.01 + 700  # an offset outlier channel, as real keys have
    for x in (normal, heavy, outlier, normal.to(torch.bfloat16), (normal * 1e-4).to(torch.float16)):
        check_groups(x, bits)
        check_keys(x)


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, width=32, allow_subnormal=True)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(_floats(-F16_MAX, F16_MAX), min_size=32, max_size=32),
    _floats(-F16_MAX, F16_MAX),
    st.sampled_from([0.0, 2.0**-30, 2.0**-14, 1e-6, 1e-3, 1.0]),
    st.sampled_from([F32, torch.bfloat16, torch.float16]),
)
def test_property_bound(values: list[float], offset: float, shrink: float, dtype: torch.dtype) -> None:
    # shrink > 0: an offset group whose spread is `shrink` times the values (outlier channels, subnormals)
    x = torch.tensor(values, dtype=F32)
    if shrink:
        x = offset + x * shrink
    x = as_input(x.clamp(-F16_MAX, F16_MAX), dtype)
    for bits in (2, 4):
        check_groups(x[None], bits)
    check_keys(x[:, None].expand(32, 32))


# ----------------------------------------------------------------------------
# the Triton writers, gather and decode (interpreter on CPU)
# ----------------------------------------------------------------------------


def _writer_groups(gen: torch.Generator, n: int) -> torch.Tensor:
    x = sweep_groups(n, gen)
    x[0] = OUTLIER
    x[1] = torch.tensor([-1e-10] + [1.0] * 31)
    x[2] = torch.tensor([-65500.0, 65504.0] * 16)
    x[3] = torch.tensor([1e-40, 3e-40] * 16)  # fp32 subnormals: span 3e-40 must not flush to 0 (scale 2^-24, not 1)
    return x


def _check_written(device: str, *, h: int, d: int, p: int, pages: int) -> None:
    """Writers bit-equal to the reference on the sweep; what gather reads back keeps the bound."""
    gen = torch.Generator().manual_seed(5)
    t = pages * p
    for dtype in (F32, torch.bfloat16):
        k = as_input(_writer_groups(gen, t * h * d // 32).reshape(t, h, d), dtype)
        v = as_input(_writer_groups(gen, t * h * d // 32).reshape(t, h, d).flip(0), dtype)
        pool = make_pool("int4", num_pages=pages, page_size=p, kv_heads=h, head_dim=d, device=device)
        ref = pool.buffer.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
        pg = torch.arange(t, dtype=torch.int32) // p
        sl = torch.arange(t, dtype=torch.int32) % p
        triton_write.write_kv(pool.kv(), k.to(device), v.to(device), pg.to(device), sl.to(device))
        paged_ref.write_kv(PagedKV(ref, pool.layout), k, v, pg, sl)
        assert torch.equal(pool.buffer.cpu(), ref), dtype
        out_k, out_v = torch.empty(t, h, d, device=device), torch.empty(t, h, d, device=device)
        triton_gather.gather_kv(pool.kv(), torch.arange(pages, dtype=torch.int32, device=device), t, out_k, out_v)
        for x, out in ((k, out_k), (v, out_v)):
            _, scale, zero = quantize_groups(x, 4)
            check_bound(x.reshape(t, h, d // 32, 32), out.cpu().reshape(t, h, d // 32, 32), scale, zero)
        # whole INT2 pages: keys per channel over the page, values per token group
        kc = as_input(_writer_groups(gen, pages * h * d).reshape(pages, h, d, p).permute(0, 3, 1, 2).contiguous(), dtype)
        vg = as_input(_writer_groups(gen, pages * p * h * d // 32).reshape(pages, p, h, d), dtype)
        ids = (torch.randperm(pages + 1, generator=gen)[:pages] | INT2_PAGE_FLAG).int()
        pool = make_pool("int4", num_pages=1, page_size=p, kv_heads=h, head_dim=d, num_int2_pages=pages + 1, device=device)
        ref = pool.buffer.cpu().clone()
        triton_write.write_int2_pages(pool.kv(), kc.to(device), vg.to(device), ids.to(device))
        paged_ref.write_int2_pages(PagedKV(ref, pool.layout, int2_layout=pool.int2), kc, vg, ids)
        assert torch.equal(pool.buffer.cpu(), ref), dtype


@interpreter_only
def test_triton_writers_equal_reference_and_keep_the_bound() -> None:
    _check_written("cpu", h=2, d=64, p=32, pages=2)


@interpreter_only
def test_triton_writers_saturate_values_outside_fp16_range() -> None:
    # the reference refuses |x| > 65504; the unchecked GPU path clamps min and max instead of storing inf
    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(4))
    x[:, :, 0], x[:, :, 1] = -1e5, 1e5  # group 0 of every row spans past both ends
    pool = make_pool("int4", num_pages=1, page_size=8, kv_heads=2, head_dim=64)
    ref = pool.buffer.clone()
    slots = torch.arange(4, dtype=torch.int32)
    triton_write.write_kv(pool.kv(), x, x, torch.zeros(4, dtype=torch.int32), slots)
    clamped = x.clamp(-F16_MAX, F16_MAX)  # -1e5 and 1e5 take the codes of -65504 and 65504
    paged_ref.write_kv(PagedKV(ref, pool.layout), clamped, clamped, torch.zeros(4, dtype=torch.int32), slots)
    assert torch.equal(pool.buffer, ref)
    scale = pool.layout.views(pool.buffer[None])["k_scale"][0, :, :4]  # [H, slots written, D/32]
    assert scale[:, :, 0].tolist() == [[8736.0] * 4] * 2 and bool(torch.isfinite(scale).all())


def _check_outlier_decode(device: str, *, h: int, d: int, p: int, g: int) -> None:
    """Triaxial decode (one INT2 page, then INT4 tokens) with offset outlier key channels matches dense attention."""
    gen = torch.Generator().manual_seed(9)
    n = 2 * p + 5
    k = torch.randn(n, h, d, generator=gen)
    k[:, :, 3] = 20.005 + 0.002 * torch.rand(n, h, generator=gen)  # fp16 ulp 2^-6 >> range: the issue's shape
    k[:, :, 7] = -6 + 0.005 * torch.rand(n, h, generator=gen)
    v = torch.randn(n, h, d, generator=gen)
    pool = make_pool("int4", num_pages=3, page_size=p, kv_heads=h, head_dim=d, num_int2_pages=2, device=device)
    ids2 = torch.tensor([1 | INT2_PAGE_FLAG], dtype=torch.int32)
    triton_write.write_int2_pages(pool.kv(), k[None, :p].to(device), v[None, :p].to(device), ids2.to(device))
    rest = torch.arange(n - p)
    pages4 = torch.tensor([2, 0], dtype=torch.int32)
    triton_write.write_kv(pool.kv(), k[p:].to(device), v[p:].to(device), pages4[rest // p].to(device), (rest % p).int().to(device))
    table = torch.cat([ids2, pages4])[None].to(device)
    filled = Filled(table, torch.tensor([n], dtype=torch.int32, device=device),
                    torch.tensor([1], dtype=torch.int32, device=device), [k], [v])  # fmt: skip
    q = torch.randn(1, h * g, d, generator=gen).to(device)
    out = triton_decode.decode_attention(q, pool.kv(), table, filled.seq_lens, sm_scale=d**-0.5,
                                         num_int2_pages=filled.num_int2, fast=device != "cpu")  # fmt: skip
    ek, ev = expected_kv(pool, filled, 0)
    err = rel_err(out[0].cpu(), dense_attention(q[0].cpu(), ek, ev, d**-0.5))
    assert err < 3e-3, err  # the decode tests' fp16 bound (test_triton_paged.py)
    # the INT2 page's outlier key channel: scale <= 0.0024, so error <= 0.0012 (rounded to nearest, zero 20
    # and scale 0.002/3 clamped codes at 3: ~0.004)
    assert float((ek[:p, :, 3] - k[:p, :, 3]).abs().max()) < 0.0015


@interpreter_only
def test_triaxial_decode_with_outlier_key_channels() -> None:
    _check_outlier_decode("cpu", h=2, d=64, p=8, g=2)


@pytest.mark.gpu
def test_gpu_writers_and_decode_with_outlier_channels() -> None:
    _check_written("cuda", h=8, d=128, p=32, pages=16)
    _check_outlier_decode("cuda", h=8, d=128, p=32, g=4)

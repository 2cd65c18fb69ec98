"""Triaxial INT4/INT2 reference codec: hand-worked groups and pages (ties, clamps, constant
groups, fp16 metadata rounding), packing, round-trip bounds, layout match, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserving.kernels.intquant import (
    dequantize_groups,
    dequantize_int2_keys,
    pack_int2,
    pack_int4,
    quantize_groups,
    quantize_int2_keys,
    unpack_int2,
    unpack_int4,
)
from kvserving.kernels.layout import PageLayout

FAST = settings(max_examples=50, deadline=None)
F32 = torch.float32
U8 = torch.uint8

# One group, min -1 and max 14: INT4 scale = 15/15 = 1, zero = -1, so code = rne(x + 1).
GROUP = [-1, 14, 0.5, 1.5, -0.5, 2.5, 13.5, 3.25,
         0, 1, 2, 3, 4, 5, 6, 7,
         8, 9, 10, 11, 12, 13, -0.75, 12.75,
         6.5, 7.5, -1, -1, 14, 14, 0.25, 4.75]  # fmt: skip


def test_packing_bit_order() -> None:
    codes4 = torch.tensor([[1, 2, 3, 15]], dtype=U8)
    assert pack_int4(codes4).tolist() == [[0x21, 0xF3]]  # element 2j in bits 0-3
    codes2 = torch.tensor([1, 2, 3, 0, 3, 3, 3, 2], dtype=U8)
    assert pack_int2(codes2).tolist() == [0b00_11_10_01, 0b10_11_11_11]  # element 4j in bits 0-1
    all4 = torch.arange(256, dtype=U8)
    assert torch.equal(pack_int4(unpack_int4(all4)), all4)
    assert torch.equal(pack_int2(unpack_int2(all4)), all4)
    assert unpack_int4(torch.tensor([0xA5], dtype=U8)).tolist() == [5, 10]
    assert unpack_int2(torch.tensor([0xE4], dtype=U8)).tolist() == [0, 1, 2, 3]


def test_int4_group_hand_worked() -> None:
    codes, scale, zero = quantize_groups(torch.tensor(GROUP, dtype=F32), 4)
    assert scale.dtype == zero.dtype == torch.float16
    assert scale.tolist() == [1.0] and zero.tolist() == [-1.0]
    # codes = rne(x + 1): 0 15 2(1.5) 2(2.5) 0(0.5) 4(3.5) 14(14.5) 4 | 1..8 | 9..14 0(0.25) 14(13.75)
    #                     8(7.5) 8(8.5) 0 0 15 15 1(1.25) 6(5.75)
    assert codes.tolist() == [0xF0, 0x22, 0x40, 0x4E, 0x21, 0x43, 0x65, 0x87,
                              0xA9, 0xCB, 0xED, 0xE0, 0x88, 0x00, 0xFF, 0x61]  # fmt: skip
    out = dequantize_groups(codes, scale, zero, 4, F32).tolist()
    assert out[:8] == [-1, 14, 1, 1, -1, 3, 13, 3] and out[8:22] == list(range(0, 14))


def test_int2_group_hand_worked() -> None:
    codes, scale, zero = quantize_groups(torch.tensor(GROUP, dtype=F32), 2)
    assert scale.tolist() == [5.0] and zero.tolist() == [-1.0]  # 15 / 3
    # codes = rne((x + 1) / 5) clamped to 0..3; ties: x=1.5 -> 0.5 -> 0, x=6.5 -> 1.5 -> 2
    # 0 3 0 0 | 0 1 3 1 | 0 0 1 1 | 1 1 1 2 | 2 2 2 2 | 3 3 0 3 | 2 2 0 0 | 3 3 0 1
    assert codes.tolist() == [0x0C, 0x74, 0x50, 0x95, 0xAA, 0xCF, 0x0A, 0x4F]
    assert dequantize_groups(codes, scale, zero, 2, F32).tolist()[:4] == [-1, 14, -1, -1]


def test_constant_group_has_scale_one() -> None:
    codes, scale, zero = quantize_groups(torch.full((32,), 2.5), 4)
    assert (codes.tolist(), scale.tolist(), zero.tolist()) == ([0] * 16, [1.0], [2.5])
    assert dequantize_groups(codes, scale, zero, 4, F32).tolist() == [2.5] * 32
    # 2049 is not an fp16: zero = 2048 (tie to even), and with scale 1 the code 1 restores it.
    codes, scale, zero = quantize_groups(torch.full((32,), 2049.0), 2)
    assert (codes.tolist(), scale.tolist(), zero.tolist()) == ([0x55] * 8, [1.0], [2048.0])
    assert dequantize_groups(codes, scale, zero, 2, F32).tolist() == [2049.0] * 32
    # A range that underflows fp16 (1e-9 / 15 < 2^-25) is treated like a constant group.
    x = torch.zeros(32)
    x[3] = 1e-9
    codes, scale, zero = quantize_groups(x, 4)
    assert (codes.tolist(), scale.tolist(), zero.tolist()) == ([0] * 16, [1.0], [0.0])


def test_clamp_edges_from_fp16_rounded_zero() -> None:
    # Bottom: min = 1 + 0.75 * 2^-10 rounds *up* to the fp16 1 + 2^-10, so
    # (min - zero) / scale = -2^-8 -> rne -0 -> clamped 0; max -> 15 - 2^-8 -> 15.
    lo = 1 + 0.75 * 2.0**-10
    x = torch.tensor([lo, lo + 15 / 16] + [lo] * 30)
    codes, scale, zero = quantize_groups(x, 4)
    assert (scale.tolist(), zero.tolist()) == ([1 / 16], [1 + 2.0**-10])
    assert codes.tolist() == [0xF0] + [0x00] * 15
    # Top: min = 2049 rounds *down* to the fp16 2048 while scale = (15/64)/15 = 2^-6,
    # so every (x - 2048) * 64 >= 64 clamps to 15 and x^ = 2048 + 15/64.
    x = torch.tensor([2049.0, 2049 + 15 / 64] * 16)
    codes, scale, zero = quantize_groups(x, 4)
    assert (scale.tolist(), zero.tolist(), codes.tolist()) == ([2.0**-6], [2048.0], [0xFF] * 16)
    assert dequantize_groups(codes, scale, zero, 4, F32).tolist() == [2048 + 15 / 64] * 32


def test_int2_keys_per_channel_over_the_page() -> None:
    # k [P=4, D=32]: channel c holds p * (c + 1) for c >= 2, so scale c + 1, zero 0, code p.
    p = torch.arange(4, dtype=F32).unsqueeze(1)
    k = p * torch.arange(1, 33, dtype=F32)
    k[:, 0] = torch.tensor([0, 0.5, 1.5, 3])  # scale 1: codes 0, 0 (tie), 2 (tie), 3
    k[:, 1] = 7.0  # constant channel: scale 1, zero 7, code 0
    codes, scale, zero = quantize_int2_keys(k)
    assert codes.shape == (4, 8) and scale.shape == zero.shape == (32,)
    assert scale.tolist() == [1.0, 1.0] + [float(c + 1) for c in range(2, 32)]
    assert zero.tolist() == [0.0, 7.0] + [0.0] * 30
    # byte 0 of token p = ch0 | ch1 << 2 | p << 4 | p << 6; the other bytes p * 0x55
    assert codes[:, 0].tolist() == [0x00, 0x50, 0xA2, 0xF3]
    assert codes[:, 1:].tolist() == [[v * 0x55] * 7 for v in range(4)]
    out = dequantize_int2_keys(codes, scale, zero, F32)
    assert out[:, 0].tolist() == [0, 0, 2, 3] and out[:, 1].tolist() == [7] * 4
    assert torch.equal(out[:, 2:], k[:, 2:])
    # A single-token page (P = 1) is a constant channel everywhere: codes 0.
    codes1, scale1, zero1 = quantize_int2_keys(k[3:4])
    assert codes1.tolist() == [[0] * 8] and scale1.tolist() == [1.0] * 32
    assert torch.equal(dequantize_int2_keys(codes1, scale1, zero1, F32), k[3:4])


def _check_bound(x: torch.Tensor, x_hat: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> None:
    """|x - x^| <= scale/2 + |min - zero| + L |(max - min)/L - scale| + 2^-20 (|x| + |zero| + L scale).

    scale/2: rounding to the nearest code; the next two terms: fp16 rounding of
    zero and scale can push the ends of the range past the codes (clamping);
    the last: fp32 rounding of (x - zero) / scale and of code * scale + zero.
    All of x, x^, scale, zero broadcast against each other (stats already expanded)."""
    xd, sd, zd = x.double(), scale.double(), zero.double()
    lo, hi = xd.amin(dim=-1, keepdim=True), xd.amax(dim=-1, keepdim=True)
    exact_scale = (hi - lo) / levels
    # Where the fp16 scale underflowed to 0 the codec uses scale 1 (no-range fallback).
    fallback = ((x.float().amax(dim=-1, keepdim=True) - x.float().amin(dim=-1, keepdim=True)) / levels).half() == 0
    fp16_scale_zero = torch.where(fallback, 0, levels * (exact_scale - sd).abs())
    bound = sd / 2 + (lo - zd).abs() + fp16_scale_zero + 2.0**-20 * (xd.abs() + zd.abs() + levels * sd)
    assert bool(((xd - x_hat.double()).abs() <= bound).all())
    assert bool((x_hat.double() >= zd - 2.0**-20 * zd.abs()).all())


def _check_groups(x: torch.Tensor, bits: int) -> None:
    codes, scale, zero = quantize_groups(x, bits)
    x_hat = dequantize_groups(codes, scale, zero, bits, F32)
    g = x.shape[-1] // 32
    shape = (*x.shape[:-1], g, 32)
    _check_bound(x.reshape(shape), x_hat.reshape(shape), scale.unsqueeze(-1), zero.unsqueeze(-1), 2**bits - 1)


def _check_keys(k: torch.Tensor) -> None:
    codes, scale, zero = quantize_int2_keys(k)
    k_hat = dequantize_int2_keys(codes, scale, zero, F32)
    # stats run over dim -2: move it last for the shared bound
    _check_bound(k.transpose(-1, -2), k_hat.transpose(-1, -2), scale.unsqueeze(-1), zero.unsqueeze(-1), 3)


def _data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(4, 32, 128, generator=gen)
    heavy = torch.distributions.StudentT(1.5).sample((4, 32, 128)).clamp(-1e4, 1e4)
    cauchy = torch.distributions.Cauchy(0.0, 1.0).sample((4, 32, 128)).clamp(-6e4, 6e4)
    outlier = torch.randn(4, 32, 128, generator=gen)
    outlier[..., 5] = outlier[..., 5] * 50 + 200  # an offset outlier channel, as real keys have
    return [normal, heavy, cauchy, outlier, normal.to(torch.bfloat16), (normal * 1e-4).to(torch.float16)]


@pytest.mark.parametrize("bits", [2, 4])
def test_group_round_trip_error_bound(bits: int) -> None:
    for x in _data():
        _check_groups(x, bits)


def test_int2_keys_round_trip_error_bound() -> None:
    for x in _data():
        _check_keys(x)


@FAST
@given(
    st.lists(st.floats(-1e3, 1e3, width=16), min_size=64, max_size=64),
    st.sampled_from([2, 4]),
    st.sampled_from([1.0, 2.0**-12, 60.0]),
)
def test_property_round_trip_bound(values: list[float], bits: int, mag: float) -> None:
    x = torch.tensor(values, dtype=F32) * mag  # |x| <= 60000: inside fp16
    _check_groups(x.reshape(2, 32), bits)
    _check_keys(x.reshape(2, 32))


def test_shapes_match_int4_and_int2_page_fields() -> None:
    h, p, d = 2, 32, 64
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(h, p, d, generator=gen), torch.randn(h, p, d, generator=gen)
    int4 = PageLayout.build("int4", page_size=p, kv_heads=h, head_dim=d)
    views = int4.views(torch.zeros(1, int4.page_bytes, dtype=U8))
    views["k"][0], views["k_scale"][0], views["k_zero"][0] = quantize_groups(k, 4)
    assert torch.equal(dequantize_groups(views["k"][0], views["k_scale"][0], views["k_zero"][0], 4),
                       dequantize_groups(*quantize_groups(k, 4), 4))  # fmt: skip
    int2 = PageLayout.build("int2", page_size=p, kv_heads=h, head_dim=d)
    views = int2.views(torch.zeros(1, int2.page_bytes, dtype=U8))
    views["k"][0], views["k_scale"][0], views["k_zero"][0] = quantize_int2_keys(k)
    views["v"][0], views["v_scale"][0], views["v_zero"][0] = quantize_groups(v, 2)
    assert torch.equal(dequantize_int2_keys(views["k"][0], views["k_scale"][0], views["k_zero"][0]),
                       dequantize_int2_keys(*quantize_int2_keys(k)))  # fmt: skip
    assert torch.equal(dequantize_groups(views["v"][0], views["v_scale"][0], views["v_zero"][0], 2),
                       dequantize_groups(*quantize_groups(v, 2), 2))  # fmt: skip


def test_bad_input_is_refused() -> None:
    x = torch.ones(2, 32)
    for bad_bits in (3, 8, 0, True):
        with pytest.raises(ValueError, match="bits must be 2 or 4"):
            quantize_groups(x, bad_bits)
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        dequantize_groups(torch.zeros(2, 16, dtype=U8), torch.ones(2, 1).half(), torch.ones(2, 1).half(), 8)
    for quantize in (lambda t: quantize_groups(t, 4), quantize_int2_keys):
        with pytest.raises(ValueError, match="dtype"):
            quantize(torch.ones(2, 32, dtype=torch.int32))
        with pytest.raises(ValueError, match="dtype"):
            quantize(torch.ones(2, 32, dtype=torch.float64))
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize(torch.full((2, 32), float("nan")))
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize(torch.full((2, 32), float("-inf")))
        for d in (16, 48, 0):
            with pytest.raises(ValueError, match="multiple of 32"):
                quantize(torch.ones(2, d))
        with pytest.raises(ValueError, match="fp16 maximum"):
            quantize(torch.full((2, 32), 70000.0))
    with pytest.raises(ValueError, match="at least one token"):
        quantize_int2_keys(torch.ones(0, 32))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_int2_keys(torch.ones(32))
    codes, scale, zero = quantize_groups(x, 4)
    with pytest.raises(ValueError, match="codes shape"):
        dequantize_groups(codes, scale, zero, 2)
    with pytest.raises(ValueError, match="scale must be a float16"):
        dequantize_groups(codes, scale.float(), zero, 4)
    with pytest.raises(ValueError, match="same shape"):
        dequantize_groups(codes, scale, zero[:1], 4)
    with pytest.raises(ValueError, match="codes must be a uint8"):
        dequantize_groups(codes.int(), scale, zero, 4)
    kc, ks, kz = quantize_int2_keys(torch.ones(4, 32))
    with pytest.raises(ValueError, match="one more dim"):
        dequantize_int2_keys(kc[0], ks, kz)
    with pytest.raises(ValueError, match="codes shape"):
        dequantize_int2_keys(kc[:, :4], ks, kz)
    with pytest.raises(ValueError, match="codes must be in 0..15"):
        pack_int4(torch.tensor([16, 0], dtype=U8))
    with pytest.raises(ValueError, match="codes must be in 0..3"):
        pack_int2(torch.tensor([4, 0, 0, 0], dtype=U8))
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int2(torch.zeros(6, dtype=U8))
    with pytest.raises(ValueError, match="uint8"):
        pack_int4(torch.zeros(2))


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_value_scales_are_stored_token_minor_and_key_scales_are_not(fmt: str) -> None:
    # the Gluon decode loads two adjacent tokens' value scales as one 32-bit word (layout.py)
    h, p, d = 2, 32, 128
    lay = PageLayout.build(fmt, page_size=p, kv_heads=h, head_dim=d)
    raw = torch.zeros(1, lay.page_bytes, dtype=U8)
    views = lay.views(raw)
    assert views["v_scale"].shape == (1, h, p, d // 32)  # logical [H, P, D/32]
    views["v_scale"][0, 1, 5, 2] = 7.0  # head 1, token 5, group 2
    f = lay.field("v_scale")
    flat = raw[0, f.offset : f.offset + f.nbytes].view(torch.float16)
    assert torch.nonzero(flat).flatten().tolist() == [(1 * (d // 32) + 2) * p + 5]  # stored [H, D/32, P]
    if fmt == "int4":
        views["k_scale"][0, 1, 5, 2] = 7.0
        f = lay.field("k_scale")
        flat = raw[0, f.offset : f.offset + f.nbytes].view(torch.float16)
        assert torch.nonzero(flat).flatten().tolist() == [(1 * p + 5) * (d // 32) + 2]  # stored [H, P, D/32]

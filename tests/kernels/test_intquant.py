"""Triaxial INT4/INT2 reference codec: hand-worked groups and pages (ties, constant groups),
packing, layout match, bad input. The rounding of zero and scale and the error bound:
test_intquant_bound.py."""

import pytest
import torch

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
    # 2049 is not an fp16: zero = 2048 (the largest fp16 below it), span 1, and scale the
    # smallest fp16 >= 1/3 (1366 * 2^-12; the nearest, 1365 * 2^-12, falls short): code 3.
    codes, scale, zero = quantize_groups(torch.full((32,), 2049.0), 2)
    assert (codes.tolist(), scale.tolist(), zero.tolist()) == ([0xFF] * 8, [1366 * 2.0**-12], [2048.0])
    assert dequantize_groups(codes, scale, zero, 2, F32).tolist() == [2049 + 2.0**-11] * 32
    # A range below fp16's resolution (1e-9 / 15 < 2^-25) gets the smallest subnormal scale, not 0.
    x = torch.zeros(32)
    x[3] = 1e-9
    codes, scale, zero = quantize_groups(x, 4)
    assert (codes.tolist(), scale.tolist(), zero.tolist()) == ([0] * 16, [2.0**-24], [0.0])


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

"""NVFP4 reference codec: hand-worked blocks (RNE on the E2M1 grid, saturation, -0, zero
blocks, subnormal block scales), round-trip bounds from the format, layout match, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserving.kernels.layout import PageLayout
from kvserving.kernels.nvfp4 import E2M1_VALUES, calibrated_global_scale, dequantize_nvfp4, quantize_nvfp4

FAST = settings(max_examples=50, deadline=None)
F32 = torch.float32


def quant(values: list[float], g: float = 1.0) -> tuple[list[int], list[int]]:
    packed, scales = quantize_nvfp4(torch.tensor(values, dtype=F32), g)
    return packed.tolist(), scales.tolist()


def dequant(packed: list[int], scales: list[int], g: float = 1.0) -> list[float]:
    p = torch.tensor(packed, dtype=torch.uint8)
    s = torch.tensor(scales, dtype=torch.uint8)
    return dequantize_nvfp4(p, s, g, F32).tolist()


def test_e2m1_values_table() -> None:
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert E2M1_VALUES[8:] == (-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    assert math.copysign(1.0, E2M1_VALUES[8]) == -1.0


def test_ties_round_to_even_index_on_the_grid() -> None:
    # amax 6 -> s = e4m3(6/6) = 1.0 = 0x38, S = 1: x/S is x itself.
    x = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6]
    # codes: 0 0(tie) 1 2(tie) 2 2(tie) 3 4(tie) 4 4(2.5->2) 5 6(3.5->4) 6 6(5->4) 7 0xF
    # bytes (element 2j low nibble): 0x00 0x21 0x22 0x43 0x44 0x65 0x66 0xF7
    assert quant(x) == ([0x00, 0x21, 0x22, 0x43, 0x44, 0x65, 0x66, 0xF7], [0x38])
    assert dequant([0x00, 0x21, 0x22, 0x43, 0x44, 0x65, 0x66, 0xF7], [0x38]) == [0, 0, 0.5, 1, 1, 1, 1.5, 2, 2, 2, 3, 4, 4, 4, 6, -6]


def test_divides_by_the_rounded_scale_saturates_and_keeps_negative_zero() -> None:
    # amax 7: 7/6 = 1.1667 -> nearest E4M3 is 1.125 (0x39, m=1), so S = 1.125 and
    # x/S: 7 -> 6.22 saturates to 6 (7 > 6*S = 6.75); the rest are k*S with k:
    #   2.5->2, 5->4, 0.25->0, -0.25->-0, 3.5->4, 1.75->2, -1.25->-1, 0.75->1
    x = [7, 2.8125, 5.625, 0.28125, -0.28125, 3.9375, 1.96875, -1.40625,
         0.84375, -0.0, 0.0, -7, 1.125, -2.25, 0.5625, 6.75]  # fmt: skip
    # codes: 7 4 | 6 0 | 8 6 | 4 A | 2 8 | 0 F | 2 C | 1 7  (8 = -0: sign bit kept)
    packed = [0x47, 0x06, 0x68, 0xA4, 0x82, 0xF0, 0xC2, 0x71]
    assert quant(x) == (packed, [0x39])
    out = dequant(packed, [0x39])
    assert out == [6.75, 2.25, 4.5, 0, -0.0, 4.5, 2.25, -1.125, 1.125, -0.0, 0, -6.75, 1.125, -2.25, 0.5625, 6.75]
    assert [math.copysign(1.0, v) for v in out[3:5] + out[9:11]] == [1.0, -1.0, -1.0, 1.0]


def test_zero_block_has_zero_codes_and_zero_scale() -> None:
    # S == 0: every code 0x0, even for -0.0 (the one place the sign is dropped).
    assert quant([0.0, -0.0] * 8) == ([0x00] * 8, [0x00])
    # amax/6 = 2^-10 is halfway between 0 and the smallest subnormal 2^-9: s rounds
    # to 0 (even), so this nonzero block is a zero block too.
    tiny = 6 * 2.0**-10
    assert quant([tiny, -tiny] + [0.0] * 14) == ([0x00] * 8, [0x00])
    out = dequant([0x00] * 8, [0x00])
    assert out == [0.0] * 16 and all(math.copysign(1.0, v) == 1.0 for v in out)


def test_subnormal_block_scale() -> None:
    # x = v * 2^-10, amax = 18 * 2^-10: amax/6 = 1.5 * 2^-9 is halfway between
    # subnormals 0x01 (2^-9) and 0x02 (2^-8) -> 0x02, S = 2^-8, so x/S = v/4.
    v = [18, 8, -4, 2, 1, -1, 0, 12, 6, 10, 14, -18, 3, 5, 7, 0]
    # v/4: 4.5->4 (6), 2 (4), -1 (A), .5 (1), .25->0 (0), -.25->-0 (8), 0, 3 (5),
    #      1.5 (3), 2.5->2 (4), 3.5->4 (6), -4.5->-4 (E), .75->1 (2), 1.25->1 (2), 1.75->2 (4), 0
    packed = [0x46, 0x1A, 0x80, 0x50, 0x43, 0xE6, 0x22, 0x04]
    assert quant([a * 2.0**-10 for a in v]) == (packed, [0x02])
    expected = [4, 2, -1, 0.5, 0, -0.0, 0, 3, 1.5, 2, 4, -4, 1, 1, 2, 0]
    assert dequant(packed, [0x02]) == [e * 2.0**-8 for e in expected]


def test_block_scale_saturates_at_448_never_nan_code() -> None:
    # amax 6000: 6000/6 = 1000 > 448 -> s = 448 (0x7E); x/S = 13.4 -> 6 (code 7).
    x = [6000, -6000, 896, 448] + [0.0] * 12  # 896/448 = 2 (4), 448/448 = 1 (2)
    assert quant(x) == ([0xF7, 0x24] + [0x00] * 6, [0x7E])
    assert dequant([0xF7, 0x24] + [0x00] * 6, [0x7E])[:4] == [2688, -2688, 896, 448]


def test_global_scale_divides_scale_and_multiplies_back() -> None:
    # g = 0.5, amax 3: s = e4m3(3/6/0.5) = 1.0 (0x38), S = 0.5; 3/S = 6 (7), 1.25/S = 2.5 -> 2 (4)
    x = [3, 1.25] + [0.0] * 14
    assert quant(x, 0.5) == ([0x47] + [0x00] * 7, [0x38])
    assert dequant([0x47] + [0x00] * 7, [0x38], 0.5)[:2] == [3.0, 1.0]


def test_blocks_follow_the_last_dim_in_order() -> None:
    x = torch.zeros(2, 3, 32)
    x[1, 2, 16] = 6.0  # second block of the last row: s = 1.0
    x[0, 0, 1] = -12.0  # first block of the first row: s = 2.0 (0x40), -12/2 = -6 -> 0xF
    packed, scales = quantize_nvfp4(x)
    assert packed.shape == (2, 3, 16) and scales.shape == (2, 3, 2)
    assert scales[1, 2].tolist() == [0x00, 0x38] and scales[0, 0].tolist() == [0x40, 0x00]
    assert packed[1, 2, 8].item() == 0x07 and packed[0, 0, 0].item() == 0xF0
    assert int((packed != 0).sum()) == 2


def test_calibrated_global_scale() -> None:
    assert calibrated_global_scale(2688.0) == 1.0  # 6 * 448
    assert calibrated_global_scale(0.0) == 1.0
    assert calibrated_global_scale(1.0) == 1 / 2688
    # With g calibrated to the tensor's amax, the largest block scale is 448 (0x7E).
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    g = calibrated_global_scale(float(x.abs().max()))
    _, scales = quantize_nvfp4(x, g)
    assert int(scales.max()) == 0x7E
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="amax"):
            calibrated_global_scale(bad)


def _check_bound(x: torch.Tensor, g: float) -> None:
    """Per element: |x - x^| <= half the E2M1 step at |x/S| times S, from the grid
    (step 0.5 below 2, 1 in [2, 4], 2 in [4, 6]); above 6 x^ = ±6 S exactly;
    a zero block (S = 0) only happens when amax/6/g <= 2^-10 and then x^ = 0."""
    packed, scales = quantize_nvfp4(x, g)
    x_hat = dequantize_nvfp4(packed, scales, g, F32).double()
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1)
    g32 = torch.tensor(g, dtype=F32)
    big_s = (s * g32).double()
    xd = x.double()
    zero = big_s == 0
    assert bool((x_hat[zero] == 0).all())
    assert bool((xd[zero].abs() <= 6 * 2.0**-10 * g * (1 + 2.0**-20)).all())
    t = xd[~zero] / big_s[~zero]
    err = (xd[~zero] - x_hat[~zero]).abs() / big_s[~zero]
    sat = t.abs() > 6
    # x^ = fp32((±6 * s) * g): e2m1 * s is exact, * g rounds once.
    six_s_g = (6 * torch.sign(t[sat]).float() * s[~zero][sat]) * g32
    assert torch.equal(x_hat[~zero][sat], six_s_g.double())
    half_step = torch.where(t.abs() < 2, 0.25, torch.where(t.abs() <= 4, 0.5, 1.0))
    # + 2^-22 |t|: x/S is rounded to fp32 (and with g != 1, S and x^ to fp32).
    assert bool((err[~sat] <= half_step[~sat] + t.abs()[~sat] * 2.0**-22).all())
    if g == 1.0:  # e2m1 * s is exact in bf16: the default dtype loses nothing
        assert torch.equal(dequantize_nvfp4(packed, scales).double(), x_hat)


def _data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(16, 128, generator=gen)
    heavy = torch.distributions.StudentT(1.5).sample((16, 128)).clamp(-1e4, 1e4)
    cauchy = torch.distributions.Cauchy(0.0, 1.0).sample((16, 128)).clamp(-1e4, 1e4)
    outlier = torch.randn(16, 128, generator=gen)
    outlier[:, 37] *= 300  # one outlier channel
    return [normal, heavy, cauchy, outlier, normal.to(torch.bfloat16), (normal * 1e-3).to(torch.float16)]


@pytest.mark.parametrize("g_mode", ["unit", "calibrated", "small"])
def test_round_trip_error_bound(g_mode: str) -> None:
    for x in _data():
        amax = float(x.abs().max())
        g = {"unit": 1.0, "calibrated": calibrated_global_scale(amax), "small": 1e-4}[g_mode]
        _check_bound(x, g)


@FAST
@given(
    st.lists(st.floats(-1e4, 1e4, width=32), min_size=16, max_size=16),
    st.floats(-20, 20),
    st.sampled_from([1.0, 0.37, 1e-3]),
)
def test_property_round_trip_bound(values: list[float], log2_mag: float, g: float) -> None:
    # log2_mag spreads blocks over many binades, down to E4M3-subnormal scales.
    x = torch.tensor(values, dtype=F32) * 2.0**log2_mag
    _check_bound(x.reshape(1, 16), g)


def test_shapes_match_nvfp4_page_fields() -> None:
    layout = PageLayout.build("nvfp4", page_size=16, kv_heads=2, head_dim=64)
    pages = torch.zeros(1, layout.page_bytes, dtype=torch.uint8)
    views = layout.views(pages)
    k = torch.randn(2, 16, 64)  # [H, P, D]
    views["k"][0], views["k_scale"][0] = quantize_nvfp4(k)
    assert torch.equal(dequantize_nvfp4(views["k"][0], views["k_scale"][0]), dequantize_nvfp4(*quantize_nvfp4(k)))


def test_bad_input_is_refused() -> None:
    ok = torch.ones(16)
    with pytest.raises(ValueError, match="dtype"):
        quantize_nvfp4(torch.ones(16, dtype=torch.int64))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(torch.tensor([float("nan")] + [0.0] * 15))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(torch.tensor([float("inf")] + [0.0] * 15))
    for d in (8, 24, 0):
        with pytest.raises(ValueError, match="multiple of 16"):
            quantize_nvfp4(torch.ones(2, d))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.tensor(1.0))
    for bad in (0.0, -2.0, float("nan"), float("inf"), 1e-60):
        with pytest.raises(ValueError, match="global_scale"):
            quantize_nvfp4(ok, bad)
        with pytest.raises(ValueError, match="global_scale"):
            dequantize_nvfp4(torch.zeros(8, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), bad)
    packed, scales = quantize_nvfp4(ok)
    with pytest.raises(ValueError, match="packed"):
        dequantize_nvfp4(packed.float(), scales)
    with pytest.raises(ValueError, match="scales must be a uint8"):
        dequantize_nvfp4(packed, scales.float())
    with pytest.raises(ValueError, match="NaN code"):
        dequantize_nvfp4(packed, torch.tensor([0x7F], dtype=torch.uint8))
    with pytest.raises(ValueError, match="8 x scales"):
        dequantize_nvfp4(packed[:7], scales)
    with pytest.raises(ValueError, match="leading dims"):
        dequantize_nvfp4(packed.reshape(1, 8), scales.reshape(1, 1).expand(2, 1))

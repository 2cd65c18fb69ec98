"""FP8 E4M3 reference codec: hand-worked bytes, RNE on every code, saturation, bounds, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserving.kernels.fp8 import dequantize_fp8, quantize_fp8
from kvserving.kernels.layout import PageLayout

FAST = settings(max_examples=50, deadline=None)


def e4m3_value(code: int) -> float:
    """Independent decoder from the format definition (bias 7, 3 mantissa bits, no inf)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0:
        return sign * m / 8 * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def q(values: list[float], scale: float = 1.0) -> list[int]:
    return quantize_fp8(torch.tensor(values, dtype=torch.float32), scale).tolist()


def test_hand_worked_bytes() -> None:
    assert q([1.0, -1.0]) == [0x38, 0xB8]  # e=7, m=0
    assert q([0.0, -0.0]) == [0x00, 0x80]  # the sign of zero survives
    assert q([448.0, 464.0, 1000.0, -1e30]) == [0x7E, 0x7E, 0x7E, 0xFE]  # saturate, never 0x7F
    assert q([2.0**-9]) == [0x01]  # smallest subnormal
    assert q([2.0**-10, -(2.0**-10)]) == [0x00, 0x80]  # halfway to 0x01: tie to even 0 (keeps sign)
    assert q([1.5 * 2.0**-9]) == [0x02]  # halfway 0x01/0x02: even 0x02
    assert q([17.0, 19.0]) == [0x58, 0x5A]  # 17 halfway 16 (0x58)/18 (0x59); 19 halfway 18/20 (0x5A)
    assert q([0.1]) == [0x1D]  # 1.6 * 2^-4 -> mantissa 5/8 (1.625) is nearest: e=3, m=5
    assert q([3.0], scale=2.0) == [0x3C]  # 3/2 = 1.5: e=7, m=4


def test_every_code_round_trips_and_midpoints_round_to_even() -> None:
    codes = list(range(0x7F))  # every non-negative finite code
    values = [e4m3_value(c) for c in codes]
    assert q(values) == codes
    assert q([-v for v in values]) == [c | 0x80 for c in codes]
    lo = torch.tensor(values[:-1], dtype=torch.float32)
    hi = torch.tensor(values[1:], dtype=torch.float32)
    mid = (lo + hi) / 2  # exact in fp32 (5 significant bits)
    even = [c if c % 2 == 0 else c + 1 for c in codes[:-1]]
    assert quantize_fp8(mid).tolist() == even
    below = torch.nextafter(mid, lo)
    above = torch.nextafter(mid, hi)
    assert quantize_fp8(below).tolist() == codes[:-1]
    assert quantize_fp8(above).tolist() == codes[1:]


def test_dequantize_every_code_exactly() -> None:
    codes = [c for c in range(256) if c & 0x7F != 0x7F]
    bits = torch.tensor(codes, dtype=torch.uint8)
    expected = [e4m3_value(c) for c in codes]
    out = dequantize_fp8(bits, dtype=torch.float32)
    assert out.tolist() == expected
    assert math.copysign(1.0, out[codes.index(0x80)].item()) == -1.0  # 0x80 is -0.0
    # Every E4M3 value is exact in bf16, so the default dtype loses nothing.
    assert dequantize_fp8(bits).float().tolist() == expected
    assert dequantize_fp8(torch.tensor([0x3C], dtype=torch.uint8), 2.0, torch.float32).tolist() == [3.0]


def _check_bound(x: torch.Tensor, scale: float) -> None:
    # Bound from the format: below 448 the error of t = x/scale is half an ulp,
    # ulp = 2^(e-3) for a normal t in [2^e, 2^(e+1)), 2^-9 for subnormals, so
    # |t - t^| <= max(|t| * 2^-4, 2^-10); above 448 t^ = ±448 exactly.
    scale_f32 = torch.tensor(scale, dtype=torch.float32)
    t = x.double() / scale_f32.double()
    bits = quantize_fp8(x, scale)
    t_hat = dequantize_fp8(bits, dtype=torch.float32)  # the E4M3 values themselves
    # Dequantizing with the scale is one fp32 multiply of those values.
    assert torch.equal(dequantize_fp8(bits, scale, torch.float32), t_hat * scale_f32)
    t_hat = t_hat.double()
    sat = t.abs() > 448
    assert torch.equal(t_hat[sat], 448 * torch.sign(t[sat]))
    err = (t - t_hat).abs()[~sat]
    bound = torch.maximum(t.abs() * 2.0**-4, torch.full_like(t, 2.0**-10))[~sat]
    # + 2^-22 |t|: x/scale is itself rounded to fp32 before the E4M3 rounding.
    assert bool((err <= bound + t.abs()[~sat] * 2.0**-22).all())


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.7])
def test_round_trip_error_bound_on_normal_heavy_tailed_and_outlier_data(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(64, 128, generator=gen) * 40
    heavy = torch.distributions.StudentT(1.5).sample((64, 128)).clamp(-1e4, 1e4)
    outlier = torch.randn(64, 128, generator=gen)
    outlier[:, 7] *= 1000  # one outlier channel
    for x in (normal, heavy, outlier, normal.to(torch.bfloat16), normal.to(torch.float16)):
        _check_bound(x, scale)


@FAST
@given(st.lists(st.floats(-1e5, 1e5, width=32), min_size=1, max_size=64), st.sampled_from([1.0, 0.01, 8.0]))
def test_property_round_trip_bound_and_sign(values: list[float], scale: float) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    _check_bound(x, scale)
    bits = quantize_fp8(x, scale)
    assert torch.equal(bits >> 7 == 1, torch.signbit(x))
    assert not bool(((bits & 0x7F) == 0x7F).any())


def test_shape_matches_fp8_page_field() -> None:
    layout = PageLayout.build("fp8_e4m3", page_size=16, kv_heads=2, head_dim=64)
    k = torch.randn(2, 16, 64)
    pages = torch.zeros(1, layout.page_bytes, dtype=torch.uint8)
    pages_k = layout.views(pages)["k"]  # [1, H, P, D] uint8
    pages_k[0] = quantize_fp8(k)
    assert torch.equal(dequantize_fp8(pages_k[0]), dequantize_fp8(quantize_fp8(k)))


def test_bad_input_is_refused() -> None:
    x = torch.ones(4)
    with pytest.raises(ValueError, match="dtype"):
        quantize_fp8(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        quantize_fp8(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp8(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp8(torch.tensor([float("-inf")]))
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e39):
        with pytest.raises(ValueError, match="scale"):
            quantize_fp8(x, bad)
        with pytest.raises(ValueError, match="scale"):
            dequantize_fp8(torch.zeros(4, dtype=torch.uint8), bad)
    with pytest.raises(ValueError, match="scale must be a real number"):
        quantize_fp8(x, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uint8"):
        dequantize_fp8(torch.zeros(4))
    with pytest.raises(ValueError, match="NaN code"):
        dequantize_fp8(torch.tensor([0x38, 0x7F], dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN code"):
        dequantize_fp8(torch.tensor([0xFF], dtype=torch.uint8))
    with pytest.raises(ValueError, match="dtype must be"):
        dequantize_fp8(torch.zeros(4, dtype=torch.uint8), dtype=torch.int8)

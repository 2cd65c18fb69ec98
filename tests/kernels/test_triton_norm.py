"""The fused norm / RoPE / SiLU kernels (triton_norm) against their torch references (norm_ref).

On CPU the kernels run under TRITON_INTERPRET=1 on tiny shapes; the ``gpu`` tests run Qwen3-8B's shapes.

Bounds: the kernels round where the references round, so in fp32 they agree to a few fp32 ulps (1e-5 relative
to the values' scale); in bf16 they differ only where the sum of squares (order of addition), ``rsqrt`` or
``exp`` differs in its last fp32 bit and that flips a bf16 rounding: at most one bf16 ulp (2^-8 relative) on
a small share of the elements, so the bound is 1 ulp of the largest magnitude and the mean error stays tiny.
The residual sum and the v copy are exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvserving.kernels import norm_ref, triton_norm

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().item() + 1e-6
    if out.dtype == torch.float32:
        assert diff.max().item() <= 1e-5 * scale, diff.max().item()
    else:
        assert diff.max().item() <= 2**-7 * scale, (diff.max().item(), scale)  # one bf16 ulp at the top binade
        assert diff.mean().item() <= 1e-3 * scale, diff.mean().item()


def _angles(t: int, d: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.arange(t, device=device).float()[:, None] * 37.0 * inv[None, :]
    ang = torch.cat([freqs, freqs], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def check_rms_norm(t: int, n: int, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator(device=device).manual_seed(n + t)
    x = (torch.randn(t, n, generator=g, device=device) * 3).to(dtype)
    res = torch.randn(t, n, generator=g, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)
    _close(triton_norm.rms_norm(x, w, 1e-6), norm_ref.rms_norm_ref(x, w, 1e-6))
    out, h = triton_norm.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_h = norm_ref.add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(h, ref_h)
    _close(out, ref_out)


def check_qk_norm_rope(t: int, heads: int, kv_heads: int, d: int, norm: bool, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator(device=device).manual_seed(heads * d + t)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d, generator=g, device=device) * 2).to(dtype)
    wq = (1 + 0.2 * torch.randn(d, generator=g, device=device)).to(dtype) if norm else None
    wk = (1 + 0.2 * torch.randn(d, generator=g, device=device)).to(dtype) if norm else None
    cos, sin = _angles(t, d, dtype, device)
    kw = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d, "q_weight": wq, "k_weight": wk, "eps": 1e-6}
    q, k, v = triton_norm.qk_norm_rope(qkv, cos, sin, **kw)
    rq, rk, rv = norm_ref.qk_norm_rope_ref(qkv, cos, sin, **kw)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(v, rv)
    _close(q, rq)
    _close(k, rk)


def check_silu_mul(t: int, inter: int, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator(device=device).manual_seed(inter + t)
    gu = (torch.randn(t, 2 * inter, generator=g, device=device) * 3).to(dtype)
    _close(triton_norm.silu_mul(gu), norm_ref.silu_mul_ref(gu))


DTYPES = [torch.float32, torch.bfloat16]


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_the_reference(dtype: torch.dtype) -> None:
    for t, n in ((3, 64), (2, 48)):  # a power of two and a masked row
        check_rms_norm(t, n, dtype, "cpu")


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "rope-only"])
def test_qk_norm_rope_matches_the_reference(dtype: torch.dtype, norm: bool) -> None:
    check_qk_norm_rope(3, 4, 2, 16, norm, dtype, "cpu")
    check_qk_norm_rope(2, 2, 1, 12, norm, dtype, "cpu")  # D / 2 not a power of two: masked


@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_reference(dtype: torch.dtype) -> None:
    check_silu_mul(3, 40, dtype, "cpu")


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        triton_norm.rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        triton_norm.add_rms_norm(x, torch.zeros(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="qkv"):
        triton_norm.qk_norm_rope(torch.zeros(2, 30), torch.zeros(2, 4), torch.zeros(2, 4), num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="cos"):
        triton_norm.qk_norm_rope(torch.zeros(2, 16), torch.zeros(3, 4), torch.zeros(2, 4), num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="gate_up"):
        triton_norm.silu_mul(torch.zeros(2, 7))


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 64, 4099])
def test_kernels_at_qwen3_8b_shapes(t: int) -> None:
    for dtype in DTYPES:
        check_rms_norm(t, 4096, dtype, "cuda")
        check_qk_norm_rope(t, 32, 8, 128, True, dtype, "cuda")
        check_qk_norm_rope(t, 32, 8, 128, False, dtype, "cuda")
        check_silu_mul(t, 12288, dtype, "cuda")

"""FP8 weight GEMMs (fp8_gemm, triton_fp8_gemm) against their torch references.

Bounds:
- quantizers: E4M3 keeps 4 significant bits, so a dequantized value is within 2^-4 of itself
  (normal range) or 2^-10 * scale (subnormal codes) of the original;
- the Triton block GEMM against ``linear_quantized_ref`` (the same quantized operands, the same
  per-128 scaling, fp32 sums in another order): 1e-5 of the output's largest magnitude in fp32,
  one bf16 ulp of it (2^-7, the interpreter truncates) in bf16;
- the GPU GEMMs against ``linear_ref`` (exact weights, unquantized activations, fp32):
  ``gemm_error_bound`` per element (the activation quantization, bf16 output rounding, fp32 sums).

On CPU the kernel runs under TRITON_INTERPRET=1 at tiny sizes; the ``gpu`` tests run the
Qwen3-8B projection shapes through torch._scaled_mm, cuBLASLt's block scaling and Triton.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvserving.kernels import fp8_gemm

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)
# Qwen3-8B's projections (N, K): merged q/k/v, o, merged gate/up, down, and k or v alone.
QWEN3_8B_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (1024, 4096), (12288, 4096)]


def _weight(n: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) * 0.02
    w[:, : min(k, 3)] *= 40.0  # outlier input channels: the tiles holding them get larger scales
    return w


def _acts(m: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g, device=device)
    x[:, 5 % k] *= 30.0  # an outlier channel, as trained models have
    return x


@pytest.mark.parametrize("scheme", ["tensor", "block"])
def test_weight_quantizers_round_trip_within_half_an_e4m3_step(scheme: str) -> None:
    w = _weight(200, 300, seed=1)
    if scheme == "tensor":
        codes, scale = fp8_gemm.quantize_tensor(w)
        assert scale.shape == () and scale.dtype == torch.float32
        assert scale.item() == pytest.approx(w.abs().max().item() / 448, rel=1e-6)
        s_full = scale.expand(200, 300)
        back = codes.float() * scale
    else:
        codes, scale = fp8_gemm.quantize_blocks(w)
        assert scale.shape == (2, 3) and scale.dtype == torch.float32
        assert scale[1, 2].item() == pytest.approx(w[128:, 256:].abs().max().item() / 448, rel=1e-6)
        s_full = fp8_gemm.expand_blocks(scale, 200, 300)
        back = fp8_gemm.dequantize(codes, scale, scheme="block")
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
    assert codes.float().abs().max().item() == 448.0  # the largest value of each scale group maps to 448
    assert ((back - w).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * s_full).all()


def test_an_all_zero_group_gets_scale_one_and_zero_codes() -> None:
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    codes, scale = fp8_gemm.quantize_blocks(w)
    f32 = torch.tensor(1.0 / 448, dtype=torch.float32).item()
    assert scale.tolist() == [[1.0, f32]]
    assert torch.equal(codes[:, :128].float(), torch.zeros(128, 128))
    qa, sa = fp8_gemm.quantize_groups(w[:2])
    assert sa.tolist() == [[1.0, f32]] * 2 and not qa.float().isnan().any()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 128, 128), (3, 256, 384), (17, 200, 256), (70, 384, 128)])
@pytest.mark.parametrize("scheme", ["rows", "block"])
def test_quantized_reference_is_within_the_stated_bound_of_the_exact_product(scheme: str, m: int, n: int, k: int) -> None:
    x = _acts(m, k, seed=m + n)
    w = _weight(n, k, seed=k)
    codes, scale = fp8_gemm.quantize_blocks(w) if scheme == "block" else fp8_gemm.quantize_tensor(w)
    if scheme == "rows":
        scale = scale.expand(n).contiguous()
    for input_scale in (None, torch.tensor(x.abs().max().item() / 448 / 2)) if scheme == "rows" else (None,):
        got = fp8_gemm.linear_quantized_ref(x, codes, scale, scheme=scheme, input_scale=input_scale)
        ref = fp8_gemm.linear_ref(x, codes, scale, scheme=scheme)
        bound = fp8_gemm.gemm_error_bound(x, codes, scale, scheme=scheme, input_scale=input_scale)
        assert ((got - ref).abs() <= bound).all()
        assert (got - ref).abs().max() > 0  # the activations are quantized: the reference differs


@interpreter_only
@pytest.mark.parametrize(("m", "n", "k"), [(1, 128, 128), (5, 200, 256), (17, 256, 384), (70, 160, 128), (130, 128, 256)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_block_gemm_matches_its_torch_reference(m: int, n: int, k: int, out_dtype: torch.dtype) -> None:
    from kvserving.kernels.triton_fp8_gemm import block_gemm

    x = _acts(m, k, seed=n)
    codes, scale = fp8_gemm.quantize_blocks(_weight(n, k, seed=m))
    qa, sa = fp8_gemm.quantize_groups(x)
    out = block_gemm(qa, sa, codes, scale, out_dtype=out_dtype)
    ref = fp8_gemm.linear_quantized_ref(x, codes, scale, scheme="block")
    assert out.shape == (m, n) and out.dtype == out_dtype
    top = ref.abs().max().item()
    tol = 1e-5 * top if out_dtype == torch.float32 else 2.0**-7 * top
    assert (out.float() - ref).abs().max().item() <= tol


@interpreter_only
@pytest.mark.parametrize(("m", "k"), [(2, 128), (3, 384), (4, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantizers_equal_the_torch_quantizers(m: int, k: int, dtype: torch.dtype) -> None:
    from kvserving.kernels.triton_fp8_gemm import quantize

    g = torch.Generator().manual_seed(m * k)
    # magnitudes over 12 binades: codes in the normal and the subnormal range; one all-zero row
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-10, 3, (m, k), generator=g).float())).to(dtype)
    x[-1] = 0.0
    groups = [None, 128] if k % 128 == 0 else [None]
    for group in groups:
        q, s = quantize(x, group=group)
        rq, rs = fp8_gemm.quantize_rows(x) if group is None else fp8_gemm.quantize_groups(x)
        assert torch.equal(s, rs)
        assert torch.equal(q.float(), rq.float())  # the same values (a zero's sign may differ)
        assert (q.float().abs() < 2.0**-6).any() and (q.float().abs() >= 1).any()
        q_cm, s_cm = quantize(x, group=group, column_major=True)
        assert s_cm.stride() == (1, m) and torch.equal(s_cm, rs) and torch.equal(q_cm.float(), rq.float())


def test_triton_block_gemm_refuses_bad_operands() -> None:
    from kvserving.kernels.triton_fp8_gemm import block_gemm

    codes, scale = fp8_gemm.quantize_blocks(torch.randn(128, 192))
    qa = torch.zeros(2, 192, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 128"):
        block_gemm(qa, torch.ones(2, 2), codes, scale)
    codes, scale = fp8_gemm.quantize_blocks(torch.randn(128, 256))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_gemm(torch.zeros(2, 256), torch.ones(2, 2), codes, scale)
    with pytest.raises(ValueError, match="scales"):
        block_gemm(torch.zeros(2, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 3), codes, scale)


def test_cublas_block_scales_are_the_layout_cublaslt_reads() -> None:
    # the CPU part of the cuBLASLt path (the GEMM itself needs a Hopper GPU): tile scales [N/128, K/128] ->
    # [round_up(K/128, 4), N/128], column-major, the pad rows zero
    scale = torch.arange(1.0, 16.0).reshape(3, 5)
    out = fp8_gemm.cublas_block_scales(scale)
    assert out.shape == (8, 3) and out.stride() == (1, 8) and out.dtype == torch.float32
    assert torch.equal(out[:5], scale.t()) and torch.equal(out[5:], torch.zeros(3, 3))


def test_the_cuda_gemm_refuses_an_unknown_backend_and_cpu_tensors_take_the_torch_path() -> None:
    x = torch.ones(2, 128, dtype=torch.bfloat16)
    assert not fp8_gemm.cuda_supported(x)  # worker/fp8_linear.py then runs the torch reference
    codes, scale = fp8_gemm.quantize_blocks(torch.ones(128, 128))
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_gemm.linear_cuda(x, codes, scale, scheme="block", backend="cutlass")


# -- GPU ----------------------------------------------------------------------------------------------
def _check_cuda_gemm(m: int, n: int, k: int, scheme: str, backend: str, static: bool = False) -> None:
    x = _acts(m, k, seed=n, device="cuda").to(torch.bfloat16)
    w = _weight(n, k, seed=m, device="cuda")
    codes, scale = fp8_gemm.quantize_blocks(w) if scheme == "block" else fp8_gemm.quantize_tensor(w)
    if scheme == "rows":
        scale = scale.expand(n).contiguous()
    input_scale = (x.float().abs().amax() / 448).reshape(()) if static else None
    out = fp8_gemm.linear_cuda(x, codes, scale, scheme=scheme, input_scale=input_scale, backend=backend)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = fp8_gemm.linear_ref(x.float(), codes, scale, scheme=scheme)
    bound = fp8_gemm.gemm_error_bound(x.float(), codes, scale, scheme=scheme, input_scale=input_scale)
    err = (out.float() - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()} at {m}x{n}x{k}"
    # and the same arithmetic as the torch spec of the quantized product, up to output rounding and sum order
    spec = fp8_gemm.linear_quantized_ref(x, codes, scale, scheme=scheme, input_scale=input_scale)
    assert (out.float() - spec).abs().max().item() <= 2.0**-7 * spec.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256, 1000])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B_SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_cuda_per_tensor_gemm_within_bound_at_qwen3_8b_shapes(m: int, n: int, k: int, static: bool) -> None:
    _check_cuda_gemm(m, n, k, "rows", "auto", static=static)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256, 1000])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B_SHAPES)
@pytest.mark.parametrize("backend", ["triton", "cublas", "auto"])
def test_cuda_block_gemm_within_bound_at_qwen3_8b_shapes(m: int, n: int, k: int, backend: str) -> None:
    if backend == "cublas" and not fp8_gemm.cublas_block_supported(0):
        pytest.skip("cuBLASLt's 1x128 x 128x128 scaling runs on sm_90 with cuBLASLt >= 12.9 only")
    _check_cuda_gemm(m, n, k, "block", backend)


@pytest.mark.gpu
def test_cublas_block_scaling_runs_on_hopper() -> None:
    """On an H100/H200 the library path is there (torch 2.13 + cuBLASLt 12.9): the engine's default."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    if not hasattr(torch.nn.functional, "ScalingType"):  # the API itself, not a version number
        pytest.skip(f"torch {torch.__version__} has no block-wise scaled_mm (torch.nn.functional.ScalingType; the GEMMs use Triton)")
    assert fp8_gemm.cublas_block_supported(0)  # a wrong product is a failure here, not a skip of the cublas cases

"""SwiGLU's down projection in one launch with FP8 block weights (``triton_fp8_gemm.gated_linear``,
``fp8_gemm.gated_linear_cuda``, ``Fp8Linear.gated_forward``, ``MLP.forward``).

Where ``linear`` runs the GEMV, the gated launch is the same kernel at the same launch with the product's input
formed in registers exactly as ``triton_norm.silu_mul`` stores it, so its output equals silu_mul then ``linear``
bit for bit; where ``linear`` runs another kernel it declines (None) and the caller runs the pair. On CPU the
kernels run under TRITON_INTERPRET=1 at small shapes; the ``gpu`` test runs the model's MLP on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvserving.kernels import fp8_gemm

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)


def _gate_up_and_weight(m: int, n: int, i: int, *, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate_up [m, 2 i] bf16 (gates of both signs, large enough that silu bends) and an [n, i] weight's codes and
    128 x 128 tile scales."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    gate_up = (torch.randn(m, 2 * i, generator=g) * 3).to(torch.bfloat16)
    codes, scale = fp8_gemm.quantize_blocks(torch.randn(n, i, generator=g) * 0.02)
    return gate_up.to(device), codes.to(device), scale.to(device)


@interpreter_only
@pytest.mark.parametrize(("m", "n", "i"), [(1, 256, 2048), (2, 256, 2048), (3, 256, 2048), (2, 128, 1024)])
def test_the_gated_down_projection_equals_silu_mul_then_linear_where_linear_runs_the_gemv(m: int, n: int, i: int) -> None:
    from kvserving.kernels import triton_fp8_gemm, triton_norm

    gate_up, codes, scale = _gate_up_and_weight(m, n, i)
    launch = triton_fp8_gemm.chosen_launch(m, n, i)
    fused = triton_fp8_gemm.gated_linear(gate_up, codes, scale)
    if not isinstance(launch, triton_fp8_gemm.Gemv):  # 3 tokens: a16 tiles; 2 tokens at (128, 1024): quantized tiles
        assert (m, n) in ((3, 256), (2, 128)) and fused is None
        return
    assert m <= 2 and fused is not None
    plain = triton_fp8_gemm.linear(triton_norm.silu_mul(gate_up), codes, scale)
    assert fused.shape == (m, n) and torch.equal(fused, plain)
    # the gate and up halves are not interchangeable: the sum is of silu(gate) * up, not of the two swapped
    swapped = triton_fp8_gemm.linear(triton_norm.silu_mul(gate_up.roll(i, dims=1)), codes, scale)
    assert not torch.equal(fused, swapped)


@interpreter_only
def test_the_cuda_entry_adds_the_bias_and_declines_other_schemes_and_cublas() -> None:
    from kvserving.kernels import triton_fp8_gemm, triton_norm

    gate_up, codes, scale = _gate_up_and_weight(1, 256, 2048)
    bias = torch.linspace(-1, 1, 256).to(torch.bfloat16)
    out = fp8_gemm.gated_linear_cuda(gate_up, codes, scale, scheme="block", bias=bias)
    assert out is not None
    assert torch.equal(out, triton_fp8_gemm.linear(triton_norm.silu_mul(gate_up), codes, scale) + bias)
    assert fp8_gemm.gated_linear_cuda(gate_up, codes, scale, scheme="block", backend="cublas") is None
    assert fp8_gemm.gated_linear_cuda(gate_up, codes, scale.new_ones(256), scheme="rows") is None
    assert triton_fp8_gemm.gated_linear(gate_up[:, 1:], codes, scale) is None  # not [M, 2 I] for this weight
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_gemm.gated_linear_cuda(gate_up, codes, scale, scheme="block", backend="cutlass")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 16])
def test_gpu_the_mlp_with_fp8_down_weights_forms_swiglu_in_the_gemv_and_equals_the_pair(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Qwen3-8B MLP shape (hidden 4096, intermediate 12288) with FP8 block weights on CUDA: ``MLP.forward``
    equals gate_up, silu_mul and the down projection run one after another, bit for bit, at every M; at 1-2
    tokens (the GEMV) without a silu_mul launch, at 3 and 16 with it."""
    from kvserving.kernels import triton_norm
    from kvserving.worker.fp8_linear import from_linear
    from kvserving.worker.model import MLP, ModelArgs

    args = ModelArgs(model_type="qwen3", vocab_size=1024, hidden_size=4096, intermediate_size=12288, num_layers=1,
                     num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip
    torch.manual_seed(m)
    mlp = MLP(args).to("cuda", torch.bfloat16)
    for name, rows in (("gate_up_proj", [12288, 12288]), ("down_proj", [4096])):
        setattr(mlp, name, from_linear(getattr(mlp, name), rows, weight_format="fp8_block"))
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    silu_calls = []
    silu_mul = triton_norm.silu_mul
    monkeypatch.setattr(triton_norm, "silu_mul", lambda *a, **k: silu_calls.append(1) or silu_mul(*a, **k))
    with torch.no_grad():
        out = mlp(x)
        pair = mlp.down_proj(silu_mul(mlp.gate_up_proj(x)))
    assert torch.equal(out, pair)
    assert len(silu_calls) == (0 if m <= 2 else 1)

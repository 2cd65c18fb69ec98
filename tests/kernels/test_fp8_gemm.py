"""FP8 weight GEMMs (fp8_gemm, triton_fp8_gemm) against their torch references.

Bounds:
- quantizers: E4M3 keeps 4 significant bits, so a dequantized value is within 2^-4 of itself
  (normal range) or 2^-10 * scale (subnormal codes) of the original;
- the Triton block GEMM against ``linear_quantized_ref`` (the same quantized operands, the same
  per-128 scaling, fp32 sums in another order): 1e-5 of the output's largest magnitude in fp32,
  one bf16 ulp of it (2^-7, the interpreter truncates) in bf16;
- the GPU GEMMs against ``linear_ref`` (exact weights, unquantized activations, fp32):
  ``gemm_error_bound`` per element (the activation quantization, bf16 output rounding, fp32 sums);
- the GEMV (M <= 4, activations not quantized) against the dequantized weight times the
  activations in float64 (exact): ``_gemv_bound`` per element, fp32 rounding only (each term
  rounded at most twice, sums of bounded depth) and one bf16 ulp of the output in bf16.

On CPU the kernel runs under TRITON_INTERPRET=1 at tiny sizes; the ``gpu`` tests run the
Qwen3-8B projection shapes through torch._scaled_mm, cuBLASLt's block scaling and Triton.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable

import pytest
import torch

from kvserving.kernels import fp8_gemm
from kvserving.kernels.gemm_plan import gemv_config, tile_config

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)
# Qwen3-8B's projections (N, K): merged q/k/v, o, merged gate/up, down, and k or v alone.
QWEN3_8B_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (1024, 4096), (12288, 4096)]


def _distinct_launches(launch: Callable[[int, int, int], Hashable], rows: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(M, N, K) for each distinct launch ``launch(M, N, K)`` picks at M in ``rows`` and QWEN3_8B_SHAPES[:4] (qkv, o,
    gate_up, down), once each, at the smallest K that picks it. The interpreter tests run a row slice of the weight,
    so two shapes with the same launch and K run the same programs on other values, and a larger K only walks more
    steps a split through them: down (K 12288) takes qkv's or o's launch at every M here (test_tile_config and the
    dispatch test pin them)."""
    cases: dict[tuple[int, Hashable], tuple[int, int, int]] = {}
    for m in rows:
        for n, k in sorted(QWEN3_8B_SHAPES[:4], key=lambda shape: shape[1]):
            cases.setdefault((m, launch(m, n, k)), (m, n, k))
    return list(cases.values())


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
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))  # the same codes, bit for bit
        assert (q.float().abs() < 2.0**-6).any() and (q.float().abs() >= 1).any()
        q_cm, s_cm = quantize(x, group=group, column_major=True)
        assert s_cm.stride() == (1, m) and torch.equal(s_cm, rs) and torch.equal(q_cm.view(torch.uint8), rq.view(torch.uint8))


def test_the_per_128_quantizer_takes_several_groups_a_program_only_where_the_grid_stays_two_programs_an_sm() -> None:
    from kvserving.kernels.triton_fp8_gemm import QUANTIZE_ONE_GROUP_ROWS, QUANTIZE_PROGRAMS, quantize_groups_per_program

    assert (QUANTIZE_PROGRAMS, QUANTIZE_ONE_GROUP_ROWS) == (264, 128)
    # rows -> groups a program for K 4096 (32 groups: qkv, o, gate_up) and K 12288 (96 groups: down)
    got = {m: (quantize_groups_per_program(m, 32), quantize_groups_per_program(m, 96)) for m in (1, 16, 64, 128, 129, 256, 4096)}
    assert got == {1: (1, 1), 16: (1, 1), 64: (1, 1), 128: (1, 1), 129: (8, 16), 256: (16, 16), 4096: (16, 16)}
    assert quantize_groups_per_program(4096, 35) == 1  # an odd count: one group a program
    assert quantize_groups_per_program(4096, 6) == 2  # a power of two dividing the count


@interpreter_only
@pytest.mark.parametrize(("m", "k", "per"), [(1, 4096, 16), (3, 12288, 16), (2, 384, 1), (2, 768, 2)])
def test_the_per_128_quantizer_over_several_groups_a_program_equals_the_torch_quantizer_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, m: int, k: int, per: int
) -> None:
    """With the row and grid floors lowered, a program takes up to 16 groups of its row (2,048 values, a
    [16, 128] tile with one scale a tile row): the same codes and scales as one group a program, signed zeros and an
    all-zero group among them."""
    from kvserving.kernels import triton_fp8_gemm
    from kvserving.kernels.triton_fp8_gemm import quantize, quantize_groups_per_program

    monkeypatch.setattr(triton_fp8_gemm, "QUANTIZE_PROGRAMS", 1)
    monkeypatch.setattr(triton_fp8_gemm, "QUANTIZE_ONE_GROUP_ROWS", 0)
    assert quantize_groups_per_program(m, k // 128) == per
    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 4, (m, k), generator=g).float())).to(torch.bfloat16)
    x[:, ::7] = 0.0
    x[:, 3::11] = -0.0
    x[0, 128:256] = 0.0
    for column_major in (False, True):
        q, s = quantize(x, group=128, column_major=column_major)
        rq, rs = fp8_gemm.quantize_groups(x)
        assert torch.equal(s, rs) and s[0, 1].item() == 1.0
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert (q.view(torch.uint8) == 0x80).any()


@interpreter_only
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("k", [4096, 12288, 4096 + 384])
def test_triton_quantizers_equal_the_torch_quantizers_bit_for_bit_at_model_widths(m: int, k: int) -> None:
    """K 4096 (one step), 12288 (three 4096 steps: the width is no power of two) and 4480 (35 steps of 128):
    per token and per 128, with signed zeros and an all-zero row among the values. A program quantizes one row
    (per token) or one group of it (per 128, up to QUANTIZE_ONE_GROUP_ROWS rows), the same program at every M."""
    from kvserving.kernels.triton_fp8_gemm import quantize, quantize_chunk

    assert (quantize_chunk(4096), quantize_chunk(12288), quantize_chunk(4480), quantize_chunk(300)) == (4096, 4096, 128, 128)
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 4, (m, k), generator=g).float())).to(torch.bfloat16)
    x[:, ::7] = 0.0
    x[:, 3::11] = -0.0
    x[-1] = 0.0 if m > 1 else x[-1]
    for group in (None, 128) if m <= 2 else (None,):  # per 128: M x K/128 programs, slow in the interpreter
        q, s = quantize(x, group=group)
        rq, rs = fp8_gemm.quantize_rows(x) if group is None else fp8_gemm.quantize_groups(x)
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert (q.view(torch.uint8) == 0x80).any()  # negative zeros kept


def test_tile_config_at_the_qwen3_8b_shapes() -> None:
    from kvserving.kernels.gemm_plan import Tiles, tile_config

    rows = (1, 2, 4, 16, 17, 64, 65, 128, 129, 256, 257, 512, 513)
    got = {(n, k): [tile_config(m, n, k).label for m in rows] for n, k in QWEN3_8B_SHAPES[:4]}
    mid = ["64x64w4s4k1"] * 2  # 65-128 rows
    wide = ["64x128w4s4k1"] * 4  # 129-512 rows: 64 x 128 tiles, one an SM or more
    split = ["64x128w4s4k2"] * 2 + ["64x128w4s4k1"] * 2  # 3-4 row tiles x 32 column tiles < 132: K in two
    prefill = ["128x128w8s3k1"]
    small = ["16x64w4s4k4"] * 4 + ["64x64w4s4k4"] * 2  # 1-64 rows: K split in 4 (qkv 96 column tiles x 4 = 384 programs)
    assert got == {
        (6144, 4096): small + mid + wide + prefill,
        (4096, 4096): small + mid + split + prefill,  # 64 x 4 = 256 (x 8 = 512 is past the grid)
        (24576, 4096): ["16x64w4s4k1"] * 4 + ["64x64w4s4k1"] * 2 + mid + wide + prefill,  # 384 column tiles: the grid is full
        (4096, 12288): small + mid + split + prefill,  # 96 K steps, 24 a split
    }
    assert Tiles.parse(" 16x64w2s6k3") == Tiles(16, 64, 2, 6, 3) and Tiles.parse("16x64w2s6k3").label == "16x64w2s6k3"
    for bad in ("16x48w4s4k1", "16x32w3s4k1", "16x32w4s9k1", "16x32w4s4k0", "16x32"):
        with pytest.raises(ValueError):
            Tiles.parse(bad)


@interpreter_only
@pytest.mark.parametrize(("m", "n", "k"), _distinct_launches(tile_config, (1, 2, 4, 16, 64)))
def test_triton_block_gemm_at_the_tiles_chosen_for_qwen3_8b_shapes(m: int, n: int, k: int) -> None:
    """Each launch shape ``tile_config`` picks at the full shapes (K split in 4 or not, 16- and 64-row tiles), run on a
    192-row slice of such a weight (the interpreter is slow): every K split, the partials' sum, a last weight scale
    tile half full."""
    from kvserving.kernels.gemm_plan import tiles_override
    from kvserving.kernels.triton_fp8_gemm import block_gemm

    x = _acts(m, k, seed=n)
    codes, scale = fp8_gemm.quantize_blocks(_weight(192, k, seed=m))
    qa, sa = fp8_gemm.quantize_groups(x)
    ref = fp8_gemm.linear_quantized_ref(x, codes, scale, scheme="block")
    with tiles_override(tile_config(m, n, k)):
        out = block_gemm(qa, sa, codes, scale, out_dtype=torch.float32)
        out_bf16 = block_gemm(qa, sa, codes, scale)
    top = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-5 * top
    assert (out_bf16.float() - ref).abs().max().item() <= 2.0**-7 * top


@interpreter_only
@pytest.mark.parametrize("label", ["16x32w4s3k1", "16x64w4s4k3", "16x128w8s6k1", "16x32w2s2k5", "32x64w4s3k2", "64x128w4s4k2"])
def test_triton_block_gemm_matches_its_torch_reference_under_every_tile_shape(label: str) -> None:
    """Splits that do not divide the K steps (5 splits of 3 steps: two are empty and write zeros)."""
    from kvserving.kernels.gemm_plan import Tiles, tiles_override
    from kvserving.kernels.triton_fp8_gemm import block_gemm

    for m, n, k in ((1, 256, 384), (3, 200, 384), (16, 128, 640)):
        x = _acts(m, k, seed=n)
        codes, scale = fp8_gemm.quantize_blocks(_weight(n, k, seed=m))
        qa, sa = fp8_gemm.quantize_groups(x)
        ref = fp8_gemm.linear_quantized_ref(x, codes, scale, scheme="block")
        with tiles_override(Tiles.parse(label)):
            out = block_gemm(qa, sa, codes, scale, out_dtype=torch.float32)
        assert out.shape == (m, n) and (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def _gemv_bound(x: torch.Tensor, w: torch.Tensor, launch: object, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound [M, N] on |gemv - x @ w^T| (w [N, K] float64: the weight the codes and scales stand for, or
    the bf16 weight; the reference in float64 is exact). Each term x_k * s * q_k rounds at most twice in fp32 (x * s,
    then the product unless fused) and the fp32 sums form a tree of depth at most BLOCK_K (a step's terms, in any
    order) + K / BLOCK_K (the steps) + SPLIT_K (the partials' sum), so by Higham's bound for summation trees the
    fp32 result is within gamma_(depth + 2) * sum_k |x_k w_nk|; a bf16 output adds one bf16 ulp (2^-7 of the value:
    the interpreter truncates)."""
    k = x.shape[1]
    depth = launch.block_k + k // launch.block_k + launch.split_k + 2  # type: ignore[attr-defined]
    u = 2.0**-24
    e32 = depth * u / (1 - depth * u) * (x.double().abs() @ w.abs().t())
    if out_dtype == torch.float32:
        return e32
    return e32 + 2.0**-7 * ((x.double() @ w.t()).abs() + e32)


def _check_gemv(m: int, n: int, k: int, launch: object, *, seed: int, out_dtype: torch.dtype = torch.float32,
                x_dtype: torch.dtype = torch.bfloat16, weight: str = "fp8") -> None:  # fmt: skip
    """The GEMV on an fp8 block-scaled weight (``weight`` "fp8") or a bf16 one ("bf16", no scales)."""
    from kvserving.kernels.gemm_plan import tiles_override
    from kvserving.kernels.triton_fp8_gemm import gemv

    x = _acts(m, k, seed=seed).to(x_dtype)
    if weight == "fp8":
        codes, scale = fp8_gemm.quantize_blocks(_weight(n, k, seed=seed + m))
        exact = fp8_gemm.dequantize(codes, scale, scheme="block").double()
    else:
        codes, scale = _weight(n, k, seed=seed + m).to(torch.bfloat16), None
        exact = codes.double()
    with tiles_override(launch):  # type: ignore[arg-type]
        out = gemv(x, codes, scale, out_dtype=out_dtype)
    _assert_exact_within(out, x, exact, launch, out_dtype)


def _assert_exact_within(out: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, launch: object, out_dtype: torch.dtype) -> None:
    """``out`` is x times the exact weight ``w64`` (float64) within ``_gemv_bound``, and the fp32 bound is tight: a
    lost or doubled K step (or 128-column group), or a quantized x (2^-4 a value), moves outputs by far more."""
    assert out.shape == (x.shape[0], w64.shape[0]) and out.dtype == out_dtype
    ref = x.double() @ w64.t()
    err = (out.double() - ref).abs()
    bound = _gemv_bound(x, w64, launch, out_dtype)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g} at M x N {tuple(out.shape)}, K {x.shape[1]}, {launch}"
    if out_dtype == torch.float32:
        assert bound.max().item() < 2e-3 * ref.abs().max().item()


def _assert_gpu_exact_within(out: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, launch: object) -> None:
    """A GPU product with fp32 sums and a bf16 output against the exact one (``w64``: the weight in float64): the
    GEMV's fp32 bound and the bf16 output's rounding to nearest (2^-8)."""
    exact = x.double() @ w64.t()
    e32 = _gemv_bound(x, w64, launch, torch.float32)
    assert ((out.double() - exact).abs() <= e32 + 2.0**-8 * (exact.abs() + e32)).all()


@interpreter_only
@pytest.mark.parametrize(("m", "n", "k"), _distinct_launches(gemv_config, (1, 2, 3, 4)))
def test_gemv_equals_the_dequantized_product_at_the_launch_chosen_for_qwen3_8b_shapes(m: int, n: int, k: int) -> None:
    """Each launch ``gemv_config`` picks at the full shapes (at M 3-4 K splits 2, 4 and 1) on a 128-row slice of such
    a weight."""
    _check_gemv(m, 128, k, gemv_config(m, n, k), seed=n + k)


@interpreter_only
@pytest.mark.parametrize("label", ["g32x512w4s2k1", "g32x256w4s1k3", "g16x128w2s3k5", "g8x1024w8s2k2", "g64x128w4s1k16"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gemv_equals_the_dequantized_product_at_uneven_n_under_every_split(label: str, m: int) -> None:
    """N 136 (a last tile of 8 rows, alone in its 128-row scale tile) and 72; K 1024 in 2-8 steps, split 1-16 ways
    (3, 5 and 16 splits do not divide the steps: some splits hold one step less, some none and write zeros);
    bf16 and fp32 outputs, bf16 and fp32 activations; M 1 and 2 (the dispatch's) and 4 (every row's accumulator:
    M 3 runs the launches the dispatch picks, in the test above)."""
    from kvserving.kernels.gemm_plan import Gemv

    launch = Gemv.parse(label)
    _check_gemv(m, 136, 1024, launch, seed=m, out_dtype=torch.bfloat16)
    _check_gemv(m, 72, 1024, launch, seed=m + 7, x_dtype=torch.float32)


@interpreter_only
@pytest.mark.parametrize("label", ["g8x2048w4s1k1", "g8x1024w4s1k2", "g32x256w4s1k3", "g16x128w2s3k5"])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_gemv_on_a_bf16_weight_equals_the_exact_product(label: str, m: int) -> None:
    """The unscaled GEMV (bf16 weight, no tile scales: what a bf16 model's projections run at 1-2 tokens) at the
    dispatch's M = 1 and 2 shapes and uneven splits; N 72 and 40 (last tiles part-used; no 128-row scale tiles to
    cross), K 4096 and 2048; bf16 and fp32 outputs and activations. A weight read through the scaled path (a tile
    scale taken from the weight's own bytes) would miss the bound by orders of magnitude."""
    from kvserving.kernels.gemm_plan import Gemv

    launch = Gemv.parse(label)
    _check_gemv(m, 72, 4096, launch, seed=m, out_dtype=torch.bfloat16, weight="bf16")
    _check_gemv(m, 40, 2048, launch, seed=m + 7, x_dtype=torch.float32, weight="bf16")


@interpreter_only
@pytest.mark.parametrize("label", ["16x64w4s4k1", "32x64w4s3k3", "64x32w4s4k2b64", "16x128w8s2k5b32"])
@pytest.mark.parametrize("m", [3, 17, 64])
def test_bf16_block_gemm_equals_the_exact_product_under_every_tile_shape(label: str, m: int) -> None:
    """The block GEMM on bf16 values (no scales: a bf16 model's projections at decode batch sizes): N 136 (a last
    column tile part-used), K 1024 in 128-, 64- and 32-wide steps, split 1-5 ways (3 and 5 do not divide the
    steps: some splits hold one step less, some none and write zeros), M 3 to 64 in row tiles of 16 to 64; bf16
    and fp32 outputs. Fp32 sums: the GEMV's bound (``_gemv_bound``, depth from the steps and splits)."""
    from kvserving.kernels.gemm_plan import Tiles, tiles_override
    from kvserving.kernels.triton_fp8_gemm import bf16_gemm

    launch = Tiles.parse(label)
    for out_dtype, n, seed in ((torch.bfloat16, 136, m), (torch.float32, 72, m + 7)):
        x = _acts(m, 1024, seed=seed).to(torch.bfloat16)
        w = _weight(n, 1024, seed=seed + m).to(torch.bfloat16)
        with tiles_override(launch):
            out = bf16_gemm(x, w, out_dtype=out_dtype)
        _assert_exact_within(out, x, w.double(), launch, out_dtype)


@interpreter_only
@pytest.mark.parametrize("label", ["16x64w4s4k1a16", "32x64w4s3k3a16", "64x32w4s4k2a16", "16x128w8s2k5a16"])
@pytest.mark.parametrize("m", [3, 17, 64])
def test_a16_block_gemm_equals_the_dequantized_product_under_every_tile_shape(label: str, m: int) -> None:
    """FP8 block-scaled weights times bf16 activations as they are (each e4m3 tile widened to bf16, exact): the
    dequantized weight times x in float64 within the GEMV's fp32 bound; N 136 and 72 (last tiles part-used, a
    128-row scale tile holding 8 rows), K 1024 split 1-5 ways; through ``linear`` (the dispatch reads ``a16``)."""
    from kvserving.kernels.gemm_plan import Tiles, tiles_override
    from kvserving.kernels.triton_fp8_gemm import linear

    launch = Tiles.parse(label)
    for out_dtype, n, seed in ((torch.bfloat16, 136, m), (torch.float32, 72, m + 7)):
        x = _acts(m, 1024, seed=seed).to(torch.bfloat16)
        codes, scale = fp8_gemm.quantize_blocks(_weight(n, 1024, seed=seed + m))
        exact = fp8_gemm.dequantize(codes, scale, scheme="block").double()
        with tiles_override(launch):
            out = linear(x, codes, scale, out_dtype=out_dtype)
        _assert_exact_within(out, x, exact, launch, out_dtype)


def test_bf16_tile_config_takes_one_row_tile_and_splits_k_to_one_program_an_sm() -> None:
    """One row tile holds M (16, 64, 128); 64 columns; K split in powers of two while the grid stays within
    BF16_PROGRAMS (132) with >= 8 steps a split: at the Qwen3-8B shapes qkv none (96 column tiles), o 2 (64 x 2 =
    128 programs), gate_up none (384 column tiles), down 2."""
    from kvserving.kernels.gemm_plan import bf16_tile_config

    got = {(n, k): [bf16_tile_config(m, n, k).label for m in (3, 16, 17, 64, 100)] for n, k in QWEN3_8B_SHAPES[:4]}
    assert got == {
        (6144, 4096): ["16x64w4s4k1", "16x64w4s4k1", "64x64w4s4k1", "64x64w4s4k1", "128x64w4s4k1"],
        (4096, 4096): ["16x64w4s4k2", "16x64w4s4k2", "64x64w4s4k2", "64x64w4s4k2", "128x64w4s4k2"],
        (24576, 4096): ["16x64w4s4k1", "16x64w4s4k1", "64x64w4s4k1", "64x64w4s4k1", "128x64w4s4k1"],
        (4096, 12288): ["16x64w4s4k2", "16x64w4s4k2", "64x64w4s4k2", "64x64w4s4k2", "128x64w4s4k2"],
    }


def test_bf16_launch_leaves_a_grid_that_idles_sms_to_cublas() -> None:
    """At 3-16 tokens the block GEMM takes o, gate_up and down of the Qwen3-8B shape (128, 384 and 128 programs) and
    leaves qkv (96 programs: 36 of 132 SMs idle) to cuBLAS."""
    from kvserving.kernels.gemm_plan import bf16_launch

    got = {(n, k): [getattr(bf16_launch(m, n, k), "label", None) for m in (3, 16)] for n, k in QWEN3_8B_SHAPES[:4]}
    assert got == {
        (6144, 4096): [None, None],
        (4096, 4096): ["16x64w4s4k2", "16x64w4s4k2"],
        (24576, 4096): ["16x64w4s4k1", "16x64w4s4k1"],
        (4096, 12288): ["16x64w4s4k2", "16x64w4s4k2"],
    }


def test_block_gemm_refuses_a_k_step_other_than_its_scale_group() -> None:
    from kvserving.kernels.gemm_plan import Tiles, tiles_override
    from kvserving.kernels.triton_fp8_gemm import block_gemm

    codes, scale = fp8_gemm.quantize_blocks(_weight(128, 256, seed=0))
    qa, sa = fp8_gemm.quantize_activations(_acts(2, 256, seed=1), scheme="block")
    for label in ("16x64w4s4k1b64", "16x64w4s4k1a16"):
        with tiles_override(Tiles.parse(label)), pytest.raises(ValueError, match="scale group, 128"):
            block_gemm(qa, sa, codes, scale)


def test_tiles_labels_read_back_with_and_without_a_k_step() -> None:
    from kvserving.kernels.gemm_plan import Tiles

    assert Tiles.parse("64x64w4s4k2b64") == Tiles(64, 64, 4, 4, 2, 64) and Tiles(64, 64, 4, 4, 2, 64).label == "64x64w4s4k2b64"
    assert Tiles(16, 64, 4, 4, 1).label == "16x64w4s4k1"
    assert (
        Tiles.parse("16x64w4s4k4a16") == Tiles(16, 64, 4, 4, 4, a16=True) and Tiles(16, 64, 4, 4, 4, 64, True).label == "16x64w4s4k4b64a16"
    )
    with pytest.raises(ValueError, match="block_k"):
        Tiles(16, 64, 4, 4, 1, 48)


@interpreter_only
@pytest.mark.parametrize("weight", ["fp8", "bf16"])
@pytest.mark.parametrize(("m", "label"), [(1, "g8x1024w4s1k1"), (2, "g8x512w4s1k2"), (3, "g32x256w4s1k3")])
def test_the_gated_gemv_equals_the_gemv_of_silu_mul_bit_for_bit(weight: str, m: int, label: str) -> None:
    """``gated``: x is SwiGLU's [gate | up] and the GEMV forms silu(gate) * up itself, rounded as ``silu_mul`` stores
    it, so the output equals the GEMV of ``silu_mul``'s output exactly (same inputs, same sum order); a gate and up
    taken the other way round, or the product left unrounded, changes it."""
    from kvserving.kernels import triton_norm
    from kvserving.kernels.gemm_plan import Gemv, tiles_override
    from kvserving.kernels.triton_fp8_gemm import gemv

    k = 1024
    gate_up = (torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
    if weight == "fp8":
        w, scale = fp8_gemm.quantize_blocks(_weight(72, k, seed=m))
    else:
        w, scale = _weight(72, k, seed=m).to(torch.bfloat16), None
    with tiles_override(Gemv.parse(label)):
        fused = gemv(gate_up, w, scale, out_dtype=torch.float32, gated=True)
        plain = gemv(triton_norm.silu_mul(gate_up), w, scale, out_dtype=torch.float32)
        swapped = gemv(triton_norm.silu_mul(gate_up.roll(k, dims=1)), w, scale, out_dtype=torch.float32)
    assert fused.shape == (m, 72) and torch.equal(fused, plain) and not torch.equal(fused, swapped)
    with pytest.raises(ValueError, match=r"gated x must be \[M, 2 K\]"):
        gemv(gate_up[:, 1:], w, scale, gated=True)


def test_the_dispatch_takes_the_gemv_at_m_1_and_at_m_2_and_unquantized_activations_at_m_3_4_where_the_block_gemm_splits_k() -> None:
    from kvserving.kernels.gemm_plan import Gemv, Tiles, gemv_config, gemv_split, launch_config, tile_config

    got = {(n, k): [launch_config(m, n, k).label for m in (1, 2, 3, 4, 5)] for n, k in QWEN3_8B_SHAPES[:4]}
    assert got == {
        (6144, 4096): ["g8x1024w4s1k1"] * 2 + ["16x64w4s4k4a16"] * 2 + ["16x64w4s4k4"],  # 768 column tiles of 8 rows: no K split
        (4096, 4096): ["g8x2048w4s1k1", "g8x1024w4s1k1"] + ["16x64w4s4k4a16"] * 2 + ["16x64w4s4k4"],  # 2048-wide steps at M 1
        (24576, 4096): ["g8x1024w4s1k1"] + ["16x64w4s4k1"] * 4,  # at M 2 the block GEMM's 384 column tiles fill the grid
        (4096, 12288): ["g8x2048w4s1k1", "g8x1024w4s1k1"] + ["16x64w4s4k4a16"] * 2 + ["16x64w4s4k4"],  # 6 / 12 steps
    }
    for n, k in QWEN3_8B_SHAPES[:4]:
        assert launch_config(5, n, k) == tile_config(5, n, k) and isinstance(launch_config(5, n, k), Tiles)
        assert not fp8_gemm.unquantized(5, n, k) and fp8_gemm.unquantized(3, n, k) == (n != 24576)
        assert fp8_gemm.unquantized(2, n, k) == (n != 24576) and fp8_gemm.unquantized(1, n, k)
    assert gemv_config(1, 512, 384).label == "g8x128w4s1k1"  # K 384: steps of 128; 64 tiles, 3 steps: no split
    assert gemv_config(1, 256, 4096).label == "g8x2048w4s1k1"  # 32 tiles, 2 steps: too few to split
    assert gemv_config(2, 256, 4096).label == "g8x1024w4s1k2"  # 32 tiles, 4 steps: split in two
    assert gemv_config(3, 6144, 4096).label == "g32x512w4s1k2"  # M 3-4: 32-row tiles
    assert isinstance(launch_config(2, 256, 4096), Gemv) and isinstance(launch_config(2, 256, 1024), Tiles)  # split 4 / none
    assert gemv_split(8, 3) == 1 and gemv_split(8, 64) == 16 and gemv_split(8, 16) == 8
    assert Gemv.parse(" g16x256w8s3k5") == Gemv(16, 256, 8, 3, 5) and Gemv(16, 256, 8, 3, 5).label == "g16x256w8s3k5"
    for bad in ("g24x512w4s2k1", "g32x384w4s2k1", "g32x512w3s2k1", "g32x512w4s9k1", "g32x512w4s2k0", "32x512w4s2k1"):
        with pytest.raises(ValueError):
            Gemv.parse(bad)


@interpreter_only
def test_linear_runs_the_dispatched_kernel_and_the_override_picks_the_other() -> None:
    """M 2 at K 2048 (the block GEMM would split K): the GEMV (x unquantized); under a ``Tiles`` override the
    quantizer and the block GEMM (x quantized per 128: the quantized reference); M 5: the block GEMM."""
    from kvserving.kernels.gemm_plan import Gemv, Tiles, launch_config, tiles_override
    from kvserving.kernels.triton_fp8_gemm import linear

    codes, scale = fp8_gemm.quantize_blocks(_weight(128, 2048, seed=3))
    assert isinstance(launch_config(2, 128, 2048), Gemv) and isinstance(launch_config(5, 128, 2048), Tiles)
    for m in (2, 5):
        x = _acts(m, 2048, seed=m).to(torch.bfloat16)
        exact = x.double() @ fp8_gemm.dequantize(codes, scale, scheme="block").double().t()
        spec = fp8_gemm.linear_quantized_ref(x, codes, scale, scheme="block").double()
        top = exact.abs().max().item()
        out = linear(x, codes, scale, out_dtype=torch.float32).double()
        if m == 2:
            assert (out - exact).abs().max().item() <= 1e-5 * top < (spec - exact).abs().max().item()
            with tiles_override(Tiles(16, 64, 4, 4, 1)):
                out = linear(x, codes, scale, out_dtype=torch.float32).double()
        assert (out - spec).abs().max().item() <= 1e-5 * top < (out - exact).abs().max().item()


@interpreter_only
@pytest.mark.parametrize("m", [5, 31, 32, 64, 65])
def test_linear_launches_the_block_gemm_with_the_pdl_choice_of_the_device_and_the_quantizer_so_at_32_to_64_rows(
    m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantizer + block GEMM: the block GEMM takes ``triton_pdl.resolve``'s choice for x's device at every M, the
    quantizer at 32-64 rows only (plain at any other M); the kernels run plain here (the interpreter has no
    ``griddepcontrol``), so the output is the quantized reference either way."""
    from kvserving.kernels import gemm_plan, triton_fp8_gemm, triton_pdl

    # K 256, two groups of 128: which launches ``linear`` makes and the PDL choice each takes depend on M and the
    # device only, and the interpreter runs the quantizer's M x K/128 programs one by one.
    codes, scale = fp8_gemm.quantize_blocks(_weight(128, 256, seed=3))
    x = _acts(m, 256, seed=5).to(torch.bfloat16)
    spec = fp8_gemm.linear_quantized_ref(x, codes, scale, scheme="block").double()
    quantize, block_gemm = triton_fp8_gemm.quantize, triton_fp8_gemm.block_gemm
    assert not gemm_plan.launch_config(m, 128, 256).a16  # the quantized path at every M here
    # The recorders drop ``pdl``, so the quantizer runs plain on the same x under both choices: it runs once and
    # the second choice gets the same codes and scales.
    quantized: list[tuple[torch.Tensor, torch.Tensor]] = []
    for choice in (False, True):
        asked: list[tuple[str, bool]] = []

        def quantize_rec(*args: object, pdl: bool = False, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
            asked.append(("quantize", pdl))
            if not quantized:
                quantized.append(quantize(*args, **kw))  # type: ignore[arg-type]
            return quantized[0]

        def block_gemm_rec(*args: object, pdl: bool = False, **kw: object) -> torch.Tensor:
            asked.append(("block_gemm", pdl))
            return block_gemm(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(triton_pdl, "resolve", lambda pdl, device, c=choice: c if pdl is None else pdl)
        monkeypatch.setattr(triton_fp8_gemm, "quantize", quantize_rec)
        monkeypatch.setattr(triton_fp8_gemm, "block_gemm", block_gemm_rec)
        out = triton_fp8_gemm.linear(x, codes, scale, out_dtype=torch.float32).double()
        assert asked == [("quantize", choice and 32 <= m <= 64), ("block_gemm", choice)]
        assert (out - spec).abs().max().item() <= 1e-5 * spec.abs().max().item()


def test_gemv_refuses_bad_operands() -> None:
    from kvserving.kernels.gemm_plan import Gemv, tiles_override
    from kvserving.kernels.triton_fp8_gemm import gemv

    codes, scale = fp8_gemm.quantize_blocks(torch.randn(128, 256))
    with pytest.raises(ValueError, match="M <= 4"):
        gemv(torch.zeros(5, 256), codes, scale)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        gemv(torch.zeros(2, 256, dtype=torch.float16), codes, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemv(torch.zeros(2, 256), codes.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        gemv(torch.zeros(2, 256), codes, scale[:, :1])
    with pytest.raises(ValueError, match="BLOCK_K 512 must divide K = 256"), tiles_override(Gemv(32, 512, 4)):
        gemv(torch.zeros(2, 256), codes, scale)
    assert gemv(torch.zeros(0, 256), codes, scale).shape == (0, 128)
    with pytest.raises(ValueError, match="unscaled weight must be bfloat16"):  # codes without their scales
        gemv(torch.zeros(2, 256), codes, None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # a bf16 weight with scales
        gemv(torch.zeros(2, 256), codes.to(torch.bfloat16), scale)
    with pytest.raises(ValueError, match="unscaled weight must be bfloat16"):
        gemv(torch.zeros(2, 256), torch.zeros(128, 384, dtype=torch.bfloat16), None)


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
    if scheme == "block" and backend != "cublas" and fp8_gemm.unquantized(m, n, k):
        # the GEMV or the a16 block GEMM: activations not quantized, only the fp32 sums and the bf16 output round (to
        # nearest on the GPU: 2^-8)
        from kvserving.kernels.gemm_plan import launch_config

        _assert_gpu_exact_within(out, x, fp8_gemm.dequantize(codes, scale, scheme="block").double(), launch_config(m, n, k))
        return
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
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 64, 256, 1000])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B_SHAPES)
@pytest.mark.parametrize("backend", ["triton", "cublas", "auto"])
def test_cuda_block_gemm_within_bound_at_qwen3_8b_shapes(m: int, n: int, k: int, backend: str) -> None:
    if backend == "cublas" and not fp8_gemm.cublas_block_supported(0):
        pytest.skip("cuBLASLt's 1x128 x 128x128 scaling does not run here (sm_90 and a torch whose cuBLASLt takes it only)")
    _check_cuda_gemm(m, n, k, "block", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256, 1000])
@pytest.mark.parametrize("k", [4096, 12288])
def test_gpu_per_128_quantizer_equals_the_torch_quantizer_bit_for_bit(m: int, k: int) -> None:
    """The launch ``quantize`` picks at decode and prefill sizes (1 to 16 groups a program) against the torch spec."""
    from kvserving.kernels.triton_fp8_gemm import quantize

    x = _acts(m, k, seed=k, device="cuda").to(torch.bfloat16)
    x[:, ::7] = 0.0
    x[0, :128] = 0.0
    q, s = quantize(x, group=128)
    rq, rs = fp8_gemm.quantize_groups(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
def test_cublas_block_scaling_runs_on_hopper() -> None:
    """On an H100/H200 the library path is there (torch 2.13 + cuBLASLt 12.9): the engine's default."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    if not hasattr(torch.nn.functional, "ScalingType"):  # the API itself, not a version number
        pytest.skip(f"torch {torch.__version__} has no block-wise scaled_mm (torch.nn.functional.ScalingType; the GEMMs use Triton)")
    try:
        out = fp8_gemm.cublas_block_probe(0)
    except (RuntimeError, NotImplementedError) as exc:  # a library that refuses the call: the GEMMs use Triton
        pytest.skip(f"torch {torch.__version__} refuses block-wise scaled_mm here: {str(exc).splitlines()[0][:160]}")
    # a library that runs the call must get it right: a wrong product is a failure, not a skip of the cublas cases
    assert torch.equal(out.float(), torch.full((3, 256), 256.0, device="cuda"))
    assert fp8_gemm.cublas_block_supported(0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 16, 17, 64, 65])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B_SHAPES[:4] + [(151936, 4096)])
def test_gpu_bf16_product_runs_triton_at_up_to_sixty_four_tokens_within_fp32_rounding(
    m: int, n: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.product`` (``KVSERVING_BF16_GEMV=1``, the default) at the Qwen3-8B projections and a 151,936-row weight:
    the GEMV at M <= 2, in a CUDA graph's pass (``graph_pass``) the bf16 block GEMM at 3-64 where ``bf16_launch`` has
    a launch (fp32 sums; the bf16 output rounds to nearest, 2^-8), cuBLAS elsewhere, at M 65 and at 3-64 run eagerly
    (bit-equal to ``F.linear``). Which kernel ran is counted: at M >= 3 the block GEMM's bf16 output often equals
    cuBLAS's bit for bit (both sum on the tensor cores)."""
    import torch.nn.functional as F

    from kvserving.kernels import triton_fp8_gemm
    from kvserving.kernels.gemm_plan import bf16_launch, gemv_config
    from kvserving.worker import model

    calls = {"gemv": 0, "bf16_gemm": 0}
    for name in calls:
        kernel = getattr(triton_fp8_gemm, name)

        def counted(*args: object, _name: str = name, _kernel: object = kernel, **kw: object) -> torch.Tensor:
            calls[_name] += 1
            return _kernel(*args, **kw)  # type: ignore[operator,no-any-return]

        monkeypatch.setattr(triton_fp8_gemm, name, counted)
    monkeypatch.setenv("KVSERVING_BF16_GEMV", "1")
    model._gemv_kernels.cache_clear()
    try:
        x = _acts(m, k, seed=n, device="cuda").to(torch.bfloat16)
        w = _weight(n, k, seed=m, device="cuda").to(torch.bfloat16)
        if m > model.BF16_GEMV_ROWS:  # run eagerly: cuBLAS
            assert torch.equal(model.product(x, w), F.linear(x, w)) and calls == {"gemv": 0, "bf16_gemm": 0}
        with model.graph_pass():
            out = model.product(x, w)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        launch = gemv_config(m, n, k) if m <= model.BF16_GEMV_ROWS else bf16_launch(m, n, k)
        if m > model.BF16_BLOCK_ROWS or launch is None:
            assert calls == {"gemv": 0, "bf16_gemm": 0} and torch.equal(out, F.linear(x, w))
            return
        assert calls == ({"gemv": 1, "bf16_gemm": 0} if m <= model.BF16_GEMV_ROWS else {"gemv": 0, "bf16_gemm": 1})
        _assert_gpu_exact_within(out, x, w.double(), launch)
        if n == 4096:  # the down projection's shape (and o's): SwiGLU formed inside at M <= 2, equal to the unfused pair
            gate_up = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
            from kvserving.kernels import triton_norm

            fused = model.gated_product(gate_up, w)
            if m > model.BF16_GEMV_ROWS:
                assert fused is None
            else:
                assert fused is not None and torch.equal(fused, model.product(triton_norm.silu_mul(gate_up), w))
    finally:
        model._gemv_kernels.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 16, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B_SHAPES[:4])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_bf16_block_gemm_within_fp32_rounding_at_qwen3_8b_shapes(m: int, n: int, k: int, pdl: bool) -> None:
    """The bf16 block GEMM at ``bf16_tile_config``'s launch (bf16 products on the tensor cores, fp32 sums) against
    the exact product: the GEMV's bound (fp32 sums of bounded depth) and the bf16 output's rounding (2^-8)."""
    from kvserving.kernels.gemm_plan import bf16_tile_config
    from kvserving.kernels.triton_fp8_gemm import bf16_gemm

    x = _acts(m, k, seed=n, device="cuda").to(torch.bfloat16)
    w = _weight(n, k, seed=m, device="cuda").to(torch.bfloat16)
    out = bf16_gemm(x, w, pdl=pdl)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _assert_gpu_exact_within(out, x, w.double(), bf16_tile_config(m, n, k))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 16, 64])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B_SHAPES[:4])
@pytest.mark.parametrize("label", ["16x64w4s4k4a16", "64x64w4s4k2a16", "16x128w8s4k2a16"])
def test_gpu_a16_block_gemm_within_fp32_rounding_at_qwen3_8b_shapes(m: int, n: int, k: int, label: str) -> None:
    """FP8 block weights times bf16 activations as they are, on the tensor cores: the dequantized product within
    the GEMV's fp32 bound and the bf16 output's rounding (2^-8)."""
    from kvserving.kernels.gemm_plan import Tiles, tiles_override
    from kvserving.kernels.triton_fp8_gemm import block_gemm_a16

    x = _acts(m, k, seed=n, device="cuda").to(torch.bfloat16)
    codes, scale = fp8_gemm.quantize_blocks(_weight(n, k, seed=m, device="cuda"))
    launch = Tiles.parse(label)
    with tiles_override(launch):
        out = block_gemm_a16(x, codes, scale)
    _assert_gpu_exact_within(out, x, fp8_gemm.dequantize(codes, scale, scheme="block").double(), launch)

"""The paged extend (chunked-prefill) kernel against the dequantize-then-attend reference and fp64 attention.

On CPU the kernel runs under TRITON_INTERPRET=1 with the portable decoders, on
tiny shapes (head_dim 64, 2 kv heads, pages of 8); the ``gpu`` tests run real
shapes (head_dim 128, 8 kv heads x 4, pages of 16 / 32) with the
inline-assembly decoders. Bounds as for decode (test_triton_paged.py): the
kernel dequantizes to fp16 (bf16 pages: bf16) and rounds the softmax weights
to that type, so against fp64 attention over the codec-dequantized prefix its
relative error is a few units of fp16 / bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_ref import rel_err
from test_triton_paged import BOUND, _filled_pool, expected_kv, interpreter_only

from kvserving.kernels import paged_ops, paged_ref, triton_prefill
from kvserving.kernels.options import KernelOptions

CASES = ["bf16", "fp8_e4m3", "nvfp4", "triaxial"]
# tiny tiles for the interpreter: 4 tokens x 4 heads = 16 rows, 2 pages of 8 = 16 keys per step
TINY = {"BLOCK_T": 4, "BLOCK_N": 16, "PPI": 2, "PPI2": 2, "num_warps": 4, "NUM_STAGES": 1}


def dense_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, sm_scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions start.., k/v [start + n, H, D] -> [n, Hq, D] fp64, causal, GQA."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * sm_scale
    pos = torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), vv)


def _check_extend(case: str, prefix_lens: list[int], n_new: int, *, device: str = "cpu", d: int = 64, h: int = 2, g: int = 4,
                  p: int = 8, tuning: dict[str, int] | None = None, via_ops: bool = False) -> None:  # fmt: skip
    pool, filled, scale = _filled_pool(case, prefix_lens, device=device, d=d, h=h, p=p)
    kv = pool.kv(scale, scale)
    sm = d**-0.5
    for i, start in enumerate(prefix_lens):
        q = torch.randn(n_new, h * g, d, device=device)
        k_new = torch.randn(n_new, h, d, device=device) * 2
        v_new = torch.randn(n_new, h, d, device=device)
        pages = filled.page_table[i]
        if case == "triaxial":  # token order with INT2 pages mixed in, as the engine lists a prefix
            used = -(-start // p)
            head = pages[:used]
            pages = torch.cat([head.flip(0)[1:], head[-1:], pages[used:]]) if used > 1 else pages
        if via_ops:
            out = paged_ops.extend_attention(q, k_new, v_new, kv, pages, start, sm_scale=sm, backend="triton", options=KernelOptions())
        else:
            fast = KernelOptions.from_env().fast_decoders(q.device)
            if tuning is None:
                out = triton_prefill.extend_attention(q, k_new, v_new, kv, pages, start, sm_scale=sm, fast=fast)
            else:
                out = triton_prefill.launch_extend(q, k_new, v_new, kv, pages, start, sm_scale=sm, fast=fast, cfg=tuning)
        assert out.dtype == q.dtype and out.shape == q.shape and not out.isnan().any()
        ek, ev = expected_kv(pool, filled, i, k_scale=scale, v_scale=scale)
        if case == "triaxial" and used > 1:  # the reordered page list holds the same tokens, reordered alike
            order = torch.cat([torch.arange(used - 2, -1, -1), torch.tensor([used - 1])])
            tok = (order[:, None] * p + torch.arange(p)).reshape(-1)
            tok = tok[tok < start]
            ek, ev = ek[tok], ev[tok]
        want = dense_extend(q.cpu(), torch.cat([ek, k_new.cpu()]), torch.cat([ev, v_new.cpu()]), start, sm)
        err = rel_err(out.cpu(), want)
        assert err < BOUND[case], (case, start, err)
        ref = paged_ref.extend_attention(q.cpu(), k_new.cpu(), v_new.cpu(), pool_cpu(pool, scale), pages.cpu(), start, sm_scale=sm)
        assert rel_err(ref, want) < 1e-5  # the reference itself (fp32) is the fp64 answer


def pool_cpu(pool: object, scale: float):  # type: ignore[no-untyped-def]
    from test_paged_ref import Pool

    assert isinstance(pool, Pool)
    return Pool(pool.layout, pool.int2, pool.buffer.cpu(), pool.num_pages, pool.num_int2_pages).kv(scale, scale)


@interpreter_only
@pytest.mark.parametrize("case", CASES)
def test_extend_matches_dense_attention_over_packed_prefix(case: str) -> None:
    # a prefix of whole pages + a partial page; 6 new tokens (a partial query block, a partial chunk step)
    _check_extend(case, [37, 16, 45], 6, tuning=TINY)  # triaxial: 0, 1 and 2 INT2 pages


@interpreter_only
@pytest.mark.parametrize("case", ["nvfp4", "triaxial"])
def test_extend_packed_production_tiles(case: str) -> None:
    # the tiles the GPU runs (128 query rows, 8 / 4 pages per step), on a tiny head; prefix 150: full steps, then
    # a partial one (the unmasked loop, then the masked tail)
    _check_extend(case, [150], 70, tuning=triton_prefill.TUNING["int4" if case == "triaxial" else case])


@interpreter_only
def test_extend_with_empty_prefix_is_causal_attention_on_the_chunk() -> None:
    _check_extend("nvfp4", [0], 5, tuning=TINY)


@interpreter_only
def test_extend_through_paged_ops_and_the_reference_agree() -> None:
    pool, filled, scale = _filled_pool("fp8_e4m3", [20])
    kv = pool.kv(scale, scale)
    q, k, v = torch.randn(3, 8, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    ref = paged_ops.extend_attention(q, k, v, kv, filled.page_table[0], 20, sm_scale=0.1)  # CPU: the reference
    tri = paged_ops.extend_attention(q, k, v, kv, filled.page_table[0], 20, sm_scale=0.1, backend="triton")
    assert rel_err(tri, ref) < 3e-3 and not torch.equal(tri, ref)
    with pytest.raises(ValueError, match="prefix_len=99"):
        paged_ops.extend_attention(q, k, v, kv, filled.page_table[0], 99, sm_scale=0.1, backend="triton")
    with pytest.raises(ValueError, match="k must be"):
        paged_ops.extend_attention(q, k[:, :1], v, kv, filled.page_table[0], 20, sm_scale=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_extend_real_shapes(case: str) -> None:
    p = 32 if case == "triaxial" else 16
    _check_extend(case, [p * 40 + 7, 3000], 300, device="cuda", d=128, h=8, g=4, p=p)
    _check_extend(case, [p + 1], 70, device="cuda", d=128, h=8, g=4, p=p, via_ops=True)

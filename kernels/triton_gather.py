"""Triton extend-path dequantize: cached prefix pages -> the shared bf16/fp32 workspace, one launch per layer.

One program per (page of the list, kv head) writes that page's tokens
``out[i * P + slot, h, :]`` for the slots below ``num_tokens``. Values are
computed exactly as the reference codecs do (fp32, then one cast to the
workspace dtype), so the workspace is bit-identical to paged_ref.gather_kv.
INT2 and INT4 pages may be mixed in one list (triaxial), as the page id's
flag says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .page_ids import INT2_PAGE_FLAG
from .paged_kv import PagedKV
from .triton_codec import e4m3_value, meta_index, to_bf16
from .triton_common import FMT_BF16, FMT_CODES, FMT_FP8, FMT_INT4, FMT_NVFP4, kv_field_offsets

FLAG: tl.constexpr = tl.constexpr(INT2_PAGE_FLAG)


@triton.jit
def _e2m1_value(code):
    """E2M1 code (int32 0..15) -> exact fp32 value (code 8 is -0.0)."""
    e = (code >> 1) & 3
    m = code & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # 2^(e-1) * (1 + m/2)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _interleave(lo, hi, SHAPE: tl.constexpr):
    """[..., n] x2 -> [..., 2n] with lo at even and hi at odd positions."""
    return tl.reshape(tl.join(lo, hi), SHAPE)


@triton.jit
def _dequant_rows(
    page,
    hrow,
    ok,
    scale,
    OFF: tl.constexpr,
    SOFF: tl.constexpr,
    ZOFF: tl.constexpr,
    FMT: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    TM: tl.constexpr,
):
    """K or V of the P rows ``hrow`` of one page -> fp32 [P, D] (reference arithmetic); TM: see meta_index."""
    m = ok[:, None]
    if FMT == FMT_BF16:
        d = tl.arange(0, D)[None, :]
        x = tl.load((page + OFF).to(tl.pointer_type(tl.bfloat16)) + hrow[:, None] * D + d, mask=m, other=0.0).to(tl.float32)
    elif FMT == FMT_FP8:
        d = tl.arange(0, D)[None, :]
        bits = tl.load(page + OFF + hrow[:, None] * D + d, mask=m, other=0).to(tl.int32)
        x = e4m3_value(bits) * scale
    elif FMT == FMT_NVFP4:
        NB: tl.constexpr = D // 16
        b = tl.arange(0, NB)[None, :, None]
        jj = tl.arange(0, 8)[None, None, :]
        m3 = ok[:, None, None]
        packed = tl.load(page + OFF + hrow[:, None, None] * (D // 2) + b * 8 + jj, mask=m3, other=0).to(tl.int32)
        s = e4m3_value(tl.load(page + SOFF + hrow[:, None, None] * NB + b, mask=m3, other=0).to(tl.int32))
        lo = (_e2m1_value(packed & 0xF) * s) * scale
        hi = (_e2m1_value(packed >> 4) * s) * scale
        x = _interleave(lo, hi, (P, D))
    else:  # INT4 (per-token groups) or INT2 (per-token value groups / per-channel keys)
        NG: tl.constexpr = D // 32
        g = tl.arange(0, NG)[None, :, None]
        m3 = ok[:, None, None]
        meta = meta_index(hrow[:, None, None], g, NG, TM)
        sc = tl.load((page + SOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m3, other=0.0).to(tl.float32)
        zr = tl.load((page + ZOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m3, other=0.0).to(tl.float32)
        if FMT == FMT_INT4:
            jj = tl.arange(0, 16)[None, None, :]
            packed = tl.load(page + OFF + hrow[:, None, None] * (D // 2) + g * 16 + jj, mask=m3, other=0).to(tl.int32)
            x = _interleave((packed & 0xF).to(tl.float32) * sc + zr, (packed >> 4).to(tl.float32) * sc + zr, (P, D))
        else:
            jj = tl.arange(0, 8)[None, None, :]
            packed = tl.load(page + OFF + hrow[:, None, None] * (D // 4) + g * 8 + jj, mask=m3, other=0).to(tl.int32)
            c0 = (packed & 3).to(tl.float32) * sc + zr
            c1 = ((packed >> 2) & 3).to(tl.float32) * sc + zr
            c2 = ((packed >> 4) & 3).to(tl.float32) * sc + zr
            c3 = (packed >> 6).to(tl.float32) * sc + zr
            x = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (P, D))
    return x


@triton.jit
def _int2_keys(page, h, hrow, ok, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """INT2 keys of one page and head -> fp32 [P, D]: codes times per-channel scale plus zero."""
    Q: tl.constexpr = D // 4
    jq = tl.arange(0, Q)
    m = ok[:, None]
    packed = tl.load(page + OFF + hrow[:, None] * Q + jq[None, :], mask=m, other=0).to(tl.int32)  # [P, D/4]
    d = tl.arange(0, D)
    sc = tl.load((page + SOFF).to(tl.pointer_type(tl.float16)) + h * D + d).to(tl.float32)[None, :]
    zr = tl.load((page + ZOFF).to(tl.pointer_type(tl.float16)) + h * D + d).to(tl.float32)[None, :]
    # crumb k of byte j is channel 4j + k: interleave the four crumb tiles back into channel order
    c0, c1, c2, c3 = packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6
    codes = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (P, D))
    return codes.to(tl.float32) * sc + zr


@triton.jit
def _gather_kernel(
    buf_ptr,  # uint8 layer buffer
    page_ptr,  # int32 [N] page ids in token order (INT2 ids flagged)
    out_k_ptr,
    out_v_ptr,  # [>= num_tokens, H, D] workspace
    out_s0,
    out_s1,  # workspace strides (tokens, heads); the channel stride is 1
    num_tokens,  # tokens to write (the last page may be partial)
    k_scale,
    v_scale,  # fp32 per-layer scales (fp8 scale / nvfp4 global scale)
    total_bytes,  # layer buffer size (INT2 pages count down from it)
    FMT: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    K_OFF: tl.constexpr,
    KS_OFF: tl.constexpr,
    KZ_OFF: tl.constexpr,
    V_OFF: tl.constexpr,
    VS_OFF: tl.constexpr,
    VZ_OFF: tl.constexpr,
    TRIAXIAL: tl.constexpr,  # INT2 pages may appear: second layout below
    PAGE_BYTES2: tl.constexpr,
    K_OFF2: tl.constexpr,
    KS_OFF2: tl.constexpr,
    KZ_OFF2: tl.constexpr,
    V_OFF2: tl.constexpr,
    VS_OFF2: tl.constexpr,
    VZ_OFF2: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    pid = tl.load(page_ptr + i)
    slot = tl.arange(0, P)
    tok = i * P + slot
    ok = tok < num_tokens
    hrow = h * P + slot
    dst = tok.to(tl.int64)[:, None] * out_s0 + h * out_s1 + tl.arange(0, D)[None, :]
    is_int2 = False
    if TRIAXIAL:
        is_int2 = (pid & FLAG) != 0
    if is_int2:
        page = buf_ptr + total_bytes - ((pid & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES2
        k = _int2_keys(page, h, hrow, ok, K_OFF2, KS_OFF2, KZ_OFF2, P, D)
        v = _dequant_rows(page, hrow, ok, v_scale, V_OFF2, VS_OFF2, VZ_OFF2, 4, P, D, P)
    else:
        page = buf_ptr + pid.to(tl.int64) * PAGE_BYTES
        k = _dequant_rows(page, hrow, ok, k_scale, K_OFF, KS_OFF, KZ_OFF, FMT, P, D, 0)
        v = _dequant_rows(page, hrow, ok, v_scale, V_OFF, VS_OFF, VZ_OFF, FMT, P, D, P)
    if out_k_ptr.dtype.element_ty == tl.bfloat16:
        k = to_bf16(k)
        v = to_bf16(v)
    tl.store(out_k_ptr + dst, k.to(out_k_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(out_v_ptr + dst, v.to(out_v_ptr.dtype.element_ty), mask=ok[:, None])


def gather_kv(
    kv: PagedKV,
    page_ids: torch.Tensor,
    num_tokens: int,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
) -> None:
    """Launch the extend dequantize (arguments checked by paged_ops)."""
    layout = kv.layout
    if layout.fmt not in ("bf16", "fp8_e4m3", "nvfp4", "int4"):
        raise ValueError(f"no Triton gather for {layout.fmt!r} pages (fp32 pages run on the reference path)")
    if num_tokens == 0:
        return
    if out_k.stride() != out_v.stride() or out_k.stride(2) != 1:
        raise ValueError("out_k and out_v must share strides with a unit channel stride")
    p = layout.page_size
    used = triton.cdiv(num_tokens, p)
    (pb, ko, kso, kzo, vo, vso, vzo), (pb2, ko2, kso2, kzo2, vo2, vso2, vzo2) = kv_field_offsets(kv)
    _gather_kernel[(used, layout.kv_heads)](
        kv.base, page_ids, out_k, out_v, out_k.stride(0), out_k.stride(1), num_tokens,
        float(kv.k_scale), float(kv.v_scale), kv.int2_top,
        FMT=FMT_CODES[layout.fmt], H=layout.kv_heads, D=layout.head_dim, P=p,
        PAGE_BYTES=pb, K_OFF=ko, KS_OFF=kso, KZ_OFF=kzo, V_OFF=vo, VS_OFF=vso, VZ_OFF=vzo,
        TRIAXIAL=kv.triaxial,
        PAGE_BYTES2=pb2, K_OFF2=ko2, KS_OFF2=kso2, KZ_OFF2=kzo2, V_OFF2=vo2, VS_OFF2=vso2, VZ_OFF2=vzo2,
        num_warps=4,
    )  # fmt: skip

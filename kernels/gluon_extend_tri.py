"""Gluon extend on triaxial pages (INT4 + INT2, pages of 32): a producer for the schedule of ``gluon_extend``.

The kernel is ``gluon_extend._gl_extend_kernel`` with another producer: the
two consumer warpgroups (``_pp_attend``: S, online softmax, PV by ``wgmma``)
and the chunk's staging (``_pp_chunk``) are the same code. The producer turns
the step's PPI = 4 pages (128 keys) into the fp16 K / V tiles of a ring slot
with channels quarter-major (column k * D/4 + j = channel 4j + k, as the nvfp4
producer writes them), already dequantized: the format's scales and zeros are
applied in the producer, so the consumers' math is nvfp4's with a K fold and
a V fold of 1 (``triton_common.folded_scales``).

Each of the producer's 4 warps owns one page of the step; thread t of a row
owns channels 32t .. 32t+31 (one scale group) of 4 consecutive rows. Per
page (page ids: page_ids.py; fields: layout.py)::

    INT4 K / V   64 bytes a row: 4 int32 word pairs a thread (16 bytes, one group) -> _asm_int4_pair,
                 code * s + z with the row's group scale / zero (K [H, P, 4], V token-minor [H, 4, P])
    INT2 V       32 bytes a row: 2 int32 a thread (8 bytes, one group) -> _asm_int2_rows, the row's group
    INT2 K       32 bytes a row as V, but scale / zero per channel over the page ([H, D]): the thread's 32
                 channels as the f16x2 pairs each output needs (_key_pairs, once a step)

Both kinds of rows leave the unpackers in one register layout (a thread's four
16-byte pieces of its 32 channels, one per quarter), so a step whose pages mix
INT2 and INT4 (``kind`` 2) runs both unpackers on masked inputs (the other
kind's rows come out +0) and ORs the tiles; steps of one kind (0: INT4, 1:
INT2) run one. The wrapper lists INT2 pages first (stable, on the device, in
one launch: ``int2_first``; the partial last page is INT4 and stays last), so
at most one step is mixed (``launch`` takes any listing: tests).

The packed bytes of step i+1 are loaded while step i is unpacked (one register
set for both kinds: INT2 rows use half of each thread's 16 bytes); the INT2
keys' per-channel scales are loaded at the step itself, from L1: step i
prefetches step i+1's into L1 (``_key_prefetch``; holding them in
registers a step ahead spills). The chunk's own k, v are read as the caller
holds them (``gluon_attend._pp_chunk_rows``: no fp16 copies per call). The
consumers take the exact row max every step, reduced serially (the lazy
softmax and tree reductions of the nvfp4 kernel do not pay here).

Supported (``supported``): triaxial KV, head_dim 128, pages of 32, 4 query
heads per kv head, Hopper; ``paged_ops`` runs it for those calls (faster than
the ``tl`` kernel at every bench shape).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .capability import device_choice
from .gluon_attend import _as_type, _cta_barrier, _pp_attend, _pp_chunk_any, _pp_setup, chunk_rows, launch_io, launch_pages
from .gluon_fragments import _MAGIC, idx3
from .layout import PageLayout
from .page_ids import INT2_PAGE_FLAG
from .paged_kv import PagedKV
from .triton_common import LOG2E, field_offsets

FLAG: gl.constexpr = gl.constexpr(INT2_PAGE_FLAG)

# ----------------------------------------------------------------------------
# unpackers (PTX; held to the formats by tests/kernels/test_gluon_unpackers.py)
# ----------------------------------------------------------------------------
#
# One element = one int32 of a row's registers (_raw): an INT4 word pair (words a | b << 16, word w's nibble k =
# channel 4w + k) or an INT2 halfword (bytes b0 | b1 << 8 in the low half, byte j's crumb k = channel 4j + k). Either
# way it holds 8 values, two of each quarter, and the unpacker gives $0..$3 = quarter k as an f16x2 pair = code * s + z
# (codes read in place by the magics of gluon_fragments._MAGIC, then one fma):
#
#     INT4 code k of both words: nibble k of each half: k = 0 / 1 in place, 2 / 3 after one shift by 8
#     INT2 code k of both bytes: prmt x = b0 | b1 << 16 (0x4140), then crumb k of each half in place


def _codes(kind: str, k: int, dst: str = "t") -> str:
    """PTX leaving quarter k's two codes (exact fp16) in dst (int4: from $4 and u = $4 >> 8; int2: from x)."""
    if kind == "int4":
        src, mask, magic = ("$4" if k < 2 else "u"), (0x000F000F if k % 2 == 0 else 0x00F000F0), ("m0" if k % 2 == 0 else "m2")
    else:
        src, mask, magic = "x", 0x00030003 << (2 * k), f"m{k}"
    return f"lop3.b32 {dst}, {src}, {mask:#010x}, {magic}, 0xEA; sub.rn.f16x2 {dst}, {dst}, {magic};"


def asm_rows(kind: str) -> str:
    """PTX of one element's unpacker; inputs after $0..$3 by kind:

    - "int4" / "int2": $4 the element, $5 / $6 the row group's fp16 scale / zero (16-bit operands);
    - "int2k" (INT2 keys): $4, $5..$8 quarter k's scale pair (f16x2: channels 8c + k, 8c + 4 + k of the
      page), $9..$12 its zero pair (_key_pairs);
    - "mixed" (values of a step with both kinds): $4, $5 / $6 the row's group scale / zero, $7 nonzero for INT2 rows;
    - "mixedk" (keys of such a step): $4, $5 / $6 the INT4 row's group scale / zero, $7..$10 / $11..$14 the INT2
      page's pairs, $15 nonzero for INT2 rows.
    INT4 and INT2 elements cost 13 instructions per 8 values, the mixed ones ~22 (both codes, then a select)."""
    code = ["{ .reg .b32 t, t2, u, x, s, z, sk, zk, m0, m1, m2, m3; .reg .pred p;"]
    code += [f"mov.b32 m{k}, {_MAGIC[k] * 0x10001:#010x};" for k in range(4)]
    if kind in ("int4", "mixed", "mixedk"):
        code.append("shr.b32 u, $4, 8;")
    if kind != "int4":
        code.append("prmt.b32 x, $4, 0, 0x4140;")
    if kind in ("int4", "int2", "mixed", "mixedk"):
        code.append("mov.b32 s, {$5, $5}; mov.b32 z, {$6, $6};")
    flag = {"mixed": "$7", "mixedk": "$15"}.get(kind)
    if flag:
        code.append(f"setp.ne.b32 p, {flag}, 0;")
    for k in range(4):
        if kind in ("mixed", "mixedk"):
            code.append(_codes("int2", k, "t2"))
            code.append(_codes("int4", k) + " selp.b32 t, t2, t, p;")
        else:
            code.append(_codes("int4" if kind == "int4" else "int2", k))
        if kind == "int2k":
            sz = f"${5 + k}, ${9 + k}"
        elif kind == "mixedk":
            code.append(f"selp.b32 sk, ${7 + k}, s, p; selp.b32 zk, ${11 + k}, z, p;")
            sz = "sk, zk"
        else:
            sz = "s, z"
        code.append(f"fma.rn.f16x2 ${k}, t, {sz};")
    code.append("}")
    return "\n".join(code)


ASM_INT4: gl.constexpr = gl.constexpr(asm_rows("int4"))
ASM_INT2: gl.constexpr = gl.constexpr(asm_rows("int2"))
ASM_INT2K: gl.constexpr = gl.constexpr(asm_rows("int2k"))
ASM_MIXED: gl.constexpr = gl.constexpr(asm_rows("mixed"))
ASM_MIXEDK: gl.constexpr = gl.constexpr(asm_rows("mixedk"))
ASM_PRMT_LO: gl.constexpr = gl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")  # (a.lo, b.lo)
ASM_PRMT_HI: gl.constexpr = gl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")  # (a.hi, b.hi)

# ----------------------------------------------------------------------------
# layouts: warp = page of the step, thread t of a row = channels 32t .. 32t+31, 4 consecutive rows a thread
# ----------------------------------------------------------------------------


@gluon.constexpr_function
def _l_words(w: int) -> Any:
    """[PPI, P, 16] int32 of packed rows (INT4: word pairs; INT2: see _raw2): 4 (16 bytes) a thread and row."""
    return gl.BlockedLayout([1, 4, 4], [1, 8, 4], [w, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _l_groups(w: int) -> Any:
    """[PPI, P, 4] fp16 per-row group scales / zeros: the group of the thread's 16 bytes in _l_words."""
    return gl.BlockedLayout([1, 4, 1], [1, 8, 4], [w, 1, 1], [2, 1, 0])


@gluon.jit
def _pages(pid, L: gl.constexpr):
    """[PPI] page ids -> [PPI, 1, 1] in layout L."""
    return gl.convert_layout(pid, gl.SliceLayout(1, gl.SliceLayout(2, L)))[:, None, None]


@gluon.jit
def _int2_base(buf_ptr, pid, total_bytes, PAGE_BYTES2: gl.constexpr):
    """uint8 pointer to INT2 page pid (ids carry FLAG; INT2 pages count down from total_bytes)."""
    return buf_ptr + (total_bytes - ((pid & ~FLAG) + 1).to(gl.int64) * PAGE_BYTES2)


# ----------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------


@gluon.jit
def _ids(pt_ptr, it, num_pages, PPI: gl.constexpr):
    """Page ids of list entries it .. it+PPI-1 ([PPI], warp w's page; 0 past num_pages) and the step's kind: 0 every
    listed page INT4 (or none), 1 every one INT2, 2 mixed (a scalar: four uniform loads)."""
    pg = gl.arange(0, PPI, layout=gl.SliceLayout(1, gl.SliceLayout(2, _l_words(gl.num_warps()))))
    pid = gl.load(pt_ptr + it + pg, mask=it + pg < num_pages, other=0)
    n2 = 0
    nv = 0
    for j in gl.static_range(PPI):
        ok = (it + j < num_pages).to(gl.int32)
        p = gl.load(pt_ptr + gl.maximum(gl.minimum(it + j, num_pages - 1), 0))
        n2 = n2 + ok * ((p >> 30) & 1)
        nv = nv + ok
    kind = (n2 > 0) * (1 + (n2 < nv))  # int32
    return pid, kind


@gluon.jit
def _raw4(buf_ptr, pid, it, prefix_len, h, P: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
          KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr,
          MIXED: gl.constexpr):  # fmt: skip
    """INT4 rows of the step at list index it (pid: its page ids): K and V word pairs [PPI, P, 16] int32, K scale /
    zero and V scale / zero [PPI, P, 4] fp16; rows past prefix_len (and MIXED: rows of INT2 pages) read 0."""
    W: gl.constexpr = gl.num_warps()
    L: gl.constexpr = _l_words(W)
    LG: gl.constexpr = _l_groups(W)
    PPI: gl.constexpr = pid.shape[0]
    pg, r, c = idx3(L, PPI, P, 16)
    p3 = _pages(pid, L)
    ok = (it + pg) * P + r < prefix_len
    if MIXED:
        ok = ok & ((p3 & FLAG) == 0)
    rows = (buf_ptr + (p3.to(gl.int64) * PAGE_BYTES + (h * P + r) * 64)).to(gl.pointer_type(gl.int32), bitcast=True) + c
    kw = gl.load(rows + K_OFF // 4, mask=ok, other=0)
    vw = gl.load(rows + V_OFF // 4, mask=ok, other=0)
    gp, gr, g = idx3(LG, PPI, P, 4)
    q3 = _pages(pid, LG)
    gok = (it + gp) * P + gr < prefix_len
    if MIXED:
        gok = gok & ((q3 & FLAG) == 0)
    page = (buf_ptr + q3.to(gl.int64) * PAGE_BYTES).to(gl.pointer_type(gl.float16), bitcast=True)
    kg = page + (h * P + gr) * 4 + g  # K scale / zero [H, P, 4]
    vg = page + (h * 4 + g) * P + gr  # V scale / zero token-minor [H, 4, P]
    ks = gl.load(kg + KS_OFF // 2, mask=gok, other=0.0)
    kz = gl.load(kg + KZ_OFF // 2, mask=gok, other=0.0)
    vs = gl.load(vg + VS_OFF // 2, mask=gok, other=0.0)
    vz = gl.load(vg + VZ_OFF // 2, mask=gok, other=0.0)
    return kw, vw, ks, kz, vs, vz


@gluon.jit
def _raw2(buf_ptr, pid, it, prefix_len, h, total_bytes, P: gl.constexpr, PAGE_BYTES2: gl.constexpr,
          K_OFF2: gl.constexpr, V_OFF2: gl.constexpr, VS_OFF2: gl.constexpr, VZ_OFF2: gl.constexpr,
          MIXED: gl.constexpr):  # fmt: skip
    """INT2 rows of the step, in _raw4's registers: K and V [PPI, P, 16] int32 whose column c holds halfword c of the
    32-byte row (low 16 bits: 8 codes, as an INT4 word pair holds 8), V scale / zero [PPI, P, 4]; K scale / zero 0
    (per channel, not per row: _key_pairs). Rows past prefix_len (and MIXED: rows of INT4 pages) read 0."""
    W: gl.constexpr = gl.num_warps()
    L: gl.constexpr = _l_words(W)
    LG: gl.constexpr = _l_groups(W)
    PPI: gl.constexpr = pid.shape[0]
    pg, r, c = idx3(L, PPI, P, 16)
    p3 = _pages(pid, L)
    ok = (it + pg) * P + r < prefix_len
    if MIXED:
        ok = ok & ((p3 & FLAG) != 0)
    rows = (_int2_base(buf_ptr, p3, total_bytes, PAGE_BYTES2) + (h * P + r) * 32).to(gl.pointer_type(gl.int16),
                                                                                   bitcast=True) + c  # fmt: skip
    kw = gl.load(rows + K_OFF2 // 2, mask=ok, other=0).to(gl.int32)
    vw = gl.load(rows + V_OFF2 // 2, mask=ok, other=0).to(gl.int32)
    gp, gr, g = idx3(LG, PPI, P, 4)
    q3 = _pages(pid, LG)
    gok = (it + gp) * P + gr < prefix_len
    if MIXED:
        gok = gok & ((q3 & FLAG) != 0)
    vg = _int2_base(buf_ptr, q3, total_bytes, PAGE_BYTES2).to(gl.pointer_type(gl.float16), bitcast=True)
    vg = vg + (h * 4 + g) * P + gr
    vs = gl.load(vg + VS_OFF2 // 2, mask=gok, other=0.0)
    vz = gl.load(vg + VZ_OFF2 // 2, mask=gok, other=0.0)
    ks = gl.zeros([PPI, P, 4], gl.float16, layout=LG)
    return kw, vw, ks, ks, vs, vz


@gluon.jit
def _raw(buf_ptr, pid, kind, it, prefix_len, h, total_bytes, P: gl.constexpr, PAGE_BYTES: gl.constexpr,
         K_OFF: gl.constexpr, KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
         VZ_OFF: gl.constexpr, PAGE_BYTES2: gl.constexpr, K_OFF2: gl.constexpr, V_OFF2: gl.constexpr,
         VS_OFF2: gl.constexpr, VZ_OFF2: gl.constexpr):  # fmt: skip
    """The step's packed rows by its kind (_raw4, _raw2, or both on their own rows for a mixed step)."""
    if kind == 0:
        kw, vw, ks, kz, vs, vz = _raw4(buf_ptr, pid, it, prefix_len, h, P, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF,
                                       VS_OFF, VZ_OFF, False)  # fmt: skip
    elif kind == 1:
        kw, vw, ks, kz, vs, vz = _raw2(buf_ptr, pid, it, prefix_len, h, total_bytes, P, PAGE_BYTES2, K_OFF2, V_OFF2,
                                       VS_OFF2, VZ_OFF2, False)  # fmt: skip
    else:
        kw, vw, ks, kz, vs, vz = _raw4(buf_ptr, pid, it, prefix_len, h, P, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF,
                                       VS_OFF, VZ_OFF, True)  # fmt: skip
        kw2, vw2, _ks, _kz, vs2, vz2 = _raw2(buf_ptr, pid, it, prefix_len, h, total_bytes, P, PAGE_BYTES2, K_OFF2,
                                             V_OFF2, VS_OFF2, VZ_OFF2, True)  # fmt: skip
        kw = kw | kw2
        vw = vw | vw2
        vs = vs + vs2  # one of the two is +0
        vz = vz + vz2
    return kw, vw, ks, kz, vs, vz


@gluon.jit
def _tile(y0, y1, y2, y3):
    """Quarters [PPI, P, 16] int32 (element c: f16x2 of quarter-k columns 2c, 2c+1) -> [PPI * P, 64] int32, column
    k * 16 + c (the int32 view of the [N, D] tile: column k * D/4 + j holds channel 4j + k)."""
    PPI: gl.constexpr = y0.shape[0]
    P: gl.constexpr = y0.shape[1]
    Q2: gl.constexpr = y0.shape[2]
    u = gl.join(gl.join(y0, y1), gl.join(y2, y3))  # [PPI, P, Q2, i, o]: quarter k = 2 * o + i
    return gl.reshape(gl.permute(u, [0, 1, 4, 3, 2]), [PPI * P, 4 * Q2])


@gluon.jit
def _store(u, dst):
    """[N, D/2] int32 tile -> the fp16 [N, D] shared tile dst (through an int32 view)."""
    LI: gl.constexpr = gl.NVMMASharedLayout.get_default_for([u.shape[0], u.shape[1]], gl.int32)
    _as_type(dst, gl.int32, [u.shape[0], u.shape[1]], LI).store(u)


@gluon.jit
def _by_element(s, L: gl.constexpr):
    """Per-row group values [PPI, P, 4] -> [PPI, P, 16] (each for its 4 elements: the thread's 16 bytes) in L."""
    PPI: gl.constexpr = s.shape[0]
    P: gl.constexpr = s.shape[1]
    return gl.convert_layout(gl.reshape(gl.join(gl.join(s, s), gl.join(s, s)), [PPI, P, 16]), L)


@gluon.jit
def _unpack_rows(w, s, z, ASM: gl.constexpr):
    """Rows with per-row group scales (INT4 K / V, INT2 V): elements [PPI, P, 16], scale / zero [PPI, P, 4] -> the
    tile's int32 [N, D/2]."""
    L: gl.constexpr = w.type.layout
    y0, y1, y2, y3 = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,h,h", [w, _by_element(s, L), _by_element(z, L)],
                                               dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                               pack=1)  # fmt: skip
    return _tile(y0, y1, y2, y3)


@gluon.jit
def _pair(a, b, HI: gl.constexpr):
    """int32 words (a, b) -> (a.lo, b.lo), or (a.hi, b.hi): two fp16 channels 4 apart as one f16x2 operand."""
    if HI:
        return gl.inline_asm_elementwise(ASM_PRMT_HI, "=r,r,r", [a, b], dtype=gl.int32, is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise(ASM_PRMT_LO, "=r,r,r", [a, b], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _key_pairs(buf_ptr, pid, use, h, total_bytes, PAGE_BYTES2: gl.constexpr, OFF: gl.constexpr):
    """The per-channel INT2 key scale (or zero, at OFF) of each step page (pid; 0 where not ``use``), as asm_rows'
    "int2k" operands: quarter k of element c takes channels 8c + k and 8c + 4 + k, the halves k % 2 of words
    4c + k // 2 and 4c + 2 + k // 2 of head h's row -> four [PPI, 1, 16] int32 (broadcast over the rows)."""
    L: gl.constexpr = _l_words(gl.num_warps())
    SL: gl.constexpr = gl.SliceLayout(1, L)
    pg = gl.convert_layout(pid, gl.SliceLayout(1, SL))
    m = gl.convert_layout(use, gl.SliceLayout(1, SL))[:, None]
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, SL))[None, :]
    wp = (_int2_base(buf_ptr, pg, total_bytes, PAGE_BYTES2) + OFF).to(gl.pointer_type(gl.int32), bitcast=True)
    wp = wp[:, None] + h * 64 + c * 4  # word 4c of head h's row of D fp16
    w0 = gl.load(wp, mask=m, other=0)
    w1 = gl.load(wp + 1, mask=m, other=0)
    w2 = gl.load(wp + 2, mask=m, other=0)
    w3 = gl.load(wp + 3, mask=m, other=0)
    return (_pair(w0, w2, False)[:, None, :], _pair(w0, w2, True)[:, None, :], _pair(w1, w3, False)[:, None, :],
            _pair(w1, w3, True)[:, None, :])  # fmt: skip


@gluon.jit
def _key_fields(buf_ptr, pid, it, num_pages, h, total_bytes, PAGE_BYTES2: gl.constexpr, KS_OFF2: gl.constexpr,
                KZ_OFF2: gl.constexpr):  # fmt: skip
    """The INT2 key scale and zero pairs (_key_pairs) of the step at list index it (pages pid; 0 for INT4 pages and
    past num_pages) -> (s0, s1, s2, s3, z0, z1, z2, z3)."""
    PPI: gl.constexpr = pid.shape[0]
    use = ((pid & FLAG) != 0) & (it + gl.arange(0, PPI, layout=pid.type.layout) < num_pages)
    s0, s1, s2, s3 = _key_pairs(buf_ptr, pid, use, h, total_bytes, PAGE_BYTES2, KS_OFF2)
    z0, z1, z2, z3 = _key_pairs(buf_ptr, pid, use, h, total_bytes, PAGE_BYTES2, KZ_OFF2)
    return s0, s1, s2, s3, z0, z1, z2, z3


ASM_PREFETCH_L1: gl.constexpr = gl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L1 [$1]; mov.b32 $0, 0; }")


@gluon.jit
def _key_prefetch(buf_ptr, pid, it, num_pages, h, total_bytes, PAGE_BYTES2: gl.constexpr, KS_OFF2: gl.constexpr,
                  KZ_OFF2: gl.constexpr):  # fmt: skip
    """Prefetch into L1 the INT2 key scale and zero rows (head h's D fp16 each: two 128-byte lines) of the step at
    list index it (pages pid; nothing for INT4 pages and past num_pages): _key_fields' loads then hit L1 at that
    step, with no register held meanwhile."""
    PPI: gl.constexpr = pid.shape[0]
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [gl.num_warps(), 1], [1, 0])
    pg = gl.convert_layout(pid, gl.SliceLayout(1, L))[:, None]
    ok = ((pg & FLAG) != 0) & (it + gl.arange(0, PPI, layout=gl.SliceLayout(1, L))[:, None] < num_pages)
    line = gl.arange(0, 4, layout=gl.SliceLayout(0, L))[None, :]  # scale lines 0, 1; zero lines 0, 1
    off = gl.where(line < 2, KS_OFF2, KZ_OFF2) + h * 256 + (line % 2) * 128
    ptr = _int2_base(buf_ptr, pg, total_bytes, PAGE_BYTES2) + off
    gl.inline_asm_elementwise(ASM_PREFETCH_L1, "=r,l,r", [ptr, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _unpack2k(w, s, z, pid, s0, s1, s2, s3, z0, z1, z2, z3, MIXED: gl.constexpr):
    """INT2 key rows of pages pid with their pages' scale / zero pairs (_key_fields) -> the tile's int32 [N, D/2].
    MIXED: the INT4 rows among them (their group scale / zero s, z [PPI, P, 4]; s, z unused otherwise) through
    asm_rows("mixedk")."""
    L: gl.constexpr = w.type.layout
    if MIXED:
        f = _pages(pid, L) & FLAG
        y0, y1, y2, y3 = gl.inline_asm_elementwise(ASM_MIXEDK, "=r,=r,=r,=r,r,h,h" + ",r" * 9,
                                                   [w, _by_element(s, L), _by_element(z, L), s0, s1, s2, s3, z0, z1,
                                                    z2, z3, f], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                   is_pure=True, pack=1)  # fmt: skip
    else:
        y0, y1, y2, y3 = gl.inline_asm_elementwise(ASM_INT2K, "=r,=r,=r,=r" + ",r" * 9, [w, s0, s1, s2, s3, z0, z1, z2, z3],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)  # fmt: skip
    return _tile(y0, y1, y2, y3)


@gluon.jit
def _unpack_k(buf_ptr, kw, ks, kz, kind, pid, num_pages, it, h, total_bytes, dst, PAGE_BYTES2: gl.constexpr,
              KS_OFF2: gl.constexpr, KZ_OFF2: gl.constexpr):  # fmt: skip
    """The step's K rows (_raw, list index it, pages pid) -> the fp16 tile dst, by the step's kind (INT2 pages' key
    scale / zero pairs loaded here: _key_prefetch has them in L1 by now)."""
    if kind == 0:
        _store(_unpack_rows(kw, ks, kz, ASM_INT4), dst)
    else:
        s0, s1, s2, s3, z0, z1, z2, z3 = _key_fields(buf_ptr, pid, it, num_pages, h, total_bytes, PAGE_BYTES2, KS_OFF2,
                                                     KZ_OFF2)  # fmt: skip
        if kind == 1:
            _store(_unpack2k(kw, ks, kz, pid, s0, s1, s2, s3, z0, z1, z2, z3, False), dst)
        else:  # a warp's page is one kind: each element selects its own codes and scales (asm_rows "mixedk")
            _store(_unpack2k(kw, ks, kz, pid, s0, s1, s2, s3, z0, z1, z2, z3, True), dst)


@gluon.jit
def _unpack_v(vw, vs, vz, kind, pid, dst):
    """The step's V rows -> the fp16 tile dst, by the step's kind."""
    if kind == 0:
        _store(_unpack_rows(vw, vs, vz, ASM_INT4), dst)
    elif kind == 1:
        _store(_unpack_rows(vw, vs, vz, ASM_INT2), dst)
    else:
        L: gl.constexpr = vw.type.layout
        f = _pages(pid, L) & FLAG
        y0, y1, y2, y3 = gl.inline_asm_elementwise(ASM_MIXED, "=r,=r,=r,=r,r,h,h,r",
                                                   [vw, _by_element(vs, L), _by_element(vz, L), f],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)  # fmt: skip
        _store(_tile(y0, y1, y2, y3), dst)


@gluon.jit
def _tri_load(buf_ptr, pt_ptr, k_ptr, v_ptr, k_ring, v_ring, full, empty, prefix_len, n_new, k_s0, total_bytes, qb, h,
              P: gl.constexpr, D: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr,
              KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr,
              PAGE_BYTES2: gl.constexpr, K_OFF2: gl.constexpr, KS_OFF2: gl.constexpr, KZ_OFF2: gl.constexpr,
              V_OFF2: gl.constexpr, VS_OFF2: gl.constexpr, VZ_OFF2: gl.constexpr, PPI: gl.constexpr,
              BLOCK_T: gl.constexpr):  # fmt: skip
    """The triaxial producer: step i's rows unpacked into ring slot i % SLOTS once the consumers released it, while
    step i+1's bytes and step i+2's page ids are in flight; then the chunk (_pp_chunk)."""
    SLOTS: gl.constexpr = k_ring.shape[0]
    num_pages = gl.cdiv(prefix_len, P)
    steps = gl.cdiv(num_pages, PPI)
    pid, kind = _ids(pt_ptr, 0, num_pages, PPI)
    kw, vw, ks, kz, vs, vz = _raw(buf_ptr, pid, kind, 0, prefix_len, h, total_bytes, P, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF,
                                  V_OFF, VS_OFF, VZ_OFF, PAGE_BYTES2, K_OFF2, V_OFF2, VS_OFF2, VZ_OFF2)  # fmt: skip
    npid, nkind = _ids(pt_ptr, PPI, num_pages, PPI)
    for i in range(steps):
        slot = i % SLOTS
        npid2, nkind2 = _ids(pt_ptr, (i + 2) * PPI, num_pages, PPI)
        mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)  # a fresh mbarrier counts as released once
        _unpack_k(buf_ptr, kw, ks, kz, kind, pid, num_pages, i * PPI, h, total_bytes, k_ring.index(slot), PAGE_BYTES2,
                  KS_OFF2, KZ_OFF2)  # fmt: skip
        # step i+1's bytes, in flight from here (loaded before K's unpack they cost spills: two steps' rows at once)
        nkw, nvw, nks, nkz, nvs, nvz = _raw(buf_ptr, npid, nkind, (i + 1) * PPI, prefix_len, h, total_bytes, P,
                                            PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, PAGE_BYTES2,
                                            K_OFF2, V_OFF2, VS_OFF2, VZ_OFF2)  # fmt: skip
        # its key pairs into L1: their loads at step i+1 then wait for L1, not L2 / HBM
        _key_prefetch(buf_ptr, npid, (i + 1) * PPI, num_pages, h, total_bytes, PAGE_BYTES2, KS_OFF2, KZ_OFF2)
        _unpack_v(vw, vs, vz, kind, pid, v_ring.index(slot))
        fence_async_shared()
        _cta_barrier()  # the partition's stores are done: its thread 0 arrives for all
        mbarrier.arrive(full.index(slot), count=1)
        kw, vw, ks, kz, vs, vz = nkw, nvw, nks, nkz, nvs, nvz
        pid, kind = npid, nkind
        npid, nkind = npid2, nkind2
    _pp_chunk_any(k_ptr, v_ptr, k_ring, v_ring, full, empty, steps, n_new, k_s0, qb, h, D, BLOCK_T, 1)


@gluon.jit
def _gl_extend_tri_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, buf_ptr, pt_ptr, n_new, prefix_len,
    total_bytes,  # layer buffer bytes (INT2 pages count down from here)
    q_mul, k_mul_new, v_div, q_s0, q_s1, k_s0, o_s0, o_s1,
    G: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
    PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr,  # INT4 pages
    V_OFF: gl.constexpr, VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr,
    PAGE_BYTES2: gl.constexpr, K_OFF2: gl.constexpr, KS_OFF2: gl.constexpr, KZ_OFF2: gl.constexpr,  # INT2 pages
    V_OFF2: gl.constexpr, VS_OFF2: gl.constexpr, VZ_OFF2: gl.constexpr,
    BLOCK_T: gl.constexpr, PPI: gl.constexpr,
    SLOTS: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, ATT_REGS: gl.constexpr,
):  # fmt: skip
    """gluon_extend._gl_extend_kernel (arguments as there; k, v as the caller holds them: chunk_rows) with the
    triaxial producer _tri_load (LOAD_WARPS = PPI: a warp per page of the step)."""
    H2: gl.constexpr = BLOCK_T * G // 2
    qb, h, q_0, q_1, k_ring, v_ring, full, empty = _pp_setup(q_ptr, n_new, q_s0, q_s1, q_mul, G, D, P, PPI, BLOCK_T, SLOTS)
    gl.warp_specialize([
        (_pp_attend, (q_0, k_ring, v_ring, full, empty, o_ptr, prefix_len, n_new, k_mul_new, v_div, o_s0, o_s1, qb, h, 0,
                      G, D, P, PPI, BLOCK_T, 0, 0)),
        (_pp_attend, (q_1, k_ring, v_ring, full, empty, o_ptr, prefix_len, n_new, k_mul_new, v_div, o_s0, o_s1, qb, h, H2,
                      G, D, P, PPI, BLOCK_T, 0, 0)),
        (_tri_load, (buf_ptr, pt_ptr, k_ptr, v_ptr, k_ring, v_ring, full, empty, prefix_len, n_new, k_s0, total_bytes,
                     qb, h, P, D, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, PAGE_BYTES2, K_OFF2,
                     KS_OFF2, KZ_OFF2, V_OFF2, VS_OFF2, VZ_OFF2, PPI, BLOCK_T)),
    ], [4, LOAD_WARPS], [ATT_REGS, LOAD_REGS])  # fmt: skip


# ----------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------

# 32 chunk tokens x 4 heads = 128 rows, 4 pages of 32 = 128 prefix keys per step (a producer warp per page); the
# registers split 168 * 12 = 4 x 152 (producer: the least at which its loop keeps at most a value a step in local
# memory) + 8 x 176 (the two consumers)
TUNING: dict[str, int] = {"BLOCK_T": 32, "PPI": 4, "SLOTS": 2, "LOAD_WARPS": 4, "LOAD_REGS": 152, "maxnreg": 168,
                          "ATT_REGS": 176, "num_warps": 4}  # fmt: skip


@triton.jit(do_not_specialize=["n"])  # one compile for every prefix length (a served prefix has any page count)
def _int2_first_kernel(src_ptr, dst_ptr, n, FLAG_BIT: tl.constexpr, BLOCK: tl.constexpr):
    """dst[:n] = src's n page ids, the INT2 ones (bit FLAG_BIT set) first, each kind in its listed order (a stable
    partition, one program): a first loop counts the INT2 ids, a second writes each id at its kind's running count."""
    n2 = 0
    for b in range(0, n, BLOCK):
        o = b + tl.arange(0, BLOCK)
        n2 += tl.sum((tl.load(src_ptr + o, mask=o < n, other=0) >> FLAG_BIT) & 1, axis=0)
    c2 = 0  # INT2 / INT4 ids written by earlier blocks
    c4 = 0
    for b in range(0, n, BLOCK):
        o = b + tl.arange(0, BLOCK)
        m = o < n
        x = tl.load(src_ptr + o, mask=m, other=0)
        f2 = (x >> FLAG_BIT) & 1
        f4 = tl.where(m, 1 - f2, 0)
        pos = tl.where(f2 != 0, c2 + tl.cumsum(f2, axis=0) - 1, n2 + c4 + tl.cumsum(f4, axis=0) - 1)
        tl.store(dst_ptr + pos, x, mask=m)
        c2 += tl.sum(f2, axis=0)
        c4 += tl.sum(f4, axis=0)


def int2_first(pages: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """The page ids [N] (int32) with the INT2 pages first, each kind's order kept (at most one step of the kernel
    mixes the kinds), in one launch (torch's stable argsort is several kernels and the gather another). ``block``
    ids per loop step whatever N, so one specialization serves every prefix: a block sized by N compiled a kernel
    per power of two, and the warm-up (chunk-aligned prefixes) could not meet them all before serving."""
    out = torch.empty_like(pages)
    n = pages.numel()
    if n:
        _int2_first_kernel[(1,)](pages, out, n, FLAG_BIT=INT2_PAGE_FLAG.bit_length() - 1, BLOCK=block, num_warps=4)
    return out


def supported(kv: PagedKV, q: torch.Tensor) -> bool:
    """Calls this kernel runs: triaxial pages of 32 tokens, head_dim 128, 4 query heads per kv head, Hopper."""
    lay = kv.layout
    if not kv.triaxial or lay.page_size != 32 or lay.head_dim != 128 or q.shape[-1] != 128:
        return False
    if q.shape[1] != 4 * lay.kv_heads or q.device.type != "cuda":
        return False
    return device_choice(q.device).extend == "gluon"  # capability.TABLE: wgmma is Hopper's


def _meta(lay: PageLayout, lay2: PageLayout, *, stride: int = 0, stride2: int = 0) -> dict[str, Any]:
    """The kernel's constexprs and launch options (TUNING) for the two page layouts (``stride``, ``stride2``: the
    page strides, triton_common.field_offsets')."""
    a, a2 = field_offsets(lay, stride=stride), field_offsets(lay2, stride=stride2)
    return dict(D=lay.head_dim, P=lay.page_size, PAGE_BYTES=a[0], K_OFF=a[1], KS_OFF=a[2], KZ_OFF=a[3], V_OFF=a[4],
                VS_OFF=a[5], VZ_OFF=a[6], PAGE_BYTES2=a2[0], K_OFF2=a2[1], KS_OFF2=a2[2], KZ_OFF2=a2[3],
                V_OFF2=a2[4], VS_OFF2=a2[5], VZ_OFF2=a2[6], BLOCK_T=TUNING["BLOCK_T"], PPI=TUNING["PPI"],
                SLOTS=TUNING["SLOTS"], LOAD_WARPS=TUNING["LOAD_WARPS"], LOAD_REGS=TUNING["LOAD_REGS"],
                ATT_REGS=TUNING["ATT_REGS"], num_warps=TUNING["num_warps"], maxnreg=TUNING["maxnreg"])  # fmt: skip


def extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, prefix_pages: torch.Tensor, prefix_len: int, *, sm_scale: float
) -> torch.Tensor:
    """Launch the kernel (arguments checked by paged_ops; ``supported`` must hold) -> [n, Hq, D] in q.dtype, the
    prefix's INT2 pages listed first (int2_first; the partial last page is INT4 and stays last)."""
    if not supported(kv, q):
        raise ValueError("gluon_extend_tri does not support this call (see gluon_extend_tri.supported)")
    pages = prefix_pages[: triton.cdiv(prefix_len, kv.layout.page_size)]
    return launch(q, k, v, kv, int2_first(pages.contiguous()), prefix_len, sm_scale=sm_scale)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, pages: torch.Tensor, prefix_len: int, *,
           sm_scale: float) -> torch.Tensor:  # fmt: skip
    """The kernel over the prefix's pages in the order given (any mix of kinds per step) -> [n, Hq, D] in q.dtype."""
    if not supported(kv, q):
        raise ValueError("gluon_extend_tri does not support this call (see gluon_extend_tri.supported)")
    lay = kv.layout
    n, hq, _ = q.shape
    h = lay.kv_heads
    q, out = launch_io(q)
    if n == 0:
        return out
    pages = launch_pages(pages[: triton.cdiv(prefix_len, lay.page_size)], q.device)
    q_mul = sm_scale * LOG2E  # INT scales are in the pages: no K or V fold
    k_in, v_in = chunk_rows(k, v)
    grid = (triton.cdiv(n, TUNING["BLOCK_T"]), h)
    _gl_extend_tri_kernel[grid](
        q, k_in, v_in, out, kv.base, pages, n, prefix_len, kv.int2_top, q_mul, 1.0, 1.0, q.stride(0), q.stride(1),
        k_in.stride(0), out.stride(0), out.stride(1), G=hq // h, **_meta(lay, kv.int2, stride=kv.page_stride, stride2=kv.int2_stride),
    )  # fmt: skip
    return out


def compile_report_args() -> tuple[Any, dict[str, str], dict[str, Any]]:
    """(kernel, signature, constexprs incl. num_warps and maxnreg) to compile the kernel for sm_90 without a GPU at
    the bench's shape (32 q / 8 kv heads, d 128, pages of 32); align total_bytes and the strides (compile_report)."""
    lay = PageLayout.build("int4", page_size=32, kv_heads=8, head_dim=128)
    lay2 = PageLayout.build("int2", page_size=32, kv_heads=8, head_dim=128)
    sig = {"q_ptr": "*bf16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*bf16", "buf_ptr": "*u8", "pt_ptr": "*i32",
           "n_new": "i32", "prefix_len": "i32", "total_bytes": "i64", "q_mul": "fp32", "k_mul_new": "fp32",
           "v_div": "fp32", "q_s0": "i32", "q_s1": "i32", "k_s0": "i32", "o_s0": "i32", "o_s1": "i32"}  # fmt: skip
    return _gl_extend_tri_kernel, sig, dict(G=4, **_meta(lay, lay2))

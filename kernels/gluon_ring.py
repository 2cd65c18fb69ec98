"""The Gluon decode's shared-memory ring: which bytes of a step each thread stages with ``cp.async``, and how the
step reads them back in the layouts ``gluon_decode._step`` unpacks.

A ring holds STAGES steps of every field a step reads (K bytes, V bytes, K scales / zeros, V scales / zeros), per
warp; ``stage_step`` starts the copies of step i + 1 while step i unpacks. Each thread copies exactly the bytes whose
values its mma fragments later hold (the rows and bytes ``gluon_decode``'s docstring draws), so the read back is a
plain shared-memory load in the unpacker's layout. A copy's address is its page's pointer (``_page``: INT2 pages
grow from the top of the buffer) plus a loop-invariant offset and an immediate, and only a split's last step masks
(``_stage_copies``): tokens past the split or the sequence are zero-filled and read as 0.
"""

from __future__ import annotations

from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_attend import _row_major_shared
from .gluon_fragments import GL_FMT_FP8, GL_FMT_INT2, GL_FMT_INT4, GL_FMT_NVFP4, chan_layout, cp_async, idx3, idx4, pair_layout
from .page_ids import INT2_PAGE_FLAG

FLAG: gl.constexpr = gl.constexpr(INT2_PAGE_FLAG)


@gluon.constexpr_function
def row_bytes(fmt: int) -> int:
    """Bytes per token row of head_dim 128: INT2 32, nvfp4 / int4 64, fp8 128."""
    return {0: 64, 1: 64, 2: 32, 3: 128}[fmt]


@gluon.constexpr_function
def v_group_bytes(fmt: int) -> int:
    """Bytes of a V row per scale group in the V layouts (v_layouts): an nvfp4 block pair 8, an int group 16 / 8;
    fp8 has no groups: 16 = a thread's D/8 channels."""
    return {0: 8, 1: 16, 2: 8, 3: 16}[fmt]


@gluon.jit
def _page(pt_row_ptr, pidx, page_hi, buf_ptr, total_bytes, PAGE_BYTES: gl.constexpr, INT2: gl.constexpr):
    """uint8 pointer to the start of page pidx (INT2 pages grow from the top); page ids past page_hi read page 0.

    One value per distinct page a thread touches (the compiler shares it between the rows of that page), so a
    copy's address is this pointer plus a loop-invariant int32 offset and an immediate."""
    pid = gl.load(pt_row_ptr + pidx, mask=pidx < page_hi, other=0)
    if INT2:
        off = total_bytes - ((pid & ~FLAG) + 1).to(gl.int64) * PAGE_BYTES
    else:
        off = pid.to(gl.int64) * PAGE_BYTES
    return buf_ptr + off


@gluon.jit
def valid_tokens(base, page_hi, num_tokens, P: gl.constexpr):
    """Tokens of the step starting at page base that are valid (the split's pages and the sequence's tokens):
    token t of the step (t = warp * NT + token in the warp) is valid iff t < valid_tokens(...)."""
    return gl.minimum(page_hi * P, num_tokens) - base * P


@gluon.jit
def in_limit(lim, w, n, NT: gl.constexpr, LANES: gl.constexpr, LEAN: gl.constexpr):
    """w * NT + n < lim for token n of warp w's step. LEAN: as (n & ~LANES) < lim - w * NT - (n & LANES), with LANES
    the bits of n that the lanes hold, so a thread keeps one lane-dependent value and compares each register's
    constant part, where w * NT + n keeps one register per element across the loop."""
    if LEAN:
        ok = (n & ~LANES) < lim - w * NT - (n & LANES)
    else:
        ok = w * NT + n < lim
    return ok


@gluon.constexpr_function
def _k_rows_layout(fmt: int, w: int) -> Any:
    """[W, NT, KB] of a step's K bytes as thread (g, c) copies them and reads them back: rows g + 8r, bytes
    [c * KB/4, (c+1) * KB/4) of each (one layout for both, so each thread reads only what it copied)."""
    return gl.BlockedLayout([1, 1, row_bytes(fmt) // 4], [1, 8, 4], [w, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _k_group_bytes(fmt: int) -> int:
    """K bytes per scale group: an nvfp4 block pair 8, an INT4 group 16; INT2 / fp8 a thread's KB/4 (no split)."""
    return 8 if fmt == 0 else (16 if fmt == 1 else row_bytes(fmt) // 4)


@gluon.constexpr_function
def _row_layout(w: int, rows: int, per_thread: int) -> Any:
    """[W, rows, n] with per_thread contiguous elements a thread (one cp.async of 8 bytes), rows over the lanes."""
    return gl.BlockedLayout([1, 1, per_thread], [1, 32, 1], [w, 1, 1], [2, 1, 0])


@gluon.jit
def make_rings(FMT: gl.constexpr, NT: gl.constexpr, HP: gl.constexpr, STAGES: gl.constexpr, LV_LOAD: gl.constexpr):
    """Shared-memory rings of STAGES steps for every field a step reads: (K bytes, V bytes, K scales, K zeros,
    V scales, V zeros); nvfp4 has no zeros (its rings alias the scales')."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    KB: gl.constexpr = row_bytes(FMT)
    VG: gl.constexpr = v_group_bytes(FMT)
    NGR: gl.constexpr = D // 32
    kr = gl.allocate_shared_memory(gl.uint8, [STAGES, W, NT, KB], _row_major_shared(3))
    vr = gl.allocate_shared_memory(gl.uint8, [STAGES, W, NT, KB // VG, VG], _row_major_shared(4))
    if FMT == GL_FMT_FP8:  # no scales: the unused rings alias the K ring
        ksr = kr
        vsr = kr
        kzr = kr
        vzr = kr
    elif FMT == GL_FMT_NVFP4:
        ksr = gl.allocate_shared_memory(gl.uint8, [STAGES, W, NT, D // 16], _row_major_shared(3))
        vsr = gl.allocate_shared_memory(gl.uint8, [STAGES, W, NT, D // 16], _row_major_shared(3))
        kzr = ksr
        vzr = vsr
    else:
        vsr = gl.allocate_shared_memory(gl.int32, [STAGES, W, NGR, NT // 2], _row_major_shared(3))
        vzr = gl.allocate_shared_memory(gl.int32, [STAGES, W, NGR, NT // 2], _row_major_shared(3))
        if INT2:
            ksr = gl.allocate_shared_memory(gl.float16, [STAGES, W, D], _row_major_shared(2))
            kzr = gl.allocate_shared_memory(gl.float16, [STAGES, W, D], _row_major_shared(2))
        else:
            ksr = gl.allocate_shared_memory(gl.float16, [STAGES, W, NT, NGR], _row_major_shared(3))
            kzr = gl.allocate_shared_memory(gl.float16, [STAGES, W, NT, NGR], _row_major_shared(3))
    return kr, vr, ksr, kzr, vsr, vzr


@gluon.jit
def stage_step(rings, slot, pt_row, base, hi, num_tokens, h, buf_ptr, total_bytes, FMT: gl.constexpr,
               P: gl.constexpr, PPW: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
               KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
               VZ_OFF: gl.constexpr, LV_LOAD: gl.constexpr, LEAN: gl.constexpr = 0):  # fmt: skip
    """Start the cp.async copies of one step's bytes (pages base + w*PPW .. of warp w) into ring slot ``slot``;
    tokens past the split or the sequence are zero-filled, so they read as 0. A step whose
    tokens are all valid (every step of a split but its last) copies without masks (_stage_copies)."""
    W: gl.constexpr = gl.num_warps()
    lim = valid_tokens(base, hi, num_tokens, P)
    if lim >= W * PPW * P:
        _stage_copies(rings, slot, pt_row, base, hi, lim, h, buf_ptr, total_bytes, FMT, P, PPW, PAGE_BYTES, K_OFF,
                      KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, LV_LOAD, False, LEAN)  # fmt: skip
    else:
        _stage_copies(rings, slot, pt_row, base, hi, lim, h, buf_ptr, total_bytes, FMT, P, PPW, PAGE_BYTES, K_OFF,
                      KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, LV_LOAD, True, LEAN)  # fmt: skip


@gluon.jit
def _stage_copies(rings, slot, pt_row, base, hi, lim, h, buf_ptr, total_bytes, FMT: gl.constexpr, P: gl.constexpr,
                  PPW: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr,
                  KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr,
                  LV_LOAD: gl.constexpr, MASKED: gl.constexpr, LEAN: gl.constexpr = 0):  # fmt: skip
    """stage_step's copies with each address = its page's pointer (_page) + a loop-invariant int32 offset; masked
    (zero-fill past ``lim`` valid tokens of the step, see valid_tokens) only where MASKED: a step whose pages are all
    inside the split and the sequence (every step but a split's last) runs the copies without masks or size
    selects."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = PPW * P
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    KB: gl.constexpr = row_bytes(FMT)
    VG: gl.constexpr = v_group_bytes(FMT)
    NGR: gl.constexpr = D // 32
    kr, vr, ksr, kzr, vsr, vzr = rings
    LK3: gl.constexpr = _k_rows_layout(FMT, W)
    kw, kn, kj = idx3(LK3, W, NT, KB)
    # each offset = a part fixed by the lane (shared by a thread's copies of one page) + a constant per register
    # (an immediate of the copy): K rows g + 8r (lanes g: token bits 0-2), bytes c * KB/4 + j (lanes c)
    KT: gl.constexpr = KB // 4  # K bytes a thread copies per row
    kp = _page(pt_row, base + kw * PPW + kn // P, hi, buf_ptr, total_bytes, PAGE_BYTES, INT2)
    kp = (kp + (K_OFF + (h * P + (kn & 7)) * KB + kj // KT * KT)) + ((kn & ~7) % P * KB + kj % KT)
    # V: tokens 2c + {0, 1, 8, 9, ..} (lanes c: token bits 1-2), KB/8 contiguous bytes a thread (v_layouts)
    VT: gl.constexpr = KB // 8
    vw, vn, vg, vj = idx4(LV_LOAD, W, NT, KB // VG, VG)
    vb = vg * VG + vj
    vp = _page(pt_row, base + vw * PPW + vn // P, hi, buf_ptr, total_bytes, PAGE_BYTES, INT2)
    vp = (vp + (V_OFF + (h * P + (vn & 6)) * KB + vb // VT * VT)) + ((vn & ~6) % P * KB + vb % VT)
    if MASKED:
        cp_async(kr.index(slot), kp, mask=in_limit(lim, kw, kn, NT, 7, LEAN))
        cp_async(vr.index(slot), vp, mask=in_limit(lim, vw, vn, NT, 6, LEAN))
    else:
        cp_async(kr.index(slot), kp)
        cp_async(vr.index(slot), vp)
    if FMT == GL_FMT_FP8:
        pass  # no scales
    elif FMT == GL_FMT_NVFP4:
        LS: gl.constexpr = _row_layout(W, NT, D // 16)  # a token's 8 block scales: one 8-byte copy
        sw, sn, sj = idx3(LS, W, NT, D // 16)
        sp = _page(pt_row, base + sw * PPW + sn // P, hi, buf_ptr, total_bytes, PAGE_BYTES, INT2)
        sp = sp + ((h * P + sn % P) * (D // 16) + sj)
        if MASKED:
            sok = in_limit(lim, sw, sn, NT, 31, LEAN)
            cp_async(ksr.index(slot), sp + KS_OFF, mask=sok)
            cp_async(vsr.index(slot), sp + VS_OFF, mask=sok)
        else:
            cp_async(ksr.index(slot), sp + KS_OFF)
            cp_async(vsr.index(slot), sp + VS_OFF)
    else:
        # V scales / zeros: the warp's page's [D/32, P] token-minor fp16 rows as int32 token pairs (8 bytes a thread)
        LP: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, NGR, 32 // NGR], [W, 1, 1], [2, 1, 0])
        pw, pg, pn = idx3(LP, W, NGR, NT // 2)
        pp = _page(pt_row, base + pw * PPW + (2 * pn) // P, hi, buf_ptr, total_bytes, PAGE_BYTES, INT2)
        prow = h * P + (2 * pn) % P
        pp = pp.to(gl.pointer_type(gl.int32), bitcast=True) + ((prow // P) * NGR + pg) * (P // 2) + (prow % P) // 2
        if MASKED:
            pok = in_limit(lim, pw, 2 * pn, NT, 28, LEAN)
            cp_async(vsr.index(slot), pp + VS_OFF // 4, mask=pok)
            cp_async(vzr.index(slot), pp + VZ_OFF // 4, mask=pok)
        else:
            cp_async(vsr.index(slot), pp + VS_OFF // 4)
            cp_async(vzr.index(slot), pp + VZ_OFF // 4)
        if INT2:
            # the warp's page's per-channel key scales and zeros [D] fp16 (8 bytes a thread)
            LC: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
            cw = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, LC)), 1)
            cc = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, LC)), 0)
            cp = _page(pt_row, base + cw, hi, buf_ptr, total_bytes, PAGE_BYTES, INT2)
            cp = cp.to(gl.pointer_type(gl.float16), bitcast=True) + (h * 128 + cc)
            if MASKED:
                cok = (cw * NT < lim) & (cc >= 0)
                cp_async(ksr.index(slot), cp + KS_OFF // 2, mask=cok)
                cp_async(kzr.index(slot), cp + KZ_OFF // 2, mask=cok)
            else:
                cp_async(ksr.index(slot), cp + KS_OFF // 2)
                cp_async(kzr.index(slot), cp + KZ_OFF // 2)
        else:
            LS4: gl.constexpr = _row_layout(W, NT, NGR)  # a token's 4 group scales (zeros): one 8-byte copy
            sw, sn, sj = idx3(LS4, W, NT, NGR)
            sp = _page(pt_row, base + sw * PPW + sn // P, hi, buf_ptr, total_bytes, PAGE_BYTES, INT2)
            sp = sp.to(gl.pointer_type(gl.float16), bitcast=True) + ((h * P + sn % P) * NGR + sj)
            if MASKED:
                sok = in_limit(lim, sw, sn, NT, 31, LEAN)
                cp_async(ksr.index(slot), sp + KS_OFF // 2, mask=sok)
                cp_async(kzr.index(slot), sp + KZ_OFF // 2, mask=sok)
            else:
                cp_async(ksr.index(slot), sp + KS_OFF // 2)
                cp_async(kzr.index(slot), sp + KZ_OFF // 2)


@gluon.jit
def read_step(rings, slot, pt_row, base, hi, num_tokens, h, total_bytes, FMT: gl.constexpr, P: gl.constexpr,
              PPW: gl.constexpr, HP: gl.constexpr, PAGE_BYTES: gl.constexpr, LV_LOAD: gl.constexpr,
              LV_UNPACK: gl.constexpr):  # fmt: skip
    """One staged step from ring slot ``slot`` into registers, raw: (K bytes, V bytes, K scales, K zeros, V scales,
    V zeros), in the layouts _step unpacks."""
    kb = read_kb(rings, slot, FMT, PPW * P)
    vb = rings[1].index(slot).load(LV_LOAD)
    # the order of the loads steers ptxas's schedule: nvfp4 reads K scales first, INT4 / INT2 V scales first
    if FMT == GL_FMT_NVFP4:
        ks, kz = read_kscales(rings, slot, kb, FMT, HP)
        vs, vz = _read_vscales(rings, slot, vb, base, hi, num_tokens, FMT, P, PPW, LV_UNPACK)
    else:
        vs, vz = _read_vscales(rings, slot, vb, base, hi, num_tokens, FMT, P, PPW, LV_UNPACK)
        ks, kz = read_kscales(rings, slot, kb, FMT, HP)
    return kb, vb, ks, kz, vs, vz


@gluon.constexpr_function
def _k_layout(fmt: int, w: int) -> Any:
    """Layout [W, NT, groups, per group] of a step's K bytes as _step unpacks them (one scale group a row of 4th
    dim; INT2 / fp8 keep the copy's [W, NT, KB] layout)."""
    kb = row_bytes(fmt)
    kg = _k_group_bytes(fmt)
    return gl.BlockedLayout([1, 1, (kb // 4) // kg, kg], [1, 8, 4, 1], [w, 1, 1, 1], [3, 2, 1, 0])


@gluon.jit
def read_kb(rings, slot, FMT: gl.constexpr, NT: gl.constexpr):
    """A staged step's K bytes from ring slot ``slot``."""
    W: gl.constexpr = gl.num_warps()
    KB: gl.constexpr = row_bytes(FMT)
    KG: gl.constexpr = _k_group_bytes(FMT)
    kb = rings[0].index(slot).load(_k_rows_layout(FMT, W))
    if FMT == GL_FMT_NVFP4 or FMT == GL_FMT_INT4:
        kb = gl.convert_layout(gl.reshape(kb, [W, NT, KB // KG, KG]), _k_layout(FMT, W), assert_trivial=True)
    return kb


@gluon.jit
def read_kscales(rings, slot, kb, FMT: gl.constexpr, HP: gl.constexpr):
    """A staged step's K scales and zeros from ring slot ``slot`` (kb: the step's K bytes, which fp8 returns in
    their place)."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    kr, vr, ksr, kzr, vsr, vzr = rings
    LK: gl.constexpr = _k_layout(FMT, W)
    if FMT == GL_FMT_FP8:
        ks = kb
        kz = kb
    elif FMT == GL_FMT_NVFP4:
        ks = ksr.index(slot).load(gl.SliceLayout(3, LK))
        kz = ks
    elif INT2:
        CL: gl.constexpr = chan_layout(W, HP)
        full = gl.zeros([W, D, HP], gl.float16, CL)
        ks = gl.broadcast(gl.expand_dims(ksr.index(slot).load(gl.SliceLayout(2, CL)), 2), full)[0]
        kz = gl.broadcast(gl.expand_dims(kzr.index(slot).load(gl.SliceLayout(2, CL)), 2), full)[0]
    else:
        ks = ksr.index(slot).load(gl.SliceLayout(3, LK))
        kz = kzr.index(slot).load(gl.SliceLayout(3, LK))
    return ks, kz


@gluon.jit
def read_v(rings, slot, base, hi, num_tokens, FMT: gl.constexpr, P: gl.constexpr, PPW: gl.constexpr,
           LV_LOAD: gl.constexpr, LV_UNPACK: gl.constexpr, LEAN: gl.constexpr = 0):  # fmt: skip
    """A staged step's V side from ring slot ``slot``: (V bytes, V scales, V zeros)."""
    vb = rings[1].index(slot).load(LV_LOAD)
    vs, vz = _read_vscales(rings, slot, vb, base, hi, num_tokens, FMT, P, PPW, LV_UNPACK, LEAN)
    return vb, vs, vz


@gluon.jit
def _read_vscales(rings, slot, vb, base, hi, num_tokens, FMT: gl.constexpr, P: gl.constexpr, PPW: gl.constexpr,
                  LV_UNPACK: gl.constexpr, LEAN: gl.constexpr = 0):  # fmt: skip
    """A staged step's V scales and zeros from ring slot ``slot`` (vb: the step's V bytes, which fp8 returns in
    their place).

    The V scale / zero pairs of INT4 / INT2 pages are masked in every step: masking them only in a split's last
    step (behind a uniform test) takes more registers and is slower."""
    W: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = PPW * P
    kr, vr, ksr, kzr, vsr, vzr = rings
    if FMT == GL_FMT_FP8:
        vs = vb
        vz = vb
    elif FMT == GL_FMT_NVFP4:
        vs = vsr.index(slot).load(gl.SliceLayout(3, LV_UNPACK))
        vz = vs
    else:
        LVP: gl.constexpr = pair_layout(LV_UNPACK)
        pw, pn, pg = idx3(LVP, W, NT // 2, 1)
        lim = valid_tokens(base, hi, num_tokens, P)
        vs = vsr.index(slot).permute([0, 2, 1]).load(LVP)
        vz = vzr.index(slot).permute([0, 2, 1]).load(LVP)
        if LEAN:
            second = in_limit(lim - 1, pw, 2 * pn, NT, 6, LEAN)
        else:
            second = pw * NT + 2 * pn + 1 < lim
        keep = gl.where(second, -1, 0xFFFF)  # the second token of a pair past the
        vs = vs & keep  # sequence reads 0 (its bytes may be any stale fp16, inf or NaN)
        vz = vz & keep
    return vs, vz

"""The Gluon kernels' PTX unpackers, run on the CPU by a small interpreter of the PTX they use.

The Gluon decode kernels cannot run without a GPU, so CI would otherwise never
execute their bit tricks (nibble / crumb placement in fp16 mantissas, magic
numbers, the 4^k spreads of the INT2 codes). Each unpacker string from
``gluon_fragments`` is interpreted here, instruction by instruction (32-bit
integer ops exact, f16x2 ops rounded once to fp16 as the hardware does), on
random words and scales, and every output half is compared with the value the
page format defines for that nibble or crumb.
"""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from kvserving.kernels import gluon_extend_tri as ge
from kvserving.kernels import gluon_fragments as gd

M32 = 0xFFFFFFFF
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _f16(bits: int) -> Fraction:
    return Fraction(float(np.array([bits], dtype=np.uint16).view(np.float16)[0]))


def _bits16(x: Fraction) -> int:
    # exact rational -> nearest fp16 (via float64: every value here is exact in float64)
    return int(np.array([np.float16(float(x))]).view(np.uint16)[0])


def _halves(r: int) -> tuple[Fraction, Fraction]:
    return _f16(r & 0xFFFF), _f16(r >> 16)


def _pack(lo: Fraction, hi: Fraction) -> int:
    return _bits16(lo) | _bits16(hi) << 16


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(32):
        idx = ((a >> i & 1) << 2) | ((b >> i & 1) << 1) | (c >> i & 1)
        out |= (lut >> idx & 1) << i
    return out


def run_ptx(asm: str, operands: list[int]) -> list[int]:
    """Interpret the unpacker's PTX; operands are $0.. (outputs first, any value) -> the outputs' registers."""
    regs: dict[str, int] = {f"${i}": v & M32 for i, v in enumerate(operands)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if "|" in tok:
            lo, hi = tok.split("|")
            return (val(lo) & 0xFFFF) | (val(hi) & 0xFFFF) << 16
        return regs[tok] if tok in regs else int(tok, 0) & M32

    body = re.sub(r"\{\s*(\$\d+)\s*,\s*(\$\d+)\s*\}", r"\1|\2", asm)  # a vector {lo, hi} of 16-bit operands
    body = body.replace("{", " ").replace("}", " ")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        dst, src = a[0], a[1:]
        if op == "mov.b32" and len(a) == 5:  # {b0, b1, b2, b3}, x: the bytes of x, low byte first
            for j, name in enumerate(a[:4]):
                regs[name] = val(a[4]) >> (8 * j) & 0xFF
            continue
        if op == "cvt.rn.f16x2.e2m1x2":  # byte (hi nibble | lo nibble) -> the exact fp16 pair (lo, hi) (PTX ISA)
            r = _pack(_e2m1(val(src[0])), _e2m1(val(src[0]) >> 4))
        elif op == "mov.b32":
            r = val(src[0])
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "or.b32":
            r = val(src[0]) | val(src[1])
        elif op == "shl.b32":
            r = val(src[0]) << val(src[1]) & M32
        elif op == "shr.b32":
            r = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":
            r = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
        elif op == "prmt.b32":
            x, y, sel = val(src[0]), val(src[1]), val(src[2])
            pool = x | y << 32
            r = sum((pool >> (8 * (sel >> (4 * i) & 7)) & 0xFF) << (8 * i) for i in range(4))
        elif op == "setp.ne.b32":
            r = int(val(src[0]) != val(src[1]))
        elif op == "selp.b32":
            r = val(src[0]) if regs[src[2]] else val(src[1])
        elif op in ("mul.rn.f16x2", "sub.rn.f16x2", "fma.rn.f16x2"):
            xs = [_halves(val(t)) for t in src]
            res = []
            for h in range(2):
                if op == "mul.rn.f16x2":
                    res.append(xs[0][h] * xs[1][h])
                elif op == "sub.rn.f16x2":
                    res.append(xs[0][h] - xs[1][h])
                else:
                    res.append(xs[0][h] * xs[1][h] + xs[2][h])  # one rounding (fma)
            r = _pack(res[0], res[1])
        else:
            raise AssertionError(f"unknown PTX op in an unpacker: {op}")
        assert re.fullmatch(r"\$\d+|[a-z]\w*", dst), dst
        regs[dst] = r
    return [regs[f"${i}"] for i in range(len(operands))]


def _byte(word: int, j: int) -> int:
    return word >> (8 * j) & 0xFF


def _e2m1(nib: int) -> Fraction:
    v = Fraction(E2M1[nib & 7])
    return -v if nib & 8 else v


def _rand_f16(rng: np.random.Generator, lo: float, hi: float) -> Fraction:
    return _f16(_bits16(Fraction(float(rng.uniform(lo, hi)))))


# pairs of bytes an output register holds, in the unpackers' order: (b0, b2) then (b1, b3)
PAIRS = ((0, 2), (1, 3))


@pytest.mark.parametrize("cvt", [False, True])
@pytest.mark.parametrize("token_pairs", [False, True])
def test_e2m1_unpacker_gives_code_times_scale(token_pairs: bool, cvt: bool) -> None:
    # cvt: Blackwell's cvt.rn.f16x2.e2m1x2 unpacker, the same outputs bit for bit
    rng = np.random.default_rng(1)
    asm = gd._asm_e2m1_cvt(token_pairs) if cvt else gd._asm_e2m1(token_pairs)
    for _ in range(200):
        w = int(rng.integers(0, 1 << 32))
        sa, sb = _rand_f16(rng, 1, 448 * 128), _rand_f16(rng, 1, 448 * 128)
        if not token_pairs:
            sb = sa
        # one token: (s, s); token pairs: the word (s_a, s_b) (gluon_fragments.scale_pairs), four copies
        scales = [_pack(sa, sb)] * 4 if token_pairs else [_pack(sa, sa)] * 2
        out = run_ptx(asm, [0, 0, 0, 0, w] + scales)
        for i, reg in enumerate(out[:4]):
            nib_shift, (j0, j1) = 4 * (i // 2), PAIRS[i % 2]
            for half, (j, s) in enumerate(((j0, sa), (j1, sb))):
                want = _e2m1(_byte(w, j) >> nib_shift) * Fraction(1, 1 << 14) * s
                assert _halves(reg)[half] == _f16(_bits16(want)), (w, i, half)


def test_e2m1_cvt_unpacker_equals_bit_placement_for_every_e4m3_block_scale() -> None:
    # the decode's nvfp4 scales: E4M3 (0 and subnormals included, NaN not) times 2^7
    rng = np.random.default_rng(5)
    scales = [_f16(_bits16(Fraction(float(v)) * 128)) for v in torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()]
    words = [0, M32, 0x88888888] + [int(x) for x in rng.integers(0, 1 << 32, 6)]
    for token_pairs in (False, True):
        cvt, bits = gd._asm_e2m1_cvt(token_pairs), gd._asm_e2m1(token_pairs)
        for w in words:
            for sa, sb in zip(scales, scales[1:] + scales[:1]):
                regs = [_pack(sa, sb)] * 4 if token_pairs else [_pack(sa, sa)] * 2
                assert run_ptx(cvt, [0, 0, 0, 0, w] + regs)[:4] == run_ptx(bits, [0, 0, 0, 0, w] + regs)[:4], (w, sa)


@pytest.mark.parametrize("token_pairs", [False, True])
def test_int4_unpacker_gives_code_times_scale_plus_zero(token_pairs: bool) -> None:
    rng = np.random.default_rng(2)
    asm = gd._asm_int4(token_pairs)
    for _ in range(200):
        w = int(rng.integers(0, 1 << 32))
        sa, sb = _rand_f16(rng, 1e-3, 4), _rand_f16(rng, 1e-3, 4)
        za, zb = _rand_f16(rng, -30, 30), _rand_f16(rng, -30, 30)
        if not token_pairs:
            sb, zb = sa, za
        if token_pairs:  # scale and zero as four copies of the token pair's words (s_a, s_b), (z_a, z_b)
            out = run_ptx(asm, [0, 0, 0, 0, w] + [_pack(sa, sb)] * 4 + [_pack(za, zb)] * 4)
        else:  # one token: (s, s) pairs
            out = run_ptx(asm, [0, 0, 0, 0, w, _pack(sa, sa), _pack(sa, sa), _pack(za, za), _pack(za, za)])
        # outputs: lo b0/b2, lo b1/b3, hi b0/b2, hi b1/b3
        for i, reg in enumerate(out[:4]):
            nib_shift, (j0, j1) = 4 * (i // 2), PAIRS[i % 2]
            for half, (j, s, z) in enumerate(((j0, sa, za), (j1, sb, zb))):
                want = (_byte(w, j) >> nib_shift & 15) * s + z
                assert _halves(reg)[half] == _f16(_bits16(want)), (w, i, half)


def test_int2_key_unpacker_gives_exact_codes_spread_by_4_to_the_crumb() -> None:
    rng = np.random.default_rng(3)
    asm = gd._asm_int2_codes()
    for w in [0, M32] + [int(x) for x in rng.integers(0, 1 << 32, 300)]:
        out = run_ptx(asm, [0] * 8 + [w])
        for k in range(4):
            for r in range(2):
                reg = out[2 * k + r]
                for half, j in enumerate(PAIRS[r]):
                    assert _halves(reg)[half] == (_byte(w, j) >> (2 * k) & 3) * 4**k, (w, k, r, half)


def test_int2_value_unpacker_gives_code_times_scale_plus_zero() -> None:
    rng = np.random.default_rng(4)
    asm = gd._asm_int2_values()
    for _ in range(300):
        w = int(rng.integers(0, 1 << 32))
        # scales down into fp16's subnormals too (every crumb is read at its own magic: no s / 4 rounding)
        sa, sb = _f16(_bits16(Fraction(10.0 ** rng.uniform(-7, 0.6)))), _rand_f16(rng, 1e-3, 4)
        za, zb = _rand_f16(rng, -30, 30), _rand_f16(rng, -30, 30)
        out = run_ptx(asm, [0] * 8 + [w] + [_pack(sa, sb)] * 4 + [_pack(za, zb)] * 4)
        for k in range(4):
            for r in range(2):
                reg = out[2 * k + r]
                for half, (j, s, z) in enumerate(((PAIRS[r][0], sa, za), (PAIRS[r][1], sb, zb))):
                    code = _byte(w, j) >> (2 * k) & 3
                    want = code * s + z  # one fma rounding
                    assert _halves(reg)[half] == _f16(_bits16(want)), (w, k, r, half)


# ----------------------------------------------------------------------------
# the triaxial extend producer's row unpackers (gluon_extend_tri.asm_rows): one element = an INT4 word pair
# (words a | b << 16) or an INT2 halfword (bytes b0 | b1 << 8, the high half ignored); output k = quarter k
# ----------------------------------------------------------------------------


def _int4_codes(w: int, k: int) -> tuple[int, int]:
    return (w >> (4 * k)) & 15, (w >> (16 + 4 * k)) & 15  # nibble k of words a, b (channels 4w + k)


def _int2_codes(w: int, k: int) -> tuple[int, int]:
    return (w >> (2 * k)) & 3, (w >> (8 + 2 * k)) & 3  # crumb k of bytes b0, b1 (channels 4j + k)


def _h16(x: Fraction) -> int:
    return _bits16(x)


@pytest.mark.parametrize("kind", ["int4", "int2", "mixed"])
def test_extend_row_unpackers_give_code_times_the_row_scale_plus_zero(kind: str) -> None:
    rng = np.random.default_rng(5)
    asm = ge.asm_rows(kind)
    for n in range(300):
        w = int(rng.integers(0, 1 << 32))
        s = _f16(_bits16(Fraction(10.0 ** rng.uniform(-7, 0.6))))  # down into fp16's subnormals
        z = _rand_f16(rng, -30, 30)
        two = kind == "int2" or (kind == "mixed" and n % 2 == 1)
        ops = [0, 0, 0, 0, w, _h16(s), _h16(z)] + ([n % 2 * int(rng.integers(1, 1 << 31))] if kind == "mixed" else [])
        out = run_ptx(asm, ops)
        for k in range(4):
            codes = _int2_codes(w, k) if two else _int4_codes(w, k)
            for half in range(2):
                assert _halves(out[k])[half] == _f16(_bits16(codes[half] * s + z)), (kind, w, k, half)


@pytest.mark.parametrize("kind", ["int2k", "mixedk"])
def test_extend_key_unpackers_take_a_scale_pair_per_quarter(kind: str) -> None:
    # INT2 keys: quarter k's two values (channels 8c + k, 8c + 4 + k) each have their own per-channel scale and zero
    rng = np.random.default_rng(6)
    asm = ge.asm_rows(kind)
    for n in range(300):
        w = int(rng.integers(0, 1 << 32))
        sp = [(_rand_f16(rng, 1e-3, 4), _rand_f16(rng, 1e-3, 4)) for _ in range(4)]
        zp = [(_rand_f16(rng, -30, 30), _rand_f16(rng, -30, 30)) for _ in range(4)]
        pairs = [_pack(*x) for x in sp] + [_pack(*x) for x in zp]
        two = kind == "int2k" or n % 2 == 1
        if kind == "int2k":
            out = run_ptx(asm, [0, 0, 0, 0, w] + pairs)
        else:  # INT4 rows of a mixed step take the row's group scale / zero
            s, z = _rand_f16(rng, 1e-3, 4), _rand_f16(rng, -30, 30)
            out = run_ptx(asm, [0, 0, 0, 0, w, _h16(s), _h16(z)] + pairs + [n % 2 * 4])
        for k in range(4):
            for half in range(2):
                if two:
                    want = _int2_codes(w, k)[half] * sp[k][half] + zp[k][half]
                else:
                    want = _int4_codes(w, k)[half] * s + z
                assert _halves(out[k])[half] == _f16(_bits16(want)), (kind, w, k, half)


def test_the_interpreter_knows_a_wrong_unpacker() -> None:
    # the same INT2 code unpacker with the shift for the high bytes left out must fail the check above
    asm = gd._asm_int2_codes().replace("shr.b32 u, $8, 8;", "mov.b32 u, $8;")
    out = run_ptx(asm, [0] * 8 + [0x0300])  # crumb 0 of byte 1 = 3
    assert _halves(out[1])[0] == 0  # the broken one reads byte 0's crumb
    assert _halves(run_ptx(gd._asm_int2_codes(), [0] * 8 + [0x0300])[1])[0] == 3

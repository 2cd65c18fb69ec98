"""The extend kernel's PTX quarter unpackers (triton_codec.asm_quarters), run on a small PTX emulator.

The PTX only runs on a GPU (the ``gpu`` tests of test_triton_prefill.py hold the
whole kernel to the reference there); here every instruction the unpackers use
is emulated bit for bit (fp16 arithmetic rounded through numpy's float16; Blackwell's
cvt.rn.f16x2.e2m1x2 as the PTX ISA defines it, through the codec's E2M1 values), so a
wrong shift, mask or truth table fails on CPU. Each case checks all four
quarters of a word pair against the formats' definitions.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvserving.kernels.nvfp4 import E2M1_VALUES
from kvserving.kernels.triton_codec import asm_quarters as _asm_quarters

MASK32 = 0xFFFFFFFF


def _halves(x: int) -> np.ndarray:
    return np.frombuffer(struct.pack("<I", x), dtype=np.float16)


def _pack(a: np.ndarray) -> int:
    return int(struct.unpack("<I", np.asarray(a, dtype=np.float16).tobytes())[0])


def _run(asm: str, inputs: list[int]) -> list[np.ndarray]:
    """Execute the unpacker: inputs are $4, $5, ...; returns $0..$3 as fp16 pairs (low half = first element)."""
    regs = {f"${i + 4}": v for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        return int(tok) if tok.isdigit() else regs[tok]

    for stmt in asm.replace("\n", " ").split(";"):
        stmt = stmt.strip().lstrip("{").strip()
        if not stmt or stmt.startswith(".reg") or stmt == "}":
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # {b0, b1, b2, b3}, x: the four bytes of x, low byte first
            dsts, src = rest.split("}")
            for i, name in enumerate(d.strip() for d in dsts.strip("{ ").split(",")):
                regs[name] = (val(src.strip(", ")) >> (8 * i)) & 0xFF
            continue
        dst, *srcs = [a.strip() for a in rest.split(",")]
        a = [val(s) for s in srcs] if not (srcs and srcs[0].startswith("{")) else []
        if op == "mov.b32" and srcs[0].startswith("{"):  # {lo, hi}: two 16-bit operands into one register
            r = val(srcs[0].strip("{} ")) & 0xFFFF | (val(srcs[1].strip("{} ")) & 0xFFFF) << 16
        elif op == "mov.b32":
            r = a[0]
        elif op == "prmt.b32":  # default mode: byte i of the result = byte (selector nibble i & 7) of {a[1], a[0]}
            table = struct.pack("<II", a[0], a[1])
            r = sum(table[(a[2] >> (4 * i)) & 7] << (8 * i) for i in range(4))
        elif op == "shl.b32":
            r = (a[0] << a[1]) & MASK32
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "cvt.rn.f16x2.e2m1x2":  # byte (hi nibble | lo nibble) -> fp16 pair (lo, hi), exact (PTX ISA)
            r = _pack(np.array([E2M1_VALUES[a[0] & 0xF], E2M1_VALUES[a[0] >> 4]]))
        elif op == "lop3.b32":  # bit b of the result = lut[(a_b << 2) | (b_b << 1) | c_b]
            r = sum(((a[3] >> ((((a[0] >> b) & 1) << 2) | (((a[1] >> b) & 1) << 1) | ((a[2] >> b) & 1))) & 1) << b
                    for b in range(32))  # fmt: skip
        elif op == "mul.rn.f16x2":
            r = _pack(_halves(a[0]) * _halves(a[1]))
        elif op == "sub.rn.f16x2":
            r = _pack(_halves(a[0]) - _halves(a[1]))
        elif op == "fma.rn.f16x2":  # fp32 product and sum, one rounding: exact for the values used here
            r = _pack(_halves(a[0]).astype(np.float32) * _halves(a[1]) + _halves(a[2]))
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[dst] = r
    return [_halves(regs[f"${k}"]).astype(np.float64) for k in range(4)]


WORDS = [(0x0000, 0xFFFF), (0x1234, 0x8ACE), (0xF7F7, 0x0808), (0x8000, 0x0001), (0xA5C3, 0x5A3C)]


@pytest.mark.parametrize("words", WORDS)
def test_e2m1_quarters_are_nibble_k_times_the_scale(words: tuple[int, int]) -> None:
    scales = (128.0, 0.25 * 128.0)  # E4M3 block scales * 2^7, one per word of the pair
    out = _run(_asm_quarters("e2m1"), [words[0], words[1], _pack(np.array(scales))])
    for k in range(4):
        for e, (w, s) in enumerate(zip(words, scales)):
            code = (w >> (4 * k)) & 0xF
            # e2m1 * 2^-14 (the fp16 placement) times s * 2^7: the kernel's e2m1 * s * 2^-7
            assert out[k][e] == E2M1_VALUES[code] * 2.0**-14 * s, (k, e, hex(w))


@pytest.mark.parametrize("words", WORDS)
def test_int4_quarters_are_code_times_scale_plus_zero(words: tuple[int, int]) -> None:
    scale, zero = np.array([0.5, 0.125]), np.array([-3.0, 1.5])
    out = _run(_asm_quarters("int4"), [words[0], words[1], _pack(scale), _pack(zero)])
    for k in range(4):
        for e, w in enumerate(words):
            assert out[k][e] == ((w >> (4 * k)) & 0xF) * scale[e] + zero[e], (k, e, hex(w))


@pytest.mark.parametrize("words", [(0x00, 0xFF), (0x1B, 0xE4), (0x93, 0x6C)])
def test_int2_quarters_are_crumb_k(words: tuple[int, int]) -> None:
    scale, zero = np.array([0.25, 2.0]), np.array([1.0, -0.5])
    out = _run(_asm_quarters("int2"), [words[0], words[1], _pack(scale), _pack(zero)])
    codes = _run(_asm_quarters("int2_codes"), [words[0], words[1]])
    for k in range(4):
        for e, b in enumerate(words):
            crumb = (b >> (2 * k)) & 3
            assert codes[k][e] == crumb
            assert out[k][e] == crumb * scale[e] + zero[e], (k, e, hex(b))


@pytest.mark.parametrize("words", WORDS)
def test_e2m1_pair_unpacker_equals_the_quarter_unpacker(words: tuple[int, int]) -> None:
    # gluon_extend's unpacker takes both words in one register; same four quarters, bit for bit, for every nibble
    from kvserving.kernels.triton_codec import asm_e2m1_pair

    scales = _pack(np.array((128.0, 0.25 * 128.0)))
    want = _run(_asm_quarters("e2m1"), [words[0], words[1], scales])
    got = _run(asm_e2m1_pair(), [words[0] | words[1] << 16, scales])
    for k in range(4):
        assert np.array_equal(got[k], want[k]), (k, got[k], want[k])


def test_e2m1_pair_unpacker_covers_every_code() -> None:
    from kvserving.kernels.triton_codec import asm_e2m1_pair

    for code in range(16):
        word = code * 0x1111  # the code in all four nibbles of word a; word b: the next code
        nxt = ((code + 1) % 16) * 0x1111
        got = _run(asm_e2m1_pair(), [word | nxt << 16, _pack(np.array((128.0, 128.0)))])
        for k in range(4):  # e2m1 * 2^-14 times the scale 2^7
            assert got[k][0] == E2M1_VALUES[code] * 2.0**-7 and got[k][1] == E2M1_VALUES[(code + 1) % 16] * 2.0**-7, (code, k)


@pytest.mark.parametrize("words", WORDS)
def test_e2m1_pair_unpacker_with_one_fp16_scale(words: tuple[int, int]) -> None:
    # the int32-pair path of gluon_extend: one 16-bit scale operand, duplicated into both halves
    from kvserving.kernels.triton_codec import asm_e2m1_pair

    half = int(np.array(0.25 * 128.0, dtype=np.float16).view(np.uint16))
    want = _run(asm_e2m1_pair(), [words[0] | words[1] << 16, _pack(np.array((0.25 * 128.0, 0.25 * 128.0)))])
    got = _run(asm_e2m1_pair(half_scale=True), [words[0] | words[1] << 16, half])
    for k in range(4):
        assert np.array_equal(got[k], want[k]), (k, got[k], want[k])

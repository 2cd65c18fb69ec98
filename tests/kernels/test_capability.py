"""capability.py's table: what each GPU generation runs, with the device's capability mocked.

The decode / extend choices are checked through the kernels' own ``supported``
and paged_ops' ``decode_kernel`` with ``torch.cuda.get_device_capability``
replaced, on meta-device stand-ins for CUDA tensors (nothing is launched);
Blackwell's E2M1 unpacker (cvt.rn.f16x2.e2m1x2) is run on the PTX emulator of
test_triton_prefill_asm against the bit-placement unpacker and the codec's
E2M1 values, for every byte and every E4M3 block scale.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_triton_prefill_asm import _pack, _run

from kvserving.kernels import capability, gluon_decode, gluon_extend, gluon_extend_tri, paged_ops
from kvserving.kernels.capability import PORTABLE, KernelChoice, choose
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.nvfp4 import E2M1_VALUES
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.paged_kv import PagedKV
from kvserving.kernels.triton_codec import _asm_e2m1, _asm_e2m1_cvt

# capability -> (decode, extend, write, e2m1)
EXPECTED = {
    (8, 0): ("tl", "tl", "tl", "bits"),
    (8, 6): ("tl", "tl", "tl", "bits"),
    (8, 9): ("gluon", "tl", "tl", "bits"),
    (9, 0): ("gluon", "gluon", "tl", "bits"),
    (10, 0): ("gluon", "tl", "tl", "cvt"),
    (10, 3): ("gluon", "tl", "tl", "bits"),  # an untested minor: its major's kernels, no arch-specific instruction
    (12, 0): ("gluon", "tl", "tl", "cvt"),
    (7, 5): ("tl", "tl", "tl", "bits"),
    (13, 0): ("tl", "tl", "tl", "bits"),
}


@pytest.mark.parametrize("cap", sorted(EXPECTED))
def test_each_capability_gets_its_row(cap: tuple[int, int]) -> None:
    c = choose(cap)
    assert (c.decode, c.extend, c.write, c.e2m1) == EXPECTED[cap]


def test_no_device_but_a_gpu_reads_the_table() -> None:
    assert capability.device_choice(torch.device("cpu")) == PORTABLE


def test_a_row_refuses_a_kernel_name_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="extend='wgmma'"):
        KernelChoice(decode="gluon", extend="wgmma", write="tl", e2m1="bits")


class _FakeCuda:
    """A meta tensor that says it lives on cuda:0 (the kernels' checks read is_cuda / device only)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.is_cuda = True
        self.device = torch.device("cuda", 0)
        self.dtype = torch.bfloat16


def _kv(fmt: str) -> PagedKV:
    p = 32 if fmt == "triaxial" else 16
    lay = PageLayout.build("int4" if fmt == "triaxial" else fmt, page_size=p, kv_heads=8, head_dim=128)
    lay2 = PageLayout.build("int2", page_size=32, kv_heads=8, head_dim=128) if fmt == "triaxial" else None
    total = 4 * lay.page_bytes + (4 * lay2.page_bytes if lay2 else 0)
    return PagedKV(buffer=torch.empty(total, dtype=torch.uint8, device="meta"), layout=lay, int2_layout=lay2,
                   k_scale=1.0, v_scale=1.0)  # fmt: skip


@pytest.mark.parametrize("cap", [(8, 0), (9, 0), (10, 0), (12, 0)])
def test_the_kernels_supported_checks_follow_the_table(cap: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    decode, extend, _, _ = EXPECTED[cap]
    q: Any = _FakeCuda((2, 32, 128))
    for fmt in ("nvfp4", "triaxial", "fp8_e4m3"):
        assert gluon_decode.supported(_kv(fmt), q) == (decode == "gluon"), (cap, fmt)
        want = "gluon" if decode == "gluon" else "tl"
        assert paged_ops.decode_kernel(q, _kv(fmt), backend="triton", options=KernelOptions()) == want
    assert gluon_extend.supported(_kv("nvfp4"), q) == (extend == "gluon"), cap
    assert gluon_extend_tri.supported(_kv("triaxial"), q) == (extend == "gluon"), cap


def test_asking_for_gluon_where_the_table_says_tl_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="Gluon decode does not support"):
        paged_ops.decode_kernel(_FakeCuda((2, 32, 128)), _kv("nvfp4"), backend="triton",  # type: ignore[arg-type]
                                options=KernelOptions(decode_kernel="gluon"))  # fmt: skip


# --- Blackwell's E2M1 unpacker, on the PTX emulator ---------------------------------------------------------------

# every E4M3 block scale but NaN (0x7F), times 2^7 as the tl decode passes it: 0 and the subnormals included
E4M3_SCALES = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32) * 128.0


def test_cvt_unpacker_equals_bit_placement_and_the_codec_for_every_byte_and_scale() -> None:
    cvt, bits = _asm_e2m1_cvt(), _asm_e2m1()
    scales = E4M3_SCALES.numpy()
    for b in range(0, 256, 4):
        word = b | (b + 1) << 8 | (b + 2) << 16 | (b + 3) << 24
        for i in range(0, len(scales) - 3, 2):
            s = scales[i : i + 4]
            regs = [word, _pack(s[:2]), _pack(s[2:])]
            got, want = _run(cvt, regs), _run(bits, regs)
            for k in range(4):  # bit for bit, the sign of zero included
                assert np.array_equal(got[k], want[k]) and np.array_equal(np.signbit(got[k]), np.signbit(want[k])), (b, s)
            # outputs: lo nibbles of (b0, b1), of (b2, b3), then the hi nibbles; value = e2m1 * s * 2^-14
            for j in range(4):
                byte = (word >> (8 * j)) & 0xFF
                for nib, out in ((byte & 0xF, got[j // 2]), (byte >> 4, got[2 + j // 2])):
                    want_v = np.float16(E2M1_VALUES[nib] * s[j] * 2.0**-14)
                    assert out[j % 2] == want_v and np.signbit(out[j % 2]) == np.signbit(want_v), (hex(byte), s[j])

"""Which kernel each GPU generation runs: one table, compute capability -> decode / extend / write kernels.

``paged_ops`` and the kernels' ``supported`` checks read this table and
nothing else about the device, so what a GPU runs is stated once:

=========  ========================  =======  =======================  =====  =======  ===
capability  GPUs                     decode   extend                   write  E2M1     PDL
=========  ========================  =======  =======================  =====  =======  ===
8.0 - 8.8  A100, A10, RTX 30         tl       tl                       tl     bits     no
8.9        L4, L40S, RTX 40          gluon    tl                       tl     bits     no
9.0        H100, H200, GH200         gluon    gluon (wgmma)            tl     bits     yes
10.0       B200, GB200               gluon    tl                       tl     cvt      yes
12.0       RTX PRO 6000, RTX 50      gluon    tl                       tl     cvt      yes
other      (older or newer majors)   tl       tl                       tl     bits     no
=========  ========================  =======  =======================  =====  =======  ===

- decode ``gluon``: gluon_decode (mma.sync, cp.async; e4m3 conversion needs
  8.9); ``tl``: triton_decode.
- extend ``gluon``: gluon_extend (nvfp4) / gluon_extend_tri (triaxial), warp
  specialized around Hopper's ``wgmma``, which sm_100a and sm_120a do not
  have (Triton stops at instruction selection), so Blackwell runs
  triton_prefill's ``tl`` extend.
- E2M1 ``cvt``: both decodes unpack nvfp4 nibbles with Blackwell's
  ``cvt.rn.f16x2.e2m1x2`` (two values per instruction, SASS
  ``F2FP.F16.E2M1.UNPACK_B``) instead of placing bits with shifts and
  ``lop3`` (gluon_fragments._asm_e2m1_cvt, triton_codec.nibbles_e2m1), the
  same values bit for bit. The instruction exists on the arch-specific
  targets only, so only the exact capabilities compiled in CI get it.
- PDL: programmatic dependent launch (sm_90 and later). The decode step's
  small Triton kernels (norms, RoPE, SiLU, the KV write, the split merge)
  may then launch while the kernel before them drains, read their weights,
  and wait (``griddepcontrol.wait``) before anything that kernel writes;
  used where ``KernelOptions.pdl`` asks for it (``KernelOptions.overlaps``).

A capability missing from the table runs the row of its major with the
highest minor at or below it (bits for E2M1), and a major missing altogether
runs ``PORTABLE``. ``COMPILE_TARGETS`` are the capabilities
tests/kernels/test_capability_compile.py compiles every dispatchable kernel for
(without a GPU); ``PLACEMENT_MAJORS`` the GPU generations the operator places
nvfp4 and triaxial workers on (operator/render.py holds the same list; a test
keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The kernels one compute capability runs (see the module's table)."""

    decode: str  # "gluon" (gluon_decode) or "tl" (triton_decode)
    extend: str  # "gluon" (gluon_extend, gluon_extend_tri) or "tl" (triton_prefill)
    write: str  # "tl" (triton_write) on every GPU
    e2m1: str  # "cvt" (cvt.rn.f16x2.e2m1x2) or "bits" (bit placement) in the decodes' nvfp4 unpackers
    pdl: bool = False  # programmatic dependent launch (griddepcontrol) exists

    def __post_init__(self) -> None:
        for name, allowed in (("decode", ("gluon", "tl")), ("extend", ("gluon", "tl")), ("write", ("tl",)),
                              ("e2m1", ("cvt", "bits"))):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {allowed}")


PORTABLE = KernelChoice(decode="tl", extend="tl", write="tl", e2m1="bits")

TABLE: dict[tuple[int, int], KernelChoice] = {
    (8, 0): PORTABLE,
    (8, 9): KernelChoice(decode="gluon", extend="tl", write="tl", e2m1="bits"),
    (9, 0): KernelChoice(decode="gluon", extend="gluon", write="tl", e2m1="bits", pdl=True),
    (10, 0): KernelChoice(decode="gluon", extend="tl", write="tl", e2m1="cvt", pdl=True),
    (12, 0): KernelChoice(decode="gluon", extend="tl", write="tl", e2m1="cvt", pdl=True),
}

# compiled offline in CI (Triton's arch names: sm_90a, sm_100a, sm_120a)
COMPILE_TARGETS = ((9, 0), (10, 0), (12, 0))
# nvidia.com/gpu.compute.major values the operator's node affinity lists for nvfp4 and triaxial workers
PLACEMENT_MAJORS = (9, 10, 12)


def choose(capability: tuple[int, int]) -> KernelChoice:
    """The kernels compute capability ``capability`` (major, minor) runs."""
    if capability in TABLE:
        return TABLE[capability]
    same = [c for c in TABLE if c[0] == capability[0] and c <= capability]
    if not same:
        return PORTABLE
    # an untested minor of a known major: its major's row, without arch-specific instructions
    return replace(TABLE[max(same)], e2m1="bits")


def device_choice(device: torch.device) -> KernelChoice:
    """The kernels ``device`` runs: its capability's row on a GPU, PORTABLE elsewhere (interpreter tests)."""
    if device.type != "cuda":
        return PORTABLE
    major, minor = torch.cuda.get_device_capability(device)
    return choose((major, minor))

"""Every kernel the engine can dispatch compiles for Blackwell (sm_100a, sm_120a) without a GPU.

compile_offline.py runs the wrappers as the engine calls them, at the real
shapes, under a Triton driver that compiles each launch for the target and
launches nothing (one child process per target, both at once; the test session
runs under TRITON_INTERPRET=1, where kernels are not JIT functions). Checked
per target: each kernel of capability.TABLE's row compiles, its shared memory
fits the target's per-block limit (sm_120a has 99 KiB, not Hopper's 227), the
Gluon decode spills nothing, and Blackwell's E2M1 conversion
(cvt.rn.f16x2.e2m1x2) assembles in the tl decode and is in the Gluon decode's SASS. sm_90a is covered by the kernels' own tests
(test_gluon_decode, test_gluon_extend, test_gluon_extend_tri). The launches with programmatic dependent launch,
which Blackwell's rows take by default, compile for all three targets in test_pdl.

The Gluon extend kernels are Hopper's (``wgmma``): the test holds that they
do not compile for sm_100a / sm_120a, which is why the table runs the ``tl``
extend there; a Triton that lowers them would fail it and call for a new row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserving.kernels.capability import choose

HERE = Path(__file__).resolve().parent
# the most shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SHARED_LIMIT = {100: 232448, 120: 101376}
TARGETS = sorted(SHARED_LIMIT)
CASES = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def compiled() -> dict[int, dict[str, Any]]:
    procs = {sm: subprocess.Popen([sys.executable, str(HERE / "compile_offline.py"), str(sm)], env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for sm in TARGETS}  # fmt: skip
    out = {}
    for sm, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1200)
        assert proc.returncode == 0, stderr[-3000:]
        out[sm] = json.loads(stdout.strip().splitlines()[-1])
    return out


def _expected(sm: int) -> set[str]:
    """The kernels the engine launches on capability sm (capability.TABLE's row)."""
    row = choose((sm // 10, sm % 10))
    names = {"model:_rms_norm_kernel", "model:_rms_norm_kernel#2", "model:_silu_mul_kernel", "model:_qk_norm_rope_kernel"}
    for case in CASES:
        names |= {f"{case}:_write_kv_kernel", f"{case}:_decode_kernel", f"{case}:_gather_kernel",
                  f"{case}:" + ("_extend_kernel4" if case in ("nvfp4", "triaxial") else "_extend_kernel")}  # fmt: skip
    # the split merge compiles once per specialization (the JIT reuses it for the formats after the first two)
    names |= {"bf16:_merge_kernel", "fp8_e4m3:_merge_kernel"}
    names |= {"triaxial:_write_int2_keys_kernel", "triaxial:_write_int2_values_kernel", "triaxial:_decode_kernel#2"}
    # FP8 weights: the block GEMM per tile shape (M 16, 64, 256); M 16 splits K in 4, so its partials' sum too; the
    # GEMV at M 1 (no split at N 1024) and M 2 (2 splits: a second specialization of the sum)
    names |= {"fp8:_block_gemm_kernel", "fp8:_block_gemm_kernel#2", "fp8:_block_gemm_kernel#3", "fp8:_sum_splits_kernel"}
    names.add("fp8:_sum_splits_kernel#2")
    names |= {"fp8:_quantize_kernel", "fp8:_quantize_kernel#2"}  # the activation quantizer: one group a program, 16
    names |= {"fp8:_gemv_kernel", "fp8:_gemv_kernel#2", "bf16w:_gemv_kernel", "bf16w:_gemv_kernel#2", "bf16w:_gemv_kernel#3"}
    if row.e2m1 == "cvt":
        names.add("nvfp4-cvt:_decode_kernel")
    if row.decode == "gluon":
        names |= {f"gluon-{fmt}:_gl_decode_kernel" for fmt in ("nvfp4", "int4", "triaxial", "fp8_e4m3", "nvfp4-pdl", "triaxial-pdl")}
        names |= {f"gluon-{fmt}-pdl-fuse:_gl_decode_kernel" for fmt in ("nvfp4", "triaxial", "fp8_e4m3")}
    return names


@pytest.mark.parametrize("sm", TARGETS)
def test_every_dispatchable_kernel_compiles_for_blackwell_within_its_shared_memory(sm: int, compiled: dict[int, dict[str, Any]]) -> None:
    got = compiled[sm]
    assert set(got) == _expected(sm), sorted(set(got) ^ _expected(sm))
    failed = {name: r["error"] for name, r in got.items() if not r["ok"]}
    assert failed == {}, failed
    too_big = {name: r["shared"] for name, r in got.items() if r["shared"] > SHARED_LIMIT[sm]}
    assert too_big == {}, f"shared memory over sm_{sm}a's {SHARED_LIMIT[sm]} bytes per block: {too_big}"
    spills = {name: r["local"] for name, r in got.items() if r.get("local")}
    assert spills == {}, spills
    # the triaxial decode (LEAN) fits its cap of 128 registers with no stack either (its point: 4 programs an SM)
    tri = got.get("gluon-triaxial:_gl_decode_kernel", {"stack": 0, "regs": 0})
    assert tri["stack"] == 0 and tri["regs"] <= 128, tri
    # the Gluon decode of nvfp4 pages unpacks with the native conversion where the table says so (SASS
    # F2FP.F16.E2M1.UNPACK_B, one per byte: 128 in the kernel), and only there
    gl = got["gluon-nvfp4:_gl_decode_kernel"]
    cvt = choose((sm // 10, sm % 10)).e2m1 == "cvt"
    assert gl["e2m1_cvt"] == int(cvt) and (gl["e2m1_sass"] > 0) == cvt, gl
    assert all(r["e2m1_sass"] == 0 for name, r in got.items() if name.startswith("gluon-") and "nvfp4" not in name)
    # launched with programmatic dependent launch (triton_pdl): one griddepcontrol.wait (SASS ACQBULK), the same
    # registers and stack as without
    for fmt in ("nvfp4", "triaxial"):
        plain, pdl = got[f"gluon-{fmt}:_gl_decode_kernel"], got[f"gluon-{fmt}-pdl:_gl_decode_kernel"]
        assert (plain["griddep_wait"], pdl["griddep_wait"]) == (0, 1), fmt
        assert (pdl["regs"], pdl["stack"], pdl["local"]) == (plain["regs"], plain["stack"], plain["local"]), fmt
    # the splits merged in the kernel (the engine's launch at few splits): one arrival atomic more, the merge
    # launch's kernels none; triaxial still in 128 registers with no stack (4 programs an SM)
    for fmt in ("nvfp4", "triaxial", "fp8_e4m3"):
        fused = got[f"gluon-{fmt}-pdl-fuse:_gl_decode_kernel"]
        assert fused["atomics"] >= 1 and fused["griddep_wait"] == 1, (fmt, fused)
        assert got[f"gluon-{fmt}:_gl_decode_kernel"]["atomics"] == 0, fmt
    tri_fused = got["gluon-triaxial-pdl-fuse:_gl_decode_kernel"]
    assert tri_fused["stack"] == 0 and tri_fused["regs"] <= 128, tri_fused


# compiled in a child process each: LLVM aborts the process on an instruction the target lacks
_GLUON_EXTEND = """
import sys
from kvserving.kernels import gluon_extend, gluon_extend_tri
from kvserving.kernels.compile_report import report
mod = {"nvfp4": gluon_extend, "triaxial": gluon_extend_tri}[sys.argv[1]]
kernel, sig, const = mod.compile_report_args()
warps, maxnreg = const.pop("num_warps"), const.pop("maxnreg")
report(kernel, sig, const, gluon=True, num_warps=warps, maxnreg=maxnreg, sm=int(sys.argv[2]),
       aligned=("q_s0", "k_s0", "o_s0", "o_s1", "total_bytes"))
print("compiled")
"""


@pytest.mark.parametrize("sm", TARGETS)
@pytest.mark.parametrize("fmt", ["nvfp4", "triaxial"])
def test_the_hopper_gluon_extend_does_not_compile_for_blackwell_so_the_table_runs_tl(fmt: str, sm: int) -> None:
    assert choose((sm // 10, sm % 10)).extend == "tl"
    done = subprocess.run([sys.executable, "-c", _GLUON_EXTEND, fmt, str(sm)], env=_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and "compiled" not in done.stdout
    assert "wgmma" in done.stderr, done.stderr[-2000:]

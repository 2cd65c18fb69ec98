"""The Gluon extend kernel (gluon_extend.py): compiled for sm_90 here, held to fp64 attention on the GPU.

CPU (CI): the kernel needs a Hopper GPU (wgmma, PTX unpackers), so CI compiles
it for an H100 with the pinned Triton and checks what its speed rests on: the
producer hands registers to the consumers, each consumer's tensor-core work
of a step is two wgmma groups (S = q K^T, then PV), each waited once (ptxas
serializes every wgmma, one wait per instruction, when an accumulator is
touched while in flight: warning C7514), no barrier joins the two consumers,
and no register spills.

GPU (``gpu`` marker, device machine): extend at real shapes against fp64
attention over the codec-dequantized prefix plus the chunk, same bound as the
``tl`` kernel (test_triton_prefill.py), and against the ``tl`` kernel itself.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from test_paged_ref import rel_err
from test_triton_paged import BOUND, _filled_pool, expected_kv
from test_triton_prefill import dense_extend

from kvserving.kernels import gluon_extend, paged_ops, triton_prefill
from kvserving.kernels.options import KernelOptions

# compiled in a child process: the test session runs with TRITON_INTERPRET=1
_COMPILE = """
import json, re
from kvserving.kernels import gluon_extend
from kvserving.kernels.compile_report import loop_ops, report
kernel, sig, const = gluon_extend.compile_report_args()
warps = const.pop("num_warps")
maxnreg = const.pop("maxnreg", None)
r = report(kernel, sig, const, gluon=True, num_warps=warps, maxnreg=maxnreg, aligned=("q_s0", "k_s0", "o_s0", "o_s1"))
print(json.dumps({"local": r["local"], "shared": r["shared"], "regs": r["regs"], "loop": dict(loop_ops(r["sass"])),
                  "ops": dict(r["ops"]), "bars": re.findall(r"BAR\\.SYNC\\S* ([^;]*);", r["sass"])}))
"""


def _compile() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_gluon_extend_compiles_for_sm90_warp_specialized_with_each_wgmma_group_waited_once() -> None:
    r = _compile()
    ops = r["ops"]
    # the producer partition hands registers back (setmaxnreg dealloc to LOAD_REGS) and the consumers take them
    assert ops.get("USETMAXREG.DEALLOC.CTAPOOL", 0) >= 1 and ops.get("USETMAXREG.TRY_ALLOC.CTAPOOL", 0) >= 1, ops
    assert r["regs"] == gluon_extend.TUNING["maxnreg"] and r["local"] == 0
    assert r["shared"] <= 227 * 1024
    # each consumer warpgroup: 8 S + 8 PV m64n128k16 wgmma (the opcode histogram stops at the "x"), one arrive and
    # one wait per group (ptxas' serialization would wait after each of the 16)
    assert ops["HGMMA.64"] == 2 * 16 and ops["WARPGROUP.ARRIVE"] == 2 * 2 and ops["WARPGROUP.DEPBAR.LE"] == 2 * 2, ops
    # no barrier joins the two consumers: every barrier is a partition's 128 threads (named) or barrier 1
    # (warp_specialize's entry and exit)
    assert all(b.strip().endswith("0x80") or b.strip() == "0x1" for b in r["bars"]), collections.Counter(r["bars"])


def _store_wavefronts(reg: list[list[int]], lane: list[list[int]], n: int) -> int:
    """Most 16-byte stores of one 8-lane phase that hit the same 4 banks, over every register and quarter, when a
    thread's 4 pair columns (after the unpack: its 16 bytes of each quarter k, tile int32 column k * 16 + c) go to
    an [n, 64] int32 NVMMA tile with the 128-byte swizzle (16-byte chunk index XOR row % 8)."""
    worst = 0
    for r in range(0, 1 << len(reg), 4):  # registers 0-3 are one thread's 4 consecutive columns (one 16-byte store)
        for k in range(4):
            quads: list[int] = []
            for ln in range(32):
                row = col = 0
                for b, (dr, dc) in enumerate(reg):
                    if r >> b & 1:
                        row, col = row ^ dr, col ^ dc
                for b, (dr, dc) in enumerate(lane):
                    if ln >> b & 1:
                        row, col = row ^ dr, col ^ dc
                c = k * 16 + col
                quads.append(((c % 32) // 4) ^ (row % 8))
                assert row < n
            for ph in range(4):
                worst = max(worst, max(collections.Counter(quads[8 * ph : 8 * ph + 8]).values()))
    return worst


def test_conflict_free_rows_store_each_phase_in_one_wavefront() -> None:
    # cf_bases: lanes 4-7 of each 8 take the row 4 below, so the 8 lanes of a phase write 8 distinct chunks
    reg, lane, _ = gluon_extend.cf_bases(4, 128, 4)
    assert _store_wavefronts(reg, lane, 128) == 1
    # a blocked layout's lanes (rows r, r+1 in a phase) write the same quad of chunks: 2 wavefronts
    blocked_lane = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    assert _store_wavefronts(reg, blocked_lane, 128) == 2
    with pytest.raises(ValueError, match="multiple of"):
        gluon_extend.cf_bases(4, 48, 4)


def _check(prefix_lens: list[int], n_new: int) -> None:
    d, h, g, p = 128, 8, 4, 16
    pool, filled, scale = _filled_pool("nvfp4", prefix_lens, device="cuda", d=d, h=h, p=p)
    kv = pool.kv(scale, scale)
    sm = d**-0.5
    for i, start in enumerate(prefix_lens):
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(n_new, h * g, d, device="cuda").to(dtype)
            k_new = (torch.randn(n_new, h, d, device="cuda") * 2).to(dtype)
            v_new = torch.randn(n_new, h, d, device="cuda").to(dtype)
            pages = filled.page_table[i]
            assert gluon_extend.supported(kv, q)
            out = torch.full_like(q, float("nan"))
            out.copy_(gluon_extend.extend_attention(q, k_new, v_new, kv, pages, start, sm_scale=sm))
            assert out.dtype == q.dtype and out.shape == q.shape and out.isfinite().all()
            ek, ev = expected_kv(pool, filled, i, k_scale=scale, v_scale=scale)
            want = dense_extend(q.cpu(), torch.cat([ek, k_new.cpu()]), torch.cat([ev, v_new.cpu()]), start, sm)
            err = rel_err(out.cpu(), want)
            assert err < BOUND["nvfp4"] + (4e-3 if dtype == torch.bfloat16 else 0.0), (start, n_new, dtype, err)
            tl_out = triton_prefill.extend_attention(q, k_new, v_new, kv, pages, start, sm_scale=sm, fast=True)
            assert rel_err(out.cpu(), tl_out.cpu().double()) < 5e-3 + (4e-3 if dtype == torch.bfloat16 else 0.0)


@pytest.mark.gpu
def test_gpu_gluon_extend_real_shapes() -> None:
    # prefixes: whole steps + a partial page (odd step count), exactly one step, empty, 3000 (even step count);
    # 300 new tokens: 32-token blocks, the last partial, chunk steps of 128 keys, the last partial
    _check([16 * 40 + 7, 128, 0, 3000], 300)
    _check([1], 1)


@pytest.mark.gpu
def test_gpu_gluon_extend_supported_calls() -> None:
    pool, _, scale = _filled_pool("nvfp4", [20], device="cuda", d=128, h=8, p=16)
    q = torch.randn(3, 32, 128, device="cuda")
    assert gluon_extend.supported(pool.kv(scale, scale), q)
    assert not gluon_extend.supported(pool.kv(scale, scale), q[:, :16])  # 2 query heads per kv head
    assert not gluon_extend.supported(pool.kv(1e-6, 1e-6), q)  # a V fold too small for the chunk's fp16 P
    with pytest.raises(ValueError, match="does not support"):
        gluon_extend.extend_attention(q[:, :16], q[:, :8], q[:, :8], pool.kv(scale, scale), torch.zeros(2, dtype=torch.int32,
                                      device="cuda"), 20, sm_scale=0.1)  # fmt: skip


@pytest.mark.gpu
def test_gpu_paged_ops_extend_runs_the_gluon_kernel_on_nvfp4_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, filled, scale = _filled_pool("nvfp4", [40], device="cuda", d=128, h=8, p=16)
    kv = pool.kv(scale, scale)
    q, k, v = torch.randn(5, 32, 128, device="cuda"), torch.randn(5, 8, 128, device="cuda"), torch.randn(5, 8, 128, device="cuda")
    calls: list[int] = []
    launch = gluon_extend.extend_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(gluon_extend, "extend_attention", counted)
    out = paged_ops.extend_attention(q, k, v, kv, filled.page_table[0], 40, sm_scale=0.1, options=KernelOptions())
    assert calls == [1]
    ref = triton_prefill.extend_attention(q, k, v, kv, filled.page_table[0], 40, sm_scale=0.1, fast=True)
    assert calls == [1] and rel_err(out, ref) < 5e-3


def test_launch_staging_of_the_chunk_and_the_page_ids() -> None:
    """What both extend launches prepare on the host (gluon_attend): the chunk's k, v as fp16 quarter-major
    (channel 4j + i at column i * D/4 + j) and page ids the kernel can read, one never-read id for no prefix."""
    from kvserving.kernels.gluon_attend import chunk_kv, launch_io, launch_pages

    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    k_in, v_in = chunk_kv(k, v)
    assert k_in.shape == (3, 2, 4, 4) and k_in.dtype == v_in.dtype == torch.float16
    for i in range(4):
        for j in range(4):
            assert torch.equal(k_in[:, :, i, j], k[:, :, 4 * j + i].half())
            assert torch.equal(v_in[:, :, i, j], v[:, :, 4 * j + i].half())
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    pages = launch_pages(table[:, 1], torch.device("cpu"))
    assert pages.is_contiguous() and pages.tolist() == [1, 5, 9]
    empty = launch_pages(table[:0, 0], torch.device("cpu"))
    assert empty.tolist() == [0] and empty.dtype == torch.int32
    q = torch.randn(5, 8, 3).transpose(1, 2)  # channels not at unit stride
    q_in, out = launch_io(q)
    assert torch.equal(q_in, q) and q_in.stride(2) == 1 and out.stride(2) == 1 and out.shape == q.shape


def test_chunk_rows_reads_packed_rows_in_place_and_copies_the_rest() -> None:
    """The triaxial kernel reads the chunk's k, v at token stride k_s0, head stride D, unit channel
    stride, for both: chunk_rows passes such tensors through (contiguous ones, rows of one projection output) and
    makes contiguous copies of any other."""
    from kvserving.kernels.gluon_attend import chunk_rows

    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    assert all(a is b for a, b in zip(chunk_rows(k, v), (k, v), strict=True))
    kv = torch.randn(3, 2 * 2 * 16 + 8)  # one projection's rows: k and v side by side, a token stride of 72
    k2, v2 = kv[:, :32].view(3, 2, 16), kv[:, 32:64].view(3, 2, 16)
    assert all(a is b for a, b in zip(chunk_rows(k2, v2), (k2, v2), strict=True))
    for kk, vv in (
        (k.transpose(1, 2).contiguous().transpose(1, 2), v),
        (k, v[:, :, :8].repeat(1, 1, 2)),
        (k, torch.randn(3, 4, 16)[:, ::2]),
    ):  # channels strided; v's token stride not k's; heads strided
        k3, v3 = chunk_rows(kk, vv)
        assert k3.is_contiguous() and v3.is_contiguous() and torch.equal(k3, kk) and torch.equal(v3, vv)

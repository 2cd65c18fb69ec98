"""Programmatic dependent launch (triton_pdl): where it is used, that the kernels compile with it, and that they
give the same bytes with it as without, eagerly and inside a CUDA graph (``gpu``).

With PDL a kernel may start before the one it follows has finished; it is correct only if it reads and writes
nothing of the step's before ``griddepcontrol.wait``. A kernel that touched its input early would read the
previous step's values in a graph replayed with new inputs: the GPU tests replay graphs with new inputs and compare
every output with the plain launch bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from kvserving.kernels import options as options_mod
from kvserving.kernels.capability import choose
from kvserving.kernels.options import KernelOptions

HERE = Path(__file__).resolve().parent
T = TypeVar("T")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_pdl_rows_of_the_capability_table() -> None:
    assert [choose(c).pdl for c in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0))] == [False, False, True, True, True]
    assert choose((9, 1)).pdl and choose((10, 3)).pdl  # an untested minor keeps its major's launch features
    assert not choose((7, 5)).pdl and not choose((13, 0)).pdl  # unknown majors run the portable row


def test_overlaps_needs_the_option_a_gpu_with_pdl_and_no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = torch.device("cuda", 0)
    rows = {90: choose((9, 0)), 89: choose((8, 9))}
    sm = [90]
    monkeypatch.setattr(options_mod, "device_choice", lambda device: choose((0, 0)) if device.type != "cuda" else rows[sm[0]])
    assert KernelOptions().overlaps(gpu)  # on unless turned off
    assert not KernelOptions(pdl=False).overlaps(gpu)
    assert not KernelOptions(pdl=True, interpret=True).overlaps(gpu)
    assert not KernelOptions(pdl=True).overlaps(torch.device("cpu"))
    sm[0] = 89
    assert not KernelOptions(pdl=True).overlaps(gpu)
    assert KernelOptions.from_env({}).pdl and not KernelOptions.from_env({"KVSERVING_PDL": "0"}).pdl
    with pytest.raises(ValueError, match="KVSERVING_PDL='yes'"):
        KernelOptions.from_env({"KVSERVING_PDL": "yes"})


# compiled without a GPU (offline_driver) for the target argv[2], TRITON_INTERPRET unset: each kernel PDL may
# launch, with PDL and (sm_90 only: compile_offline.py compiles Blackwell's plain launches) without
_COMPILE = r"""
import json, sys
import torch
import triton.compiler
from triton.runtime import driver
sys.path.insert(0, sys.argv[1])
from offline_driver import NotLaunched, OfflineDriver
from test_paged_ref import fill_sequences, make_pool
from kvserving.kernels import fp8_gemm, triton_decode, triton_fp8_gemm, triton_norm, triton_pdl, triton_write

out, label, _compile = {}, ["?"], triton.compiler.compile

def compile_offline(src, target=None, options=None, **kw):
    kernel = _compile(src, target=target, options=options, **kw)
    ptx = kernel.asm["ptx"]
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    out[f"{label[0]}:{src.fn.__name__}"] = {"launch_pdl": bool(kernel.metadata.launch_pdl),
        "wait": ptx.count("griddepcontrol.wait"), "launch": ptx.count("griddepcontrol.launch_dependents"),
        "launch_first": 0 <= launch < wait}
    return NotLaunched()

sm = int(sys.argv[2])
driver.set_active(OfflineDriver(sm))
triton.compiler.compile = compile_offline
# each launch's mode from its rows: every launch below EARLY (LATE_ROWS 0), then LATE (LATE_ROWS above them all)
for name, pdl, late_rows in ([("plain", False, 0)] if sm == 90 else []) + [("early", True, 0), ("late", True, 1 << 20)]:
    label[0], triton_pdl.LATE_ROWS = name, late_rows
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    triton_norm.rms_norm(x, w, 1e-6, pdl=pdl)
    triton_norm.add_rms_norm(x, x.clone(), w, 1e-6, pdl=pdl)
    triton_norm.silu_mul(torch.randn(1, 2 * 1024, dtype=torch.bfloat16), pdl=pdl)
    qkv = torch.randn(1, 48 * 128, dtype=torch.bfloat16)
    wd = torch.ones(128, dtype=torch.bfloat16)
    triton_norm.qk_norm_rope(qkv, torch.ones(1, 128), torch.zeros(1, 128), num_heads=32, num_kv_heads=8,
                             head_dim=128, q_weight=wd, k_weight=wd, pdl=pdl)
    pool = make_pool("nvfp4", num_pages=6, page_size=16, kv_heads=8, head_dim=128)
    filled = fill_sequences(pool, [19, 37])
    kv = pool.kv(1.0, 1.0)
    t = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    triton_write.write_kv(kv, t, t, filled.page_table[1, 1:2], torch.zeros(1, dtype=torch.int32), pdl=pdl)
    q = torch.randn(2, 32, 128, dtype=torch.bfloat16)
    triton_decode.decode_attention(q, kv, filled.page_table, filled.seq_lens, sm_scale=0.1, fast=True, pdl=pdl)
    codes, scale = fp8_gemm.quantize_blocks(torch.randn(1024, 4096))
    triton_fp8_gemm.gemv(torch.randn(2, 4096, dtype=torch.bfloat16), codes, scale, pdl=pdl)  # M 2: K split, summed
    qa, sa = triton_fp8_gemm.quantize(torch.randn(16, 4096, dtype=torch.bfloat16), group=128, pdl=pdl)
    triton_fp8_gemm.block_gemm(qa, sa, codes, scale, pdl=pdl)  # M 16 x N 1024: K split, summed
print(json.dumps(out))
"""

# kernel: its griddepcontrol.wait instructions (the GEMV waits after its first step's weight loads, and again
# before its stores for a program with no step)
KERNELS = {"_rms_norm_kernel": 1, "_silu_mul_kernel": 1, "_qk_norm_rope_kernel": 1, "_write_kv_kernel": 1,
           "_merge_kernel": 1, "_decode_kernel": 1, "_gemv_kernel": 2, "_sum_splits_kernel": 1, "_quantize_kernel": 1,
           "_block_gemm_kernel": 1}  # fmt: skip


@pytest.mark.parametrize("sm", [90, 100, 120])
def test_the_kernels_compile_with_griddepcontrol_only_when_launched_with_pdl(sm: int) -> None:
    """sm_90 (Hopper) and sm_100a / sm_120a (Blackwell), whose capability rows launch with PDL too: EARLY lets the
    next kernel launch once, before the first wait; LATE after each wait; without PDL neither."""
    assert choose((sm // 10, sm % 10)).pdl
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(HERE), str(sm)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name, waits in KERNELS.items():
        early, late = got[f"early:{name}"], got[f"late:{name}"]
        assert early == {"launch_pdl": True, "wait": waits, "launch": 1, "launch_first": True}, (name, early)
        assert late == {"launch_pdl": True, "wait": waits, "launch": waits, "launch_first": False}, (name, late)
        if sm == 90:
            plain = got[f"plain:{name}"]
            assert plain == {"launch_pdl": False, "wait": 0, "launch": 0, "launch_first": False}, (name, plain)


def test_one_row_launches_let_the_next_kernel_launch_late() -> None:
    from kvserving.kernels import triton_pdl

    assert triton_pdl.LATE_ROWS == 1
    assert [triton_pdl.mode(True, rows) for rows in (1, 2, 8, 64)] == [triton_pdl.LATE] + [triton_pdl.EARLY] * 3
    assert [triton_pdl.mode(False, rows) for rows in (1, 2)] == [triton_pdl.OFF] * 2
    assert (triton_pdl.OFF, triton_pdl.EARLY, triton_pdl.LATE) == (0, 1, 2)  # the literals start / wait test
    # a launch's keywords: the mode and the launch attribute from the same choice (the interpreter gets no attribute)
    assert triton_pdl.launch(True, 1) == {"PDL": triton_pdl.LATE, "launch_pdl": True}
    assert triton_pdl.launch(True, 2) == {"PDL": triton_pdl.EARLY, "launch_pdl": True}
    assert triton_pdl.launch(False, 1) == triton_pdl.launch(False, 2) == {"PDL": triton_pdl.OFF}


# compiled for sm_90 in a child process: a compile in the test session can meet Triton objects the interpreter
# (TRITON_INTERPRET=1, which the session runs with) patched while an earlier test in the same worker ran a kernel
_COMPILE_GLUON = r"""
import json
from kvserving.kernels import gluon_decode
from kvserving.kernels.compile_report import report

out = {}
for fmt in ("nvfp4", "triaxial"):
    cfg = gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt]
    sig, const = gluon_decode.compile_report_args(fmt, heads=4)
    warps = const.pop("num_warps")
    runs = [report(gluon_decode._gl_decode_kernel, sig, const | {"PDL": pdl}, gluon=True, num_warps=warps, sm=90,
                   aligned=("total_bytes",), maxnreg=gluon_decode.register_cap(fmt, cfg, heads=4)) for pdl in (0, 1)]
    out[fmt] = {"const_pdl": const["PDL"], "waits": [r["ops"].get("ACQBULK", 0) for r in runs],
                "regs_stack": [[r["regs"], r["stack"]] for r in runs]}
print(json.dumps(out))
"""


def test_the_gluon_decode_waits_once_with_pdl_and_keeps_its_registers() -> None:
    """sm_90 here; sm_100a / sm_120a in test_capability_compile (compile_offline.py's "-pdl" launches)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_GLUON], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for fmt in ("nvfp4", "triaxial"):
        assert got[fmt]["const_pdl"] == 0, fmt  # as the launch without PDL compiles it
        assert got[fmt]["waits"] == [0, 1], fmt  # griddepcontrol.wait's SASS
        plain, pdl = got[fmt]["regs_stack"]
        assert pdl == plain, fmt


# ----------------------------------------------------------------------------
# GPU: the decode step's chain with and without PDL, eager and in a CUDA graph
# ----------------------------------------------------------------------------


def _pdl_gpu() -> None:
    if not choose(torch.cuda.get_device_capability()).pdl:
        pytest.skip("the GPU has no programmatic dependent launch")


def _captured(run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``run()`` once on a side stream (its kernels compile outside the capture), then captured in a CUDA graph:
    the graph and what the captured run returned (tensors each replay writes again)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def _layer(x: torch.Tensor, wts: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, *, pdl: bool) -> list[torch.Tensor]:
    """One decoder layer's non-attention chain as the model runs it (cuBLAS GEMMs between the fused kernels)."""
    from kvserving.kernels import triton_norm

    xn = triton_norm.rms_norm(x, wts["n1"], 1e-6, pdl=pdl)
    qkv = xn @ wts["qkv"]
    q, k, v = triton_norm.qk_norm_rope(qkv, cos, sin, num_heads=32, num_kv_heads=8, head_dim=128, q_weight=wts["qn"],
                                       k_weight=wts["kn"], eps=1e-6, pdl=pdl)  # fmt: skip
    o = q.reshape(x.shape[0], -1) @ wts["o"]
    h2, h = triton_norm.add_rms_norm(o, x, wts["n2"], 1e-6, pdl=pdl)
    act = triton_norm.silu_mul(h2 @ wts["gu"], pdl=pdl)
    out, h3 = triton_norm.add_rms_norm(act @ wts["down"], h, wts["n1"], 1e-6, pdl=pdl)
    return [q, k, v, out, h3]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])  # LATE, EARLY (triton_pdl.mode)
def test_gpu_norm_kernels_with_pdl_equal_plain_eager_and_in_a_replayed_graph(rows: int) -> None:
    _pdl_gpu()
    g = torch.Generator(device="cuda").manual_seed(5)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    wts = {"n1": rand(4096) + 1, "n2": rand(4096) + 1, "qn": rand(128) + 1, "kn": rand(128) + 1,
           "qkv": rand(4096, 48 * 128, scale=0.02), "o": rand(4096, 4096, scale=0.02),
           "gu": rand(4096, 2 * 12288, scale=0.02), "down": rand(12288, 4096, scale=0.02)}  # fmt: skip
    inputs = [(rand(rows, 4096), rand(rows, 128), rand(rows, 128)) for _ in range(4)]
    for x, cos, sin in inputs[:2]:
        for a, b in zip(_layer(x, wts, cos, sin, pdl=True), _layer(x, wts, cos, sin, pdl=False), strict=True):
            assert torch.equal(a, b)
    sx, scos, ssin = (t.clone() for t in inputs[0])
    graph, outs = _captured(lambda: _layer(sx, wts, scos, ssin, pdl=True))
    for x, cos, sin in inputs[1:]:  # new inputs each replay: an early read would see the last replay's values
        sx.copy_(x), scos.copy_(cos), ssin.copy_(sin)
        graph.replay()
        for a, b in zip(outs, _layer(x, wts, cos, sin, pdl=False), strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "nvfp4", "triaxial"])
@pytest.mark.parametrize("batch", [1, 2])  # LATE, EARLY (triton_pdl.mode)
def test_gpu_write_and_decode_with_pdl_equal_plain_in_a_replayed_graph(fmt: str, batch: int) -> None:
    """A decode step's attention: the token's K/V written, the decode (Gluon, or tl for bf16), its split merge:
    all three with PDL."""
    from test_paged_ref import fill_sequences, make_pool

    from kvserving.kernels import paged_ops

    _pdl_gpu()
    p = 32 if fmt == "triaxial" else 16
    plain, over = KernelOptions(backend="triton"), KernelOptions(backend="triton", pdl=True)
    page_fmt = "int4" if fmt == "triaxial" else fmt
    pools = [make_pool(page_fmt, num_pages=400, page_size=p, kv_heads=8, head_dim=128, device="cuda",
                       num_int2_pages=40 if fmt == "triaxial" else 0) for _ in range(2)]  # fmt: skip
    lens = [3000, 777][:batch]
    filled = fill_sequences(pools[0], lens, int2_pages=[20, 5][:batch] if fmt == "triaxial" else None)
    pools[1].buffer.copy_(pools[0].buffer)
    n2 = filled.num_int2 if fmt == "triaxial" else None
    # the next token of each sequence goes to the slot after its last (its page has room: lens are not page multiples)
    pages = filled.page_table.cpu()[torch.arange(batch), torch.tensor(lens) // p].int().cuda()
    slots = (torch.tensor(lens) % p).int().cuda()
    seq = (torch.tensor(lens) + 1).int().cuda()
    g = torch.Generator(device="cuda").manual_seed(9)
    steps = [tuple(torch.randn(batch, n, 128, generator=g, device="cuda").bfloat16() for n in (8, 8, 32)) for _ in range(3)]

    def step(i: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, opts: KernelOptions) -> torch.Tensor:
        kv = pools[i].kv(1.0, 1.0)
        paged_ops.write_kv(kv, k, v, pages, slots, options=opts)
        return paged_ops.decode_attention(q, kv, filled.page_table.cuda(), seq, sm_scale=0.088, num_int2_pages=n2, options=opts)

    sk, sv, sq = (t.clone() for t in steps[0])
    graph, out = _captured(lambda: step(1, sk, sv, sq, over))
    for k, v, q in steps:
        sk.copy_(k), sv.copy_(v), sq.copy_(q)
        graph.replay()
        ref = step(0, k, v, q, plain)
        assert torch.equal(out, ref)
        assert torch.equal(pools[1].buffer, pools[0].buffer)


def _assert_replays_equal_plain(run: Callable[[torch.Tensor, bool], torch.Tensor], a: torch.Tensor, xs: list[torch.Tensor]) -> None:
    """``run(x @ a, True)`` (with PDL) captured in a CUDA graph after the GEMM that makes its input, then replayed
    with each x of ``xs``: equal bit for bit to ``run(x @ a, False)`` each time (an early read would see the last
    replay's input)."""
    sx = xs[0].clone()
    graph, out = _captured(lambda: run(sx @ a, True))
    for x in xs:
        sx.copy_(x)
        graph.replay()
        assert torch.equal(out, run(x @ a, False))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_fp8_gemv_with_pdl_equals_plain_after_a_gemm_in_a_replayed_graph(m: int) -> None:
    """The GEMV loads its first weights before the wait and x after it: in a graph replayed with new x (made by
    the GEMM before it) it equals the plain launch."""
    from kvserving.kernels import fp8_gemm, triton_fp8_gemm

    _pdl_gpu()
    g = torch.Generator(device="cuda").manual_seed(m)
    codes, scale = fp8_gemm.quantize_blocks(torch.randn(4096, 4096, generator=g, device="cuda"))
    a = (torch.randn(4096, 4096, generator=g, device="cuda") * 0.02).bfloat16()
    xs = [torch.randn(m, 4096, generator=g, device="cuda").bfloat16() for _ in range(3)]
    _assert_replays_equal_plain(lambda x, pdl: triton_fp8_gemm.gemv(x, codes, scale, pdl=pdl), a, xs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [8, 64])
def test_gpu_fp8_quantizer_and_block_gemm_with_pdl_equal_plain_after_a_gemm_in_a_replayed_graph(m: int) -> None:
    """The activation quantizer, the block GEMM and the partials' sum (o's shape: K split) wait before any access:
    in a graph replayed with new x (made by the GEMM before them) ``linear``'s quantized path with PDL equals the
    plain launch."""
    from kvserving.kernels import fp8_gemm, gemm_plan, triton_fp8_gemm

    _pdl_gpu()
    g = torch.Generator(device="cuda").manual_seed(m)
    codes, scale = fp8_gemm.quantize_blocks(torch.randn(4096, 4096, generator=g, device="cuda"))
    a = (torch.randn(4096, 4096, generator=g, device="cuda") * 0.02).bfloat16()
    xs = [torch.randn(m, 4096, generator=g, device="cuda").bfloat16() for _ in range(3)]
    assert gemm_plan.tile_config(m, 4096, 4096).split_k > 1

    def quantized(x: torch.Tensor, pdl: bool) -> torch.Tensor:
        qa, sa = triton_fp8_gemm.quantize(x, group=gemm_plan.GROUP, pdl=pdl)
        return triton_fp8_gemm.block_gemm(qa, sa, codes, scale, pdl=pdl)

    _assert_replays_equal_plain(quantized, a, xs)

"""Compile every kernel the engine can dispatch for one GPU target, without a GPU: ``python compile_offline.py 100``.

The wrappers run as the engine calls them (paged_ops' write, decode, gather
and extend, the model's norms) on CPU tensors of the real shapes (8 kv heads,
4 query heads each, head_dim 128), under a Triton driver that reports the
target's capability and launches nothing: each launch's specialization
(signature, constexprs, warps, register cap) is compiled by Triton for
sm_<target> as the JIT would compile it on that GPU. The Gluon decode, which
needs a CUDA tensor to pass ``supported``, is compiled from its
``compile_report_args`` (its launch's constexprs). Run without
TRITON_INTERPRET (kernels must be JIT functions).

Prints one JSON line: {kernel label: {"ok": bool, "shared": bytes, "error": str}}.
A kernel Triton cannot compile for the target is reported, not raised, unless
it kills the process (LLVM aborts on an instruction the target lacks, so the
Hopper-only Gluon extend kernels are compiled by the test in a process each).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton.compiler
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_paged_ref's pool helpers, offline_driver

from offline_driver import NotLaunched, OfflineDriver  # noqa: E402

SM = int(sys.argv[1])
RESULTS: dict[str, dict[str, Any]] = {}
_compile = triton.compiler.compile
_label = ["?"]


def _compile_offline(src: Any, target: Any = None, options: Any = None, **kw: Any) -> NotLaunched:
    name = f"{_label[0]}:{src.fn.__name__}"
    name += f"#{sum(k.startswith(name) for k in RESULTS) + 1}" if name in RESULTS else ""
    try:
        kernel = _compile(src, target=target, options=options, **kw)
        RESULTS[name] = {"ok": True, "shared": int(kernel.metadata.shared)}
    except Exception as exc:  # noqa: BLE001 -- reported per kernel
        RESULTS[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[-400:]}"}
    return NotLaunched()


def _source(kernel: Any, sig: dict[str, str], const: dict[str, Any]) -> Any:
    """The JIT's source of a launch given by signature and constexprs (pointers 16-byte aligned, as the JIT sees
    the engine's tensors; the integers compile_report_args names too)."""
    from triton.compiler import ASTSource

    from kvserving.kernels.triton_prefill import REPORT_ALIGNED

    sig = dict(sig) | {name: "constexpr" for name in const}
    names = list(kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*") or n in REPORT_ALIGNED}
    return ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)


def _engine_kernels() -> None:
    from test_paged_ref import fill_sequences, make_pool

    from kvserving.kernels import paged_ops, triton_decode, triton_norm, triton_prefill
    from kvserving.kernels.options import KernelOptions

    opts = KernelOptions(backend="triton", triton_fast=True)
    h, g, d = 8, 4, 128
    for case in ("bf16", "fp8_e4m3", "nvfp4", "triaxial"):
        _label[0] = case
        p = 32 if case == "triaxial" else 16
        fmt = "int4" if case == "triaxial" else case
        pool = make_pool(fmt, num_pages=6, page_size=p, kv_heads=h, head_dim=d, num_int2_pages=2 if case == "triaxial" else 0)
        filled = fill_sequences(pool, [p + 3, 2 * p + 5], int2_pages=[1, 1] if case == "triaxial" else None)
        kv = pool.kv(1.0, 1.0)
        t = torch.randn(3, h, d, dtype=torch.bfloat16)
        ids = filled.page_table[1, 1:2].repeat(3)  # a plain (INT4) page of the longer sequence
        paged_ops.write_kv(kv, t, t, ids, torch.arange(3, dtype=torch.int32), options=opts)
        if case == "triaxial":
            whole = torch.randn(1, p, h, d, dtype=torch.bfloat16)
            paged_ops.write_int2_pages(kv, whole, whole, filled.page_table[0, :1], options=opts)
        q = torch.randn(2, h * g, d, dtype=torch.bfloat16)
        args = (q, kv, filled.page_table, filled.seq_lens)
        paged_ops.decode_attention(*args, sm_scale=0.1, num_int2_pages=filled.num_int2, options=opts)
        if case == "nvfp4":
            _label[0] = "nvfp4-cvt"
            triton_decode.decode_attention(*args, sm_scale=0.1, num_int2_pages=filled.num_int2, fast=True, e2m1_cvt=True)
            _label[0] = case
        n = 5
        k, v = torch.randn(n, h, d, dtype=torch.bfloat16), torch.randn(n, h, d, dtype=torch.bfloat16)
        qe = torch.randn(n, h * g, d, dtype=torch.bfloat16)
        if case == "bf16":  # on CPU tensors the wrapper picks fp32 tiles (the interpreter's); the GPU's are bf16
            kernel, sig, const, warps = triton_prefill.compile_report_args("bf16")
            _compile_offline(_source(kernel, sig, const), target=GPUTarget("cuda", SM, 32), options={"num_warps": warps})
        else:
            paged_ops.extend_attention(qe, k, v, kv, filled.page_table[1], 2 * p, sm_scale=0.1, options=opts)
        out_k = torch.empty(2 * p + 5, h, d, dtype=torch.bfloat16)
        paged_ops.gather_kv(kv, filled.page_table[1], 2 * p + 5, out_k, torch.empty_like(out_k), options=opts)
    _label[0] = "model"
    x = torch.randn(4, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    triton_norm.rms_norm(x, w, 1e-6)
    triton_norm.add_rms_norm(x, x.clone(), w, 1e-6)
    triton_norm.silu_mul(torch.randn(4, 2 * 1024, dtype=torch.bfloat16))
    qkv = torch.randn(4, (32 + 2 * 8) * 128, dtype=torch.bfloat16)
    cos, sin = torch.ones(4, 128), torch.zeros(4, 128)
    wd = torch.ones(128, dtype=torch.bfloat16)
    triton_norm.qk_norm_rope(qkv, cos, sin, num_heads=32, num_kv_heads=8, head_dim=128, q_weight=wd, k_weight=wd)
    # FP8 weights: the block-scaled GEMM (its tile shape follows M), and the GEMV at M 1 and 2 (x unquantized; the
    # dispatch's two GEMV sizes, where the block GEMM would split K) as linear_cuda dispatches it
    from kvserving.kernels import fp8_gemm, triton_fp8_gemm

    _label[0] = "fp8"
    blocks_q, blocks = fp8_gemm.quantize_blocks(torch.randn(1024, 4096))
    for m in (16, 64, 256):
        qa, sa = fp8_gemm.quantize_groups(torch.randn(m, 4096))
        triton_fp8_gemm.block_gemm(qa, sa, blocks_q, blocks)
    for m in (16, 256):  # the activation quantizer: one group a program, and 16
        triton_fp8_gemm.quantize(torch.randn(m, 4096, dtype=torch.bfloat16), group=128)
    for m in (1, 2):
        triton_fp8_gemm.linear(torch.randn(m, 4096, dtype=torch.bfloat16), blocks_q, blocks)
    # bf16 weights: the same GEMV unscaled at M 1 and 2 (model.product, the default)
    _label[0] = "bf16w"
    for m in (1, 2):
        triton_fp8_gemm.gemv(torch.randn(m, 4096, dtype=torch.bfloat16), torch.randn(4096, 4096, dtype=torch.bfloat16), None)
    # and the down projection's, SwiGLU formed inside (model.gated_product)
    triton_fp8_gemm.gemv(torch.randn(1, 2 * 4096, dtype=torch.bfloat16), torch.randn(4096, 4096, dtype=torch.bfloat16), None, gated=True)


def _gluon_decode() -> None:
    from kvserving.kernels import gluon_decode
    from kvserving.kernels.capability import choose
    from kvserving.kernels.compile_report import report

    cvt = choose((SM // 10, SM % 10)).e2m1 == "cvt"  # nvfp4 unpacked as that GPU's launch unpacks it

    # every format as launched with its split merge launch, nvfp4 / triaxial with programmatic dependent launch
    # ("-pdl"), and the engine's launch at few splits: with PDL, the splits merged in the kernel ("-pdl-fuse")
    cases = [(f, 0, 0) for f in ("nvfp4", "int4", "triaxial", "fp8_e4m3")] + [("nvfp4", 1, 0), ("triaxial", 1, 0)]
    for fmt, pdl, fuse in cases + [(f, 1, 1) for f in ("nvfp4", "triaxial", "fp8_e4m3")]:
        name = f"gluon-{fmt}{'-pdl' if pdl else ''}{'-fuse' if fuse else ''}:_gl_decode_kernel"
        cfg = gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt]
        sig, const = gluon_decode.compile_report_args(fmt, heads=4, e2m1_cvt=cvt, fuse=bool(fuse))
        const["LEAN"], const["PDL"] = cfg.get("LEAN", 0), pdl
        warps = const.pop("num_warps")
        try:
            r = report(gluon_decode._gl_decode_kernel, sig, const, gluon=True, num_warps=warps, aligned=("total_bytes",),
                       maxnreg=gluon_decode.register_cap(fmt, cfg, heads=4), sm=SM)  # fmt: skip
            RESULTS[name] = {"ok": True, "shared": r["shared"], "local": r["local"], "stack": r["stack"],
                             "e2m1_cvt": const["E2M1_CVT"], "regs": r["regs"],
                             "e2m1_sass": sum(n for op, n in r["ops"].items() if "E2M1" in op),
                             "griddep_wait": r["ops"].get("ACQBULK", 0),
                             "atomics": sum(n for op, n in r["ops"].items() if op.startswith(("ATOM", "RED")))}  # fmt: skip
        except Exception as exc:  # noqa: BLE001 -- reported per kernel
            RESULTS[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[-400:]}"}


if __name__ == "__main__":
    driver.set_active(OfflineDriver(SM))  # type: ignore[arg-type]
    triton.compiler.compile = _compile_offline
    _engine_kernels()
    _gluon_decode()
    print(json.dumps(RESULTS))

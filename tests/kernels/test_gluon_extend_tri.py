"""The triaxial producer of the Gluon extend (gluon_extend_tri.py): compiled for sm_90 here, held to fp64 attention on the GPU.

CPU (CI): the kernel is compiled for an H100 with the pinned Triton (it runs on
Hopper only): the consumers are WS 2's (two warpgroups, one wait per wgmma
group), the producer hands registers back and writes the tiles 16 bytes at a
time, and it spills no more than the nvfp4 kernel. Its PTX unpackers run in
test_gluon_unpackers.py.

GPU (``gpu`` marker, device machine): extend at real shapes (pages of 32,
partial last pages and steps, INT2 and INT4 pages listed in orders that make
steps of one kind and steps that mix them, with and without the wrapper's
INT2-first sort) against fp64 attention over the codec-dequantized prefix plus
the chunk, and against the ``tl`` kernel; paged_ops dispatches triaxial extend
here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from test_paged_ref import expected_kv, fill_sequences, make_pool, rel_err
from test_triton_paged import BOUND
from test_triton_prefill import dense_extend

from kvserving.kernels import gluon_extend_tri, paged_ops, triton_prefill, triton_write
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.page_ids import INT2_PAGE_FLAG

_COMPILE = """
import json, sys
from kvserving.kernels import gluon_extend, gluon_extend_tri
from kvserving.kernels.compile_report import report
out = {}
for name, mod in (("tri", gluon_extend_tri), ("nvfp4", gluon_extend)):
    kernel, sig, const = mod.compile_report_args()
    warps = const.pop("num_warps")
    maxnreg = const.pop("maxnreg", None)
    r = report(kernel, sig, const, gluon=True, num_warps=warps, maxnreg=maxnreg,
               aligned=("total_bytes", "q_s0", "k_s0", "o_s0", "o_s1"))
    out[name] = {"stack": r["stack"], "local": r["local"], "shared": r["shared"], "regs": r["regs"], "ops": dict(r["ops"]),
                 "producer": dict(producer_loop(r["sass"]))}
print(json.dumps(out))
"""

# the producer's loop: the shortest loop (backward branch to its target) that loads the packed rows 16 bytes at a time
# and stores the tiles
_LOOP = """
import collections, re
def producer_loop(sass):
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\\s*/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best = None
    for addr, op, rest in lines:
        t = re.match(r"\\s*(?:`\\()?[^0-9]*0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            ops = collections.Counter(o for a, o, _ in lines if int(t.group(1), 16) <= a <= addr)
            if ops["STS.128"] and ops["LDG.E.128"] and (best is None or sum(ops.values()) < sum(best.values())):
                best = ops
    return best or collections.Counter()
"""


def test_triaxial_extend_compiles_for_sm90_with_the_ws2_consumers_and_no_producer_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _LOOP + _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    r: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    tri, nv = r["tri"], r["nvfp4"]
    ops = tri["ops"]
    assert ops.get("USETMAXREG.DEALLOC.CTAPOOL", 0) >= 1 and ops.get("USETMAXREG.TRY_ALLOC.CTAPOOL", 0) >= 1, ops
    # the consumers are WS 2's: 8 S + 8 PV m64n128k16 per warpgroup, each group waited once
    assert ops["HGMMA.64"] == 2 * 16 and ops["WARPGROUP.DEPBAR.LE"] == 2 * 2, ops
    # tiles written 16 bytes at a time (the per-kind branches may share their stores)
    assert ops.get("STS.128", 0) >= 2 * 16 and not any(op.startswith("STS.") and op not in ("STS.128", "STS.64") for op in ops)
    assert tri["regs"] == gluon_extend_tri.TUNING["maxnreg"] and tri["shared"] <= 227 * 1024
    # the producer fits its 152 registers: its loop keeps at most 4 values in local memory a step (triton 3.6, the
    # device's: 1; the pinned 3.9: 4). The consumers at 176 spill nothing with 3.6; 3.9 reloads ~25 values a step
    # there (stack 160 B, nvfp4's 88): docs/performance-log/kernels.md session 14
    prod = tri["producer"]
    assert tri["local"] == 0 and prod["STS.128"] == 32 and prod.get("STL", 0) <= 4, prod
    assert tri["stack"] <= 2 * nv["stack"] and nv["local"] == 0, (tri["stack"], nv["stack"])


def test_triaxial_extend_refuses_a_producer_that_is_not_a_warp_per_page() -> None:
    with pytest.raises(ValueError, match="LOAD_WARPS"):
        gluon_extend_tri.compile_report_args(tuning={"LOAD_WARPS": 8})


@pytest.mark.parametrize(("n", "block"), [(1, 4096), (7, 4096), (100, 16), (1000, 64), (4096, 4096), (3, 16), (0, 16)])
def test_int2_first_lists_int2_pages_first_in_listed_order(n: int, block: int) -> None:
    # the wrapper's SORT 2 (the default) in one launch: a stable partition, as torch's stable argsort gives it; blocks
    # smaller than the list carry the counts from block to block (under the interpreter here)
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 1 << 20, (n,), dtype=torch.int32, generator=gen)
    ids = torch.where(torch.rand(n, generator=gen) < 0.6, ids | INT2_PAGE_FLAG, ids)
    want = ids[torch.argsort(((ids & INT2_PAGE_FLAG) == 0).to(torch.int8), stable=True)]
    assert torch.equal(gluon_extend_tri.int2_first(ids, block=block), want)
    assert gluon_extend_tri.TUNING["SORT"] == 2


def _order(used: int, n2: int, how: str) -> torch.Tensor:
    """A listing of a prefix's pages (table order: INT2 pages 0 .. n2-1, then INT4), the last page (possibly partial,
    always INT4) kept last: "table", "interleaved" (INT2 and INT4 alternate: mixed steps), "int4_first"."""
    two, four = list(range(min(n2, used - 1))), list(range(min(n2, used - 1), used - 1))
    if how == "interleaved":
        mixed: list[int] = []
        for j in range(max(len(two), len(four))):
            mixed += two[j : j + 1] + four[j : j + 1]
        head = mixed
    elif how == "int4_first":
        head = four + two
    else:
        head = two + four
    return torch.tensor(head + list(range(len(two) + len(four), used)), dtype=torch.long)


# listings of the prefix pages and tunings: sorted by the wrapper (at most one mixed step), and as listed (SORT 0:
# most steps of "interleaved" mix INT2 and INT4 pages)
CASES = [("table", {}), ("interleaved", {}), ("int4_first", {}), ("interleaved", {"SORT": 0}), ("int4_first", {"SORT": 0})]


def _check(prefix_lens: list[int], n2s: list[int], n_new: int, base: dict[str, int]) -> None:
    d, h, g, p = 128, 8, 4, 32
    n4_pages = sum(-(-(n - n2 * p) // p) for n, n2 in zip(prefix_lens, n2s, strict=True))
    pool = make_pool("int4", num_pages=n4_pages + 2, page_size=p, kv_heads=h, head_dim=d, num_int2_pages=sum(n2s) + 1,
                     device="cuda")  # fmt: skip
    filled = fill_sequences(pool, prefix_lens, int2_pages=n2s, ops=triton_write)
    kv = pool.kv()
    sm = d**-0.5
    for i, start in enumerate(prefix_lens):
        used = -(-start // p)
        table = filled.page_table[i]
        ek, ev = expected_kv(pool, filled, i)  # in table order (attention does not depend on the listing)
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(n_new, h * g, d, device="cuda").to(dtype)
            k_new = (torch.randn(n_new, h, d, device="cuda") * 2).to(dtype)
            v_new = torch.randn(n_new, h, d, device="cuda").to(dtype)
            assert gluon_extend_tri.supported(kv, q)
            want = dense_extend(q.cpu(), torch.cat([ek, k_new.cpu()]), torch.cat([ev, v_new.cpu()]), start, sm)
            tl_out = triton_prefill.extend_attention(q, k_new, v_new, kv, table, start, sm_scale=sm, fast=True).cpu()
            slack = 4e-3 if dtype == torch.bfloat16 else 0.0
            for how, case in CASES:
                tuning = {**base, **case}
                perm = _order(used, n2s[i], how).to(table.device)
                pages = torch.cat([table[:used][perm], table[used:]]) if used else table
                out = torch.full_like(q, float("nan"))
                out.copy_(gluon_extend_tri.extend_attention(q, k_new, v_new, kv, pages, start, sm_scale=sm, tuning=tuning))
                assert out.dtype == q.dtype and out.shape == q.shape and out.isfinite().all(), (start, how, tuning)
                err = rel_err(out.cpu(), want)
                assert err < BOUND["triaxial"] + slack, (start, n2s[i], how, tuning, dtype, err)
                assert rel_err(out.cpu(), tl_out.double()) < 5e-3 + slack, (start, how, tuning, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("base", [{}, {"CKV": 0, "KPF": 0}, {"LAZY": 1}, {"TREE": 1}])
def test_gpu_triaxial_extend_real_shapes_sorted_and_mixed_steps(base: dict[str, int]) -> None:
    # prefixes: 41 pages (the last of 7 tokens) with 25 INT2; 94 pages (the last of 24) with 60 INT2; 4 full INT2
    # pages (one step); 9 INT2 pages (the last step one page of four); one token; none. 300 new tokens: partial
    # blocks and chunk steps; then one token after one INT2 and one INT4 page.
    _check([32 * 40 + 7, 3000, 128, 288, 1, 0], [25, 60, 4, 9, 0, 0], 300, base)
    _check([33], [1], 1, base)


@pytest.mark.gpu
def test_gpu_triaxial_extend_supported_calls() -> None:
    pool = make_pool("int4", num_pages=4, page_size=32, kv_heads=8, head_dim=128, num_int2_pages=2, device="cuda")
    q = torch.randn(3, 32, 128, device="cuda")
    assert gluon_extend_tri.supported(pool.kv(), q)
    assert not gluon_extend_tri.supported(pool.kv(), q[:, :16])  # 2 query heads per kv head
    plain = make_pool("int4", num_pages=4, page_size=32, kv_heads=8, head_dim=128, device="cuda")
    assert not gluon_extend_tri.supported(plain.kv(), q)  # INT4 pages alone are not a triaxial KV
    with pytest.raises(ValueError, match="does not support"):
        gluon_extend_tri.extend_attention(q[:, :16], q[:, :8], q[:, :8], pool.kv(), torch.zeros(2, dtype=torch.int32,
                                          device="cuda"), 20, sm_scale=0.1)  # fmt: skip


@pytest.mark.gpu
def test_gpu_paged_ops_extend_runs_the_gluon_kernel_on_triaxial_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool("int4", num_pages=4, page_size=32, kv_heads=8, head_dim=128, num_int2_pages=2, device="cuda")
    filled = fill_sequences(pool, [80], int2_pages=[1], ops=triton_write)  # one INT2 page, two INT4 (the last of 16)
    kv = pool.kv()
    q, k, v = torch.randn(5, 32, 128, device="cuda"), torch.randn(5, 8, 128, device="cuda"), torch.randn(5, 8, 128, device="cuda")
    calls: list[int] = []
    launch = gluon_extend_tri.extend_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(gluon_extend_tri, "extend_attention", counted)
    table = filled.page_table[0]
    out = paged_ops.extend_attention(q, k, v, kv, table, 80, sm_scale=0.1, options=KernelOptions())
    assert calls == [1]
    ref = triton_prefill.extend_attention(q, k, v, kv, table, 80, sm_scale=0.1, fast=True)
    assert calls == [1] and rel_err(out, ref) < 5e-3
    paged_ops.extend_attention(q, k, v, kv, table, 80, sm_scale=0.1, options=KernelOptions(triton_fast=False))
    assert calls == [1]  # the portable decoders keep the tl kernel

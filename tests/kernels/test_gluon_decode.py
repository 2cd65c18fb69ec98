"""The Gluon decode kernels (gluon_decode.py): compiled for sm_90 here, held to the reference on the GPU.

CPU (CI): the kernels cannot run without a GPU (PTX unpackers, mma.sync), so
CI compiles the kernel of each page format as launched for an H100 with the
pinned Triton and checks what makes it fast and what makes it right to
compile: every layout change ``assert_trivial`` demands is free, no register
spills, no unpacked values stored to shared memory inside the main loop (the
fragments come straight from registers), the expected tensor-core
instruction count per step and 16-byte K copies into the ring.

GPU (``gpu`` marker, device machine): decode at real shapes against fp64
attention over the codec-dequantized K/V, with the same bounds as the ``tl``
kernels (fp16 operands and softmax weights: 3e-3 relative).
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import subprocess
import sys
import weakref
from typing import Any

import pytest
import torch
from test_triton_paged import _check_decode

from kvserving.kernels import gluon_decode, gluon_merge, paged_ops
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.triton_common import resident_programs


# compiled in a child process: the test session runs with TRITON_INTERPRET=1, under which Triton's own
# jit helpers (the reductions' combine functions) cannot be compiled; the kernel as launched (GL_TUNING: warps,
# pages per warp, ring depth, register cap) with 4 or 16 query heads per kv head
_COMPILE = r"""
import json, re, sys
from kvserving.kernels import gluon_decode
from kvserving.kernels.compile_report import loops, report
fmt, heads, fuse, merge_sc = sys.argv[1], int(sys.argv[2]), {"tuning": None, "on": True}[sys.argv[3]], int(sys.argv[4])

def ordering(sass):
    # the memory-ordering instructions in program order, runs collapsed: fences, atomics, L1 invalidations and
    # the loads that bypass L1 (LDG...STRONG.GPU)
    seen = []
    for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass):
        tag = "LDG.STRONG.GPU" if op.startswith("LDG") and op.endswith("STRONG.GPU") else op
        if tag.startswith(("MEMBAR", "ATOM", "RED", "CCTL", "FENCE", "LDG.STRONG")) and (not seen or seen[-1] != tag):
            seen.append(tag)
    return seen
def merge_loop(sass):
    # the opcodes, in program order, of the innermost loop whose loads bypass L1: the wide merge's steps
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*)", sass)
    for addr, op, rest in lines:
        t = re.match(r"\s*0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < int(addr, 16):
            body = [o for a, o, _ in lines if int(t.group(1), 16) <= int(a, 16) <= int(addr, 16)]
            if any(o.startswith("LDG") and o.endswith("STRONG.GPU") for o in body):
                return body
    return []
cfg = gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt]
sig, const = gluon_decode.compile_report_args(fmt, heads=heads, fuse=fuse, merge_sc=merge_sc)
warps = const.pop("num_warps")
r = report(gluon_decode._gl_decode_kernel, sig, const, gluon=True, num_warps=warps, aligned=("total_bytes",),
           maxnreg=gluon_decode.register_cap(fmt, cfg, heads=heads))
print(json.dumps({"warps": warps, "local": r["local"], "stack": r["stack"], "shared": r["shared"], "regs": r["regs"],
                  "loops": [dict(c) for c in loops(r["sass"]) if any(op.startswith("HMMA") for op in c)],
                  "atomics": sum(n for op, n in r["ops"].items() if op.startswith(("ATOM", "RED"))),
                  "ordering": ordering(r["sass"]), "merge_loop": merge_loop(r["sass"])}))
"""


def _compile(fmt: str, heads: int = 4, *, fuse: bool = False, merge_sc: int = 0) -> dict[str, Any]:
    """The compile report of one launch configuration (a copy: several tests read the same kernel's, compiled once)."""
    return copy.deepcopy(_compiled(fmt, heads, fuse, merge_sc))


@functools.cache
def _compiled(fmt: str, heads: int, fuse: bool, merge_sc: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [fmt, str(heads), "on" if fuse else "tuning", str(merge_sc)]
    done = subprocess.run([sys.executable, "-c", _COMPILE, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("fmt", ["nvfp4", "int4", "triaxial", "fp8_e4m3"])
def test_gluon_decode_compiles_for_sm90_without_unpacked_values_in_shared_memory(fmt: str) -> None:
    r = _compile(fmt)
    warps = r["warps"]
    assert r["local"] == 0 and r["stack"] == 0, "register spills"
    # one loop over the split's steps per kind of page: triaxial rows run an INT2 loop and an INT4 one
    kinds = ["int2", "int4"] if fmt == "triaxial" else [fmt]
    assert len(r["loops"]) == len(kinds), r["loops"]
    for kind in kinds:
        # per warp and step: S^T = K q^T (NT/16 row tiles x D/16 k steps) and O^T += V^T P^T (D/16 x NT/16)
        # (INT2 keys: plus one k=32 mma per page for the zero term, see _gl_split; the softmax sum l = ones . P^T:
        # one k=32 mma)
        nt = 32
        want = 2 * (nt // 16) * (128 // 16) + (2 if kind == "int2" else 0) + 2
        ops = next((c for c in r["loops"] if c["HMMA.16816.F32"] == want), None)
        assert ops is not None, (kind, [c["HMMA.16816.F32"] for c in r["loops"]])
        # the fragments come straight from registers: nothing is stored to shared memory in the loop
        assert not any(op.startswith("STS") for op in ops), ops
        # the ring: K rows copied global -> shared by cp.async (16 / 8 bytes a thread and token) and read back
        # with vectors as wide; one barrier after the wait, one before a slot is refilled (in each of the two
        # branches of the copies, unmasked for a full step and masked for a split's last: 3 in the code, 2 run)
        wide = "128" if kind != "int2" else "64"
        cp = "LDGSTS.E.BYPASS.128" if kind != "int2" else "LDGSTS.E.64"
        assert ops[cp] >= 4 and ops["LDS." + wide] >= 4, ops
        assert sum(v for op, v in ops.items() if op.startswith("BAR")) <= 3, ops
    # the epilogue merges the warps through shared memory ([W, D, HP] fp32 at most), the ring is 2 steps
    assert r["shared"] <= max(warps * 128 * 8 * 4, 2 * warps * 5 * 1024 * 2)


def test_gluon_decode_triaxial_fits_128_registers_so_4_programs_share_an_sm() -> None:
    # LEAN cuts the step's live state (woven K pieces, V read after the softmax, lane-relative masks), so the cap of
    # 128 registers spills nothing and RES 4 holds; the tensor-core work per step is what it was without LEAN
    tuning = gluon_decode.GL_TUNING["int4"]
    assert tuning["LEAN"] == 1 and tuning["maxnreg"] == 128
    r = _compile("triaxial")
    assert r["regs"] <= 128 and r["local"] == 0 and r["stack"] == 0, r
    assert resident_programs(regs=r["regs"], warps=r["warps"], shared=r["shared"]) == tuning["RES"] == 4
    assert sorted(c["HMMA.16816.F32"] for c in r["loops"]) == [34, 36], r["loops"]


@pytest.mark.parametrize("fmt", ["nvfp4", "triaxial", "fp8_e4m3"])
def test_gluon_decode_with_the_fused_merge_compiles_without_spills_and_keeps_its_programs_an_sm(fmt: str) -> None:
    # FUSE 1 (the last split merges, gpu test below) adds one arrival atomic and the merge after the loop: no
    # spill under the tuning's cap, the same shared memory, so the planner's RES holds with it on
    plain, fused = _compile(fmt), _compile(fmt, fuse=True)
    assert fused["local"] == 0 and fused["stack"] == 0, fused
    assert fused["shared"] == plain["shared"]
    assert plain["atomics"] == 0 and fused["atomics"] >= 1, (plain["atomics"], fused["atomics"])
    # the grid-sync pattern: a gpu-scope release fence before the arrival atomic, L1 invalidated after it (acquire),
    # then the merge's loads of the other programs' partials past L1; the plain kernel has none of them
    assert plain["ordering"] == [], plain["ordering"]
    assert fused["ordering"] == ["MEMBAR.ALL.GPU", "ATOMG.E.ADD.STRONG.GPU", "CCTL.IVALL", "LDG.STRONG.GPU"], fused["ordering"]
    cfg = gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt]
    assert resident_programs(regs=fused["regs"], warps=fused["warps"], shared=fused["shared"]) == cfg["RES"], fused


# every format at 4 query heads a kv head (Qwen3-8B's), and 16 heads once: there SC drops to 2 (triaxial's 4 warps;
# 1 for the 2-warp formats, the two-pass merge's loop shape)
@pytest.mark.parametrize(("fmt", "heads"), [("nvfp4", 4), ("triaxial", 4), ("fp8_e4m3", 4), ("triaxial", 16)])
def test_the_wide_merge_compiles_without_spills_and_issues_a_steps_loads_before_its_sums(fmt: str, heads: int) -> None:
    # MERGE_SC 8 (gluon_merge.merge_wide): no spill under the tuning's cap, the plain kernel's shared memory and at least its
    # programs per SM (the tuning's RES at 4 heads), the arrival pattern of the fused merge; one loop over the steps
    # whose SC splits' 16-byte loads all issue before the step's first multiply, so their L2 latencies overlap
    plain, wide = _compile(fmt, heads), _compile(fmt, heads, fuse=True, merge_sc=8)
    assert wide["local"] == 0 and wide["stack"] == 0, wide
    assert wide["shared"] == plain["shared"]
    assert wide["ordering"] == ["MEMBAR.ALL.GPU", "ATOMG.E.ADD.STRONG.GPU", "CCTL.IVALL", "LDG.STRONG.GPU"], wide["ordering"]
    cfg = gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt]
    res = resident_programs(regs=wide["regs"], warps=wide["warps"], shared=wide["shared"])
    assert res >= resident_programs(regs=plain["regs"], warps=plain["warps"], shared=plain["shared"]), (wide, plain)
    if heads <= 8:
        assert res == cfg["RES"], wide
    # a step: [GP, SC, 128] fp32 over the program's threads, 4 channels a load; GP = the heads padded to a power of
    # two, SC = MERGE_SC capped so that a step's tile takes at most 64 registers a thread, 32 at 16 heads (_merge_step)
    threads = 32 * wide["warps"]
    sc = min(8, (64 if heads <= 8 else 32) * threads // (heads * 128))
    body = wide["merge_loop"]
    loads = [i for i, op in enumerate(body) if op == "LDG.E.128.STRONG.GPU"]
    sums = [i for i, op in enumerate(body) if op.startswith(("FFMA", "FMUL", "FADD"))]
    assert len(loads) == heads * sc * 128 // (threads * 4), body
    assert sums and loads[-1] < sums[0], body


def test_merge_step_is_the_tunings_merge_sc_up_to_64_splits() -> None:
    # 0 (no MERGE_SC: merge_pairs) unless asked for; past MERGE_MAX_SPLITS the two-pass merge, which has no limit
    assert gluon_merge.MERGE_MAX_SPLITS == 64
    assert gluon_merge.merge_step({}, splits=33) == 0
    assert gluon_merge.merge_step({"MERGE_SC": 8}, splits=64) == 8
    assert gluon_merge.merge_step({"MERGE_SC": 8}, splits=65) == 0
    for bad in (3, -2):
        with pytest.raises(ValueError, match="MERGE_SC"):
            gluon_merge.merge_step({"MERGE_SC": bad}, splits=4)
    assert all("MERGE_SC" not in cfg for cfg in gluon_decode.GL_TUNING.values())


def test_the_splits_merge_in_the_kernel_up_to_eight_splits_unless_the_option_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # KernelOptions.fused_merge (default; KVSERVING_FUSED_MERGE=0 turns it off) launches FUSE 1 through paged_ops
    # where the plan has at most FUSE_MAX_SPLITS splits; past that, or off, the merge launch (FUSE 0)
    from test_triton_paged import _filled_pool

    pool, filled, scale = _filled_pool("nvfp4", [40, 7], d=128, h=2, p=16)
    kv = pool.kv(scale, scale)
    q = torch.randn(2, 8, 128)
    seen: list[tuple[int, int]] = []

    def launch(q: torch.Tensor, *_: Any, cfg: dict[str, int], plan: tuple[int, int], **__: Any) -> tuple[torch.Tensor, None]:
        seen.append((plan[0], cfg["FUSE"]))
        return torch.zeros_like(q), None

    monkeypatch.setattr(gluon_decode, "launch_decode", launch)
    monkeypatch.setattr(paged_ops, "decode_kernel", lambda *_, **__: "gluon")
    assert gluon_decode.FUSE_MAX_SPLITS == 8
    off = KernelOptions.from_env({"KVSERVING_FUSED_MERGE": "0"})
    for splits in (1, 8, 9, 32):
        monkeypatch.setattr(gluon_decode, "split_plan", lambda *_, n=splits: (n, 2))
        for opts in (KernelOptions(), KernelOptions.from_env({}), off):
            paged_ops.decode_attention(q, kv, filled.page_table, filled.seq_lens, sm_scale=0.1, options=opts)
    assert seen == [(1, 1), (1, 1), (1, 0), (8, 1), (8, 1), (8, 0), (9, 0), (9, 0), (9, 0), (32, 0), (32, 0), (32, 0)]
    assert all("FUSE" not in cfg for cfg in gluon_decode.GL_TUNING.values())


def test_an_outgrown_arrival_counter_buffer_stays_allocated_for_the_graphs_captured_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # a CUDA graph captured with the fused merge keeps the counters' address: growing the buffer later must not
    # free the old one (its memory would be reused, the counts never reach S - 1 and the merge never runs)
    monkeypatch.setattr(gluon_merge, "_COUNTERS", {})
    dev = torch.device("cpu")
    first = gluon_merge.arrival_counters(dev, 8)
    assert first is not None and first.numel() == 4096 and gluon_merge.arrival_counters(dev, 4096) is first
    old = weakref.ref(first)
    del first
    grown = gluon_merge.arrival_counters(dev, 5000)
    assert grown is not None and grown.numel() == 5000 and int(grown.count_nonzero()) == 0
    assert gluon_merge.arrival_counters(dev, 8) is grown  # the newest serves every launch
    gc.collect()
    assert old() is not None


@pytest.mark.parametrize("fmt", ["nvfp4", "triaxial", "fp8_e4m3"])
def test_gluon_decode_residency_table_matches_the_compiled_kernel(fmt: str) -> None:
    # the split planner (plan_waves) plans on GL_TUNING's RES / RES16: the programs per SM the compiled kernel allows.
    # RES16 (16 heads, uncapped) is the device's Triton 3.6 (196 / 200 / 229 registers); the pinned 3.9 gives nvfp4
    # and fp8 209 / 204 (4 programs, not 5): only the gpu test below holds RES16
    r = _compile(fmt)
    cfg = gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt]
    assert r["local"] == 0
    assert cfg["RES"] == resident_programs(regs=r["regs"], warps=r["warps"], shared=r["shared"]), r


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nvfp4", "int4", "triaxial", "fp8_e4m3"])
def test_gpu_gluon_decode_real_shapes(case: str) -> None:
    p = 32 if case in ("int4", "triaxial") else 16
    lens = [1, p, p + 1, 1000, 2047, 4096, 333, 77]
    _check_decode(case, lens, device="cuda", d=128, h=8, g=4, p=p, kernel="gluon")
    _check_decode(case, [5, 700, 129], device="cuda", d=128, h=2, g=8, p=p, kernel="gluon")  # 8 per kv head
    _check_decode(case, [3, 400, 65], device="cuda", d=128, h=1, g=16, p=p, kernel="gluon")  # padded to 16


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nvfp4", "triaxial", "fp8_e4m3"])
def test_gpu_gluon_decode_many_splits_including_empty_ones(case: str) -> None:
    p = 32 if case == "triaxial" else 16
    step = 4 if case == "triaxial" else 2 * gluon_decode.GL_TUNING[case]["PPW"]  # warps x pages per warp
    _check_decode(case, [3, 40 * p, 17 * p + 5], device="cuda", d=128, h=8, g=4, p=p, splits=(40, step), kernel="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [4, 16])
@pytest.mark.parametrize("case", ["nvfp4", "triaxial", "fp8_e4m3"])
def test_gpu_gluon_decode_residency_table_matches_the_launched_kernel(case: str, heads: int) -> None:
    from test_triton_paged import _filled_pool

    p = 32 if case == "triaxial" else 16
    pool, filled, scale = _filled_pool(case, [300, 77], device="cuda", d=128, h=2, p=p)
    q = torch.randn(2, 2 * heads, 128, device="cuda", dtype=torch.bfloat16)
    kv = pool.kv(scale, scale)
    cfg = gluon_decode.GL_TUNING[kv.layout.fmt]
    _, kernel = gluon_decode.launch_decode(q, kv, filled.page_table, filled.seq_lens, sm_scale=0.1,
                                           num_int2_pages=filled.num_int2, cfg=cfg,
                                           plan=gluon_decode.split_plan(q, kv, filled.page_table, cfg))  # fmt: skip
    got = resident_programs(regs=kernel.n_regs, warps=cfg["num_warps"], shared=kernel.metadata.shared)
    assert got == cfg["RES" if heads <= 8 else "RES16"], (kernel.n_regs, kernel.metadata.shared)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nvfp4", "triaxial", "fp8_e4m3"])
def test_gpu_gluon_is_the_default_for_packed_and_fp8_pages_on_hopper(case: str) -> None:
    from test_triton_paged import _filled_pool

    p = 32 if case == "triaxial" else 16
    pool, filled, scale = _filled_pool(case, [300], device="cuda", d=128, h=8, p=p)
    q = torch.randn(1, 32, 128, device="cuda")
    assert paged_ops.decode_kernel(q, pool.kv(), options=KernelOptions()) == "gluon"
    assert paged_ops.decode_kernel(q, pool.kv(), options=KernelOptions(decode_kernel="tl")) == "tl"
    wide = torch.randn(1, 8 * 24, 128, device="cuda")  # 24 query heads per kv head: more than Gluon's 16
    assert paged_ops.decode_kernel(wide, pool.kv(), options=KernelOptions()) == "tl"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [4, 16])
@pytest.mark.parametrize("case", ["nvfp4", "triaxial", "fp8_e4m3"])
def test_gpu_the_fused_merge_equals_the_merge_launch_and_leaves_its_counters_zero(case: str, heads: int) -> None:
    """FUSE 1 (the last split of each (sequence, kv head) merges them) against FUSE 0 (triton_common's merge
    launch) on the same partials: equal within bf16 rounding of the same fp32 sums (the two add the splits in
    another order: 1 bf16 ulp, 2^-8 relative), at the planner's, 1, 2 and 40 splits (empty ones among them; a
    triaxial row's 2 are its INT2 and INT4 pages); every arrival counter is back at zero after each launch, also
    after a CUDA graph of two launches replayed three times. The wide merge (MERGE_SC 2 and 8) at 1, 2, the
    planner's, 33 and 64 splits against the same merge launch."""
    from test_triton_paged import _filled_pool

    p = 32 if case == "triaxial" else 16
    pool, filled, scale = _filled_pool(case, [3, 40 * p, 17 * p + 5, 700], device="cuda", d=128, h=2, p=p)
    q = torch.randn(4, 2 * heads, 128, device="cuda", dtype=torch.bfloat16)
    kv = pool.kv(scale, scale)
    cfg = gluon_decode.GL_TUNING[kv.layout.fmt]
    step = cfg["num_warps"] * cfg["PPW"]

    def run(fuse: int, plan: tuple[int, int], merge_sc: int = 0) -> torch.Tensor:
        tuning = {**cfg, "FUSE": fuse, "MERGE_SC": merge_sc}
        out, _ = gluon_decode.launch_decode(q, kv, filled.page_table, filled.seq_lens, sm_scale=0.1,
                                            num_int2_pages=filled.num_int2, cfg=tuning, plan=plan)  # fmt: skip
        return out

    counters = gluon_merge.arrival_counters(q.device, 8)
    assert counters is not None
    width = filled.page_table.shape[1]
    two = (2, 64 * step) if kv.triaxial else (2, -(-width // (2 * step)) * step)
    for plan in [gluon_decode.split_plan(q, kv, filled.page_table, cfg), (1, 64 * step), two, (40, step)]:
        if kv.triaxial and plan[0] == 1:
            continue  # a triaxial row always has its INT2 / INT4 boundary's split
        want, got = run(0, plan).float(), run(1, plan).float()
        assert int(counters.count_nonzero()) == 0, plan
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-6), (plan, float((got - want).abs().max()))
        assert float(want.abs().max()) > 0  # the rows are not all empty
    planned = gluon_decode.split_plan(q, kv, filled.page_table, cfg)
    for plan in [(1, 64 * step), two, planned, (33, step), (64, step)]:
        if kv.triaxial and plan[0] == 1:
            continue
        want = run(0, plan).float()
        for merge_sc in (2, 8):
            got = run(1, plan, merge_sc).float()
            assert int(counters.count_nonzero()) == 0, (plan, merge_sc)
            assert torch.allclose(got, want, rtol=2**-7, atol=1e-6), (plan, merge_sc, float((got - want).abs().max()))
    plan = (40, step)
    run(1, plan)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = run(1, plan)
        second = run(1, plan)
    want = run(0, plan).float()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.count_nonzero()) == 0
        assert torch.allclose(first.float(), want, rtol=2**-7, atol=1e-6)
        assert torch.equal(first, second)

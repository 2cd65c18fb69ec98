"""Every kernel finds a page where ``page_ids.page_byte_offset`` says it is.

Triton kernels cannot call Python, so each repeats the offset formula inside
the kernel (plain pages count up from byte 0, INT2 pages down from
``total_bytes``). These tests hold each one to the Python definition: pages
are placed (or looked for) at ``page_byte_offset`` in a poisoned buffer whose
``total_bytes`` stops short of the buffer's end, so a kernel that counted INT2
pages from the buffer's end, or scaled an index by the wrong page size, reads
or writes the wrong bytes. Each check runs on a buffer of one layer and on
layers 1 and 2 of a buffer of three, page-major (``kv_cache.layout:
page_major``): a kernel that stepped from page to page by the page's bytes
instead of the stride, or ignored the layer, lands in another layer's bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_paged_ref import dense_attention, rel_err

from kvserving.kernels import gluon_decode, page_ids, paged_ref, triton_decode, triton_gather, triton_prefill, triton_write
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.page_ids import make_page_id
from kvserving.kernels.paged_kv import PagedKV

interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)
PLAIN_ID = 5  # the plain (or INT4) page the tests use
INT2_ID = make_page_id(3, bits=2)
# (layers in the buffer, the layer addressed): one layer; the middle and the last of three, page-major
LAYERS = [(1, 0), (3, 1), (3, 2)]


def _kv(case: str, *, p: int, h: int, d: int, device: str, layers: tuple[int, int] = (1, 0)) -> PagedKV:
    """A poisoned buffer with room for 8 plain and 6 INT2 pages of each of ``layers[0]`` layers, plus 48 bytes past
    total_bytes; the KV of layer ``layers[1]``."""
    fmt = "int4" if case == "triaxial" else case
    lay = PageLayout.build(fmt, page_size=p, kv_heads=h, head_dim=d)
    lay2 = PageLayout.build("int2", page_size=p, kv_heads=h, head_dim=d) if case == "triaxial" else None
    n, layer = layers
    total = n * (8 * lay.page_bytes + (6 * lay2.page_bytes if lay2 else 0))
    buf = torch.randint(0, 256, (total + 48,), dtype=torch.uint8, device=device)
    return PagedKV(buf, lay, 0.02, 0.03, lay2, total, layers=n, layer=layer)


def _offset(kv: PagedKV, pid: int) -> int:
    """Where page_ids says layer kv.layer's page pid lies (written out, not through PagedKV)."""
    two = kv.int2_layout.page_bytes if kv.int2_layout is not None else 0
    return page_ids.page_byte_offset(pid, page_bytes=kv.layout.page_bytes, int2_page_bytes=two, total_bytes=kv.total_bytes,
                                     layers=kv.layers, layer=kv.layer)  # fmt: skip


def _one_page(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, *, int2: bool, poison: torch.Tensor) -> torch.Tensor:
    """The bytes of one page holding tokens k, v [P, H, D], written by the reference into a buffer of that page alone
    (page id 0 of either kind sits at byte 0 there, whatever the formula), starting from ``poison``."""
    one = poison.clone()
    if int2:
        alone = PagedKV(one, kv.layout, kv.k_scale, kv.v_scale, kv.int2_layout)
        paged_ref.write_int2_pages(alone, k[None], v[None], torch.tensor([make_page_id(0, bits=2)], dtype=torch.int32, device=one.device))
    else:
        alone = PagedKV(one, kv.layout, kv.k_scale, kv.v_scale)
        slots = torch.arange(k.shape[0], dtype=torch.int32, device=one.device)
        paged_ref.write_kv(alone, k, v, torch.zeros_like(slots), slots)
    return one


def _tokens(kv: PagedKV, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    lay = kv.layout
    g = torch.Generator().manual_seed(3)
    shape = (lay.page_size, lay.kv_heads, lay.head_dim)
    return torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)


def _check_writes(case: str, device: str, *, p: int, h: int, d: int, layers: tuple[int, int] = (1, 0)) -> None:
    kv = _kv(case, p=p, h=h, d=d, device=device, layers=layers)
    before = kv.buffer.clone()
    k, v = _tokens(kv, device)
    slots = torch.arange(p, dtype=torch.int32, device=device)
    triton_write.write_kv(kv, k, v, torch.full_like(slots, PLAIN_ID), slots)
    writes = [(PLAIN_ID, kv.layout.page_bytes, False)]
    if kv.triaxial:
        triton_write.write_int2_pages(kv, k[None], v[None], torch.tensor([INT2_ID], dtype=torch.int32, device=device))
        writes.append((INT2_ID, kv.int2.page_bytes, True))
    touched = torch.zeros_like(kv.buffer, dtype=torch.bool)
    for pid, nbytes, int2 in writes:
        off = _offset(kv, pid)
        page = kv.buffer[off : off + nbytes]
        assert torch.equal(page, _one_page(kv, k, v, int2=int2, poison=before[off : off + nbytes])), (case, pid)
        touched[off : off + nbytes] = True
    assert torch.equal(kv.buffer[~touched], before[~touched]), "a write touched bytes outside its page"


def _placed(case: str, device: str, *, p: int, h: int, d: int, layers: tuple[int, int] = (1, 0)) -> tuple[PagedKV, list[int]]:
    """A KV whose pages INT2_ID (triaxial) and PLAIN_ID (in that order) were put at page_byte_offset."""
    kv = _kv(case, p=p, h=h, d=d, device=device, layers=layers)
    k, v = _tokens(kv, device)
    ids = ([INT2_ID] if kv.triaxial else []) + [PLAIN_ID]
    for pid in ids:
        int2 = pid == INT2_ID
        nbytes = kv.int2.page_bytes if int2 else kv.layout.page_bytes
        off = _offset(kv, pid)
        kv.buffer[off : off + nbytes] = _one_page(kv, k, v, int2=int2, poison=kv.buffer[off : off + nbytes])
    return kv, ids


def _check_gather(case: str, device: str, *, p: int, h: int, d: int, layers: tuple[int, int] = (1, 0)) -> None:
    kv, ids = _placed(case, device, p=p, h=h, d=d, layers=layers)
    table = torch.tensor(ids, dtype=torch.int32, device=device)
    n = len(ids) * p
    got_k, got_v = torch.empty(n, h, d, device=device), torch.empty(n, h, d, device=device)
    triton_gather.gather_kv(kv, table, n, got_k, got_v)
    want_k, want_v = torch.empty(n, h, d), torch.empty(n, h, d)
    cpu = _on_cpu(kv)
    paged_ref.gather_kv(cpu, table.cpu(), n, want_k, want_v)
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def _on_cpu(kv: PagedKV) -> PagedKV:
    return PagedKV(kv.buffer.cpu(), kv.layout, kv.k_scale, kv.v_scale, kv.int2_layout, kv.total_bytes, layers=kv.layers, layer=kv.layer)


def _check_decode(case: str, device: str, *, p: int, h: int, d: int, kernel: str, layers: tuple[int, int] = (1, 0)) -> None:
    kv, ids = _placed(case, device, p=p, h=h, d=d, layers=layers)
    g = 4
    q = torch.randn(1, h * g, d, device=device)
    table = torch.tensor([ids], dtype=torch.int32, device=device)
    lens = torch.tensor([len(ids) * p], dtype=torch.int32, device=device)
    n2 = torch.tensor([1], dtype=torch.int32, device=device) if kv.triaxial else None
    if kernel == "gluon":
        assert gluon_decode.supported(kv, q)
        out = gluon_decode.decode_attention(q, kv, table, lens, sm_scale=d**-0.5, num_int2_pages=n2)
    else:
        out = triton_decode.decode_attention(q, kv, table, lens, sm_scale=d**-0.5, num_int2_pages=n2, fast=device == "cuda")
    n = len(ids) * p
    ek, ev = torch.empty(n, h, d), torch.empty(n, h, d)
    cpu = _on_cpu(kv)
    paged_ref.gather_kv(cpu, table[0].cpu(), n, ek, ev)  # what the placed pages decode to
    assert rel_err(out[0].cpu(), dense_attention(q[0].cpu(), ek, ev, d**-0.5)) < 3e-3


def _check_extend(case: str, device: str, *, p: int, h: int, d: int, layers: tuple[int, int] = (1, 0)) -> None:
    """The tl extend kernel (a chunk of 5 new tokens after the placed pages) against the reference on the same KV."""
    kv, ids = _placed(case, device, p=p, h=h, d=d, layers=layers)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, h * 4, d, generator=g).to(device)
    k, v = torch.randn(5, h, d, generator=g).to(device), torch.randn(5, h, d, generator=g).to(device)
    table = torch.tensor(ids, dtype=torch.int32, device=device)
    out = triton_prefill.extend_attention(q, k, v, kv, table, len(ids) * p, sm_scale=d**-0.5, fast=device == "cuda")
    want = paged_ref.extend_attention(q.cpu(), k.cpu(), v.cpu(), _on_cpu(kv), table.cpu(), len(ids) * p, sm_scale=d**-0.5)
    assert rel_err(out.cpu(), want) < 3e-3


@interpreter_only
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("case", ["nvfp4", "triaxial"])
def test_writers_put_pages_at_page_byte_offset(case: str, layers: tuple[int, int]) -> None:
    _check_writes(case, "cpu", p=8, h=2, d=64, layers=layers)


@interpreter_only
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("case", ["nvfp4", "triaxial"])
def test_gather_reads_pages_at_page_byte_offset(case: str, layers: tuple[int, int]) -> None:
    _check_gather(case, "cpu", p=8, h=2, d=64, layers=layers)


@interpreter_only
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("case", ["nvfp4", "triaxial"])
def test_tl_decode_reads_pages_at_page_byte_offset(case: str, layers: tuple[int, int]) -> None:
    _check_decode(case, "cpu", p=8, h=2, d=64, kernel="tl", layers=layers)


@interpreter_only
@pytest.mark.parametrize("layers", [(1, 0), (3, 2)])
@pytest.mark.parametrize("case", ["nvfp4", "triaxial"])
def test_tl_extend_reads_pages_at_page_byte_offset(case: str, layers: tuple[int, int]) -> None:
    _check_extend(case, "cpu", p=8, h=2, d=64, layers=layers)


@pytest.mark.parametrize("layers", LAYERS)
def test_reference_offsets_are_page_ids_offsets(layers: tuple[int, int]) -> None:
    kv = _kv("triaxial", p=8, h=2, d=64, device="cpu", layers=layers)
    ids = [0, PLAIN_ID, 7, make_page_id(0, bits=2), INT2_ID, make_page_id(5, bits=2)]
    assert kv.page_offsets(torch.tensor(ids, dtype=torch.int32)).tolist() == [_offset(kv, i) for i in ids]
    assert [kv.page_offset(i) for i in ids] == [_offset(kv, i) for i in ids]
    n, layer = layers
    pb, ib = kv.layout.page_bytes, kv.int2.page_bytes
    # slot i of every layer is one block of n pages, this layer's at layer * page bytes inside it
    assert _offset(kv, PLAIN_ID) == PLAIN_ID * n * pb + layer * pb
    assert _offset(kv, make_page_id(0, bits=2)) == kv.total_bytes - (n - layer) * ib < kv.buffer.numel() - ib
    # the kernels' terms: base + id * stride, base + int2_top - (index + 1) * int2 stride
    base = kv.base.data_ptr() - kv.buffer.data_ptr()
    assert base + PLAIN_ID * kv.page_stride == _offset(kv, PLAIN_ID)
    assert base + kv.int2_top - (3 + 1) * kv.int2_stride == _offset(kv, INT2_ID)


def test_a_run_of_pages_of_every_layer_is_one_span_page_major() -> None:
    """Pages i .. i+k of all layers fill [i * n * pb, (i+k+1) * n * pb) exactly (INT2 likewise from the top): what makes
    a run of pages one NIXL region."""
    n = 3
    kvs = [_kv("triaxial", p=8, h=2, d=64, device="cpu", layers=(n, layer)) for layer in range(n)]
    pb, ib, total = kvs[0].layout.page_bytes, kvs[0].int2.page_bytes, kvs[0].total_bytes
    spans = sorted((kv.page_offset(i), pb) for kv in kvs for i in (2, 3, 4))
    assert spans == [(2 * n * pb + j * pb, pb) for j in range(3 * n)]
    spans2 = sorted((kv.page_offset(make_page_id(j, bits=2)), ib) for kv in kvs for j in (0, 1))
    assert spans2 == [(total - 2 * n * ib + j * ib, ib) for j in range(2 * n)]


@pytest.mark.gpu
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("case", ["fp8_e4m3", "nvfp4", "triaxial"])
def test_gpu_every_kernel_addresses_pages_at_page_byte_offset(case: str, layers: tuple[int, int]) -> None:
    p = 32 if case == "triaxial" else 16
    _check_writes(case, "cuda", p=p, h=8, d=128, layers=layers)
    _check_gather(case, "cuda", p=p, h=8, d=128, layers=layers)
    _check_decode(case, "cuda", p=p, h=8, d=128, kernel="tl", layers=layers)
    if case != "fp8_e4m3":
        _check_decode(case, "cuda", p=p, h=8, d=128, kernel="gluon", layers=layers)


@pytest.mark.gpu
@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("case", ["nvfp4", "triaxial"])
def test_gpu_extend_kernels_address_pages_at_page_byte_offset(case: str, layers: tuple[int, int]) -> None:
    """The extend the engine dispatches (Gluon on Hopper) and the tl kernel, each against the reference."""
    from kvserving.kernels import paged_ops

    p = 32 if case == "triaxial" else 16
    _check_extend(case, "cuda", p=p, h=8, d=128, layers=layers)
    kv, ids = _placed(case, "cuda", p=p, h=8, d=128, layers=layers)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(64, 32, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(64, 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    table = torch.tensor(ids, dtype=torch.int32, device="cuda")
    out = paged_ops.extend_attention(q, k, v, kv, table, len(ids) * p, sm_scale=128**-0.5)
    want = paged_ref.extend_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), _on_cpu(kv), table.cpu(), len(ids) * p,
                                      sm_scale=128**-0.5)  # fmt: skip
    assert rel_err(out.cpu().float(), want) < 1e-2


# compiled for sm_90 in a child process (the test session runs with TRITON_INTERPRET=1)
_COMPILE_STRIDES = r"""
import json
from kvserving.kernels import gluon_decode, gluon_extend, gluon_extend_tri
from kvserving.kernels.compile_report import report

def summary(kernel, sig, const, mult, **kw):
    c = dict(const, PAGE_BYTES=const["PAGE_BYTES"] * mult)
    if "PAGE_BYTES2" in c:
        c["PAGE_BYTES2"] = const["PAGE_BYTES2"] * mult
    r = report(kernel, sig, c, gluon=True, sm=90, **kw)
    return [r["regs"], r["stack"], r["local"], sum(r["ops"].values())]

out = {}
for fmt in ("nvfp4", "triaxial", "fp8_e4m3"):
    sig, const = gluon_decode.compile_report_args(fmt, heads=4)
    warps = const.pop("num_warps")
    cap = gluon_decode.register_cap(fmt, gluon_decode.GL_TUNING["int4" if fmt == "triaxial" else fmt], heads=4)
    out[fmt] = [summary(gluon_decode._gl_decode_kernel, sig, const, m, num_warps=warps, maxnreg=cap, aligned=("total_bytes",))
                for m in (1, 36)]
for name, mod, aligned in (("extend nvfp4", gluon_extend, ("q_s0", "k_s0", "o_s0", "o_s1")),
                           ("extend triaxial", gluon_extend_tri, ("total_bytes", "q_s0", "k_s0", "o_s0", "o_s1"))):
    kernel, sig, const = mod.compile_report_args()
    warps, cap = const.pop("num_warps"), const.pop("maxnreg", None)
    out[name] = [summary(kernel, sig, const, m, num_warps=warps, maxnreg=cap, aligned=aligned) for m in (1, 36)]
print(json.dumps(out))
"""


def test_the_gluon_kernels_compile_alike_with_a_page_major_stride() -> None:
    """The Gluon decode and extends (which the interpreter cannot run) with the page stride of a 36-layer page-major
    buffer: the same registers, stack and instruction count on sm_90 as with a layer's own page bytes (the stride is
    one 64-bit multiply's constant). Their page-major addressing itself is the gpu test's above."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_STRIDES], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(got) == {"nvfp4", "triaxial", "fp8_e4m3", "extend nvfp4", "extend triaxial"}
    for name, (layer_major, page_major) in got.items():
        assert page_major == layer_major, (name, layer_major, page_major)
        assert layer_major[2] == 0, name  # no local memory

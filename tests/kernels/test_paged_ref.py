"""Reference paged-KV ops (kernels/paged_ref.py) against the codecs and dense attention.

The builders here (``make_pool``, ``fill_sequences``, ``expected_kv``,
``dense_attention``) are shared with the Triton tests (test_triton_paged.py),
which hold the kernels to the same expectations.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvserving.kernels import paged_ops, paged_ref
from kvserving.kernels.fp8 import dequantize_fp8, quantize_fp8
from kvserving.kernels.intquant import dequantize_groups, dequantize_int2_keys, quantize_groups, quantize_int2_keys
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.kernels.paged_kv import PagedKV

# pages of ids never used by a sequence: reading one is a bug the result shows
PAD_ID = 1_000_000


@dataclass
class Pool:
    layout: PageLayout
    int2: PageLayout | None
    buffer: torch.Tensor  # uint8 [total_bytes], poisoned with random bytes
    num_pages: int
    num_int2_pages: int

    @property
    def total_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def int2_pages(self) -> PageLayout:
        assert self.int2 is not None, "this pool has no INT2 pages"
        return self.int2

    def kv(self, k_scale: float = 1.0, v_scale: float = 1.0) -> PagedKV:
        """The pool as the ops take it (triaxial when it has INT2 pages)."""
        return PagedKV(self.buffer, self.layout, k_scale, v_scale, self.int2)


def make_pool(
    fmt: str, *, num_pages: int, page_size: int, kv_heads: int, head_dim: int, num_int2_pages: int = 0, device: str = "cpu"
) -> Pool:
    layout = PageLayout.build(fmt, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim)
    int2 = PageLayout.build("int2", page_size=page_size, kv_heads=kv_heads, head_dim=head_dim) if num_int2_pages else None
    total = num_pages * layout.page_bytes + (num_int2_pages * int2.page_bytes if int2 else 0)
    buffer = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    return Pool(layout, int2, buffer, num_pages, num_int2_pages)


@dataclass
class Filled:
    page_table: torch.Tensor  # int32 [B, max_pages]
    seq_lens: torch.Tensor  # int32 [B]
    num_int2: torch.Tensor | None  # int32 [B]
    k: list[torch.Tensor]  # per sequence, the tokens written, fp32 [L, H, D] (INT2 pages first)
    v: list[torch.Tensor]


def fill_sequences(
    pool: Pool,
    seq_lens: list[int],
    *,
    int2_pages: list[int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    ops: object = paged_ref,
    dtype: torch.dtype = torch.float32,
    pad_pages: int = 2,
) -> Filled:
    """Allocate non-contiguous pages for each sequence, write random K/V through ``ops``, return the table."""
    lay, p = pool.layout, pool.layout.page_size
    h, d = lay.kv_heads, lay.head_dim
    dev = pool.buffer.device
    free4 = torch.randperm(pool.num_pages).tolist()
    free2 = torch.randperm(pool.num_int2_pages).tolist()
    int2_pages = int2_pages or [0] * len(seq_lens)
    rows, ks, vs = [], [], []
    tok_k, tok_v, tok_page, tok_slot = [], [], [], []
    pg_k, pg_v, pg_ids = [], [], []
    for n, n2 in zip(seq_lens, int2_pages, strict=True):
        k = torch.randn(n, h, d) * 2
        v = torch.randn(n, h, d)
        ids2 = [free2.pop() | INT2_PAGE_FLAG for _ in range(n2)]
        n4 = n - n2 * p
        ids4 = [free4.pop() for _ in range((n4 + p - 1) // p)]
        for j, pid in enumerate(ids2):
            pg_k.append(k[j * p : (j + 1) * p])
            pg_v.append(v[j * p : (j + 1) * p])
            pg_ids.append(pid)
        for t in range(n4):
            tok_k.append(k[n2 * p + t])
            tok_v.append(v[n2 * p + t])
            tok_page.append(ids4[t // p])
            tok_slot.append(t % p)
        rows.append(ids2 + ids4)
        ks.append(k.to(dtype).float())
        vs.append(v.to(dtype).float())
    width = max(len(r) for r in rows) + pad_pages
    table = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.int32)
    if pg_ids:
        ops.write_int2_pages(  # type: ignore[attr-defined]
            pool.kv(), torch.stack(pg_k).to(dev, dtype), torch.stack(pg_v).to(dev, dtype),
            torch.tensor(pg_ids, dtype=torch.int32, device=dev),
        )  # fmt: skip
    if tok_k:
        order = torch.randperm(len(tok_k))  # tokens arrive in any order
        ops.write_kv(  # type: ignore[attr-defined]
            pool.kv(k_scale, v_scale),
            torch.stack(tok_k)[order].to(dev, dtype), torch.stack(tok_v)[order].to(dev, dtype),
            torch.tensor(tok_page, dtype=torch.int32)[order].to(dev), torch.tensor(tok_slot, dtype=torch.int32)[order].to(dev),
        )  # fmt: skip
    num_int2 = torch.tensor(int2_pages, dtype=torch.int32, device=dev) if pool.int2 else None
    return Filled(table.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev), num_int2, ks, vs)


def roundtrip(fmt: str, x: torch.Tensor, scale: float, which: str = "v") -> torch.Tensor:
    """Codec quantize -> dequantize, fp32: ``x`` is [L, H, D] tokens, or [N, P, H, D] pages for int2."""
    if fmt == "bf16":
        return x.to(torch.bfloat16).float()
    if fmt == "fp32":
        return x.float()
    if fmt == "fp8_e4m3":
        return dequantize_fp8(quantize_fp8(x, scale), scale, dtype=torch.float32)
    if fmt == "nvfp4":
        return dequantize_nvfp4(*quantize_nvfp4(x, scale), scale, dtype=torch.float32)
    if fmt == "int4":
        return dequantize_groups(*quantize_groups(x, 4), 4, dtype=torch.float32)
    xh = x.transpose(1, 2)  # int2 pages: [N, H, P, D]
    if which == "k":
        out = dequantize_int2_keys(*quantize_int2_keys(xh), dtype=torch.float32)
    else:
        out = dequantize_groups(*quantize_groups(xh, 2), 2, dtype=torch.float32)
    return out.transpose(1, 2)


def expected_kv(pool: Pool, filled: Filled, i: int, *, k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """What sequence i's cache must decode to, straight from the codecs: fp32 [L, H, D] each."""
    p = pool.layout.page_size
    n2 = int(filled.num_int2[i]) if filled.num_int2 is not None else 0
    out = []
    for which, x, scale in (("k", filled.k[i], k_scale), ("v", filled.v[i], v_scale)):
        parts = []
        if n2:
            pages = x[: n2 * p].reshape(n2, p, *x.shape[1:])
            parts.append(roundtrip("int2", pages, scale, which).reshape(n2 * p, *x.shape[1:]))
        parts.append(roundtrip(pool.layout.fmt, x[n2 * p :], scale))
        out.append(torch.cat(parts))
    return out[0], out[1]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [Hq, D], k/v [L, H, D] -> [Hq, D] in fp64; query head j reads kv head j // (Hq / H)."""
    group = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), kk) * sm_scale
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), vv)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------

FORMATS = ["bf16", "fp32", "fp8_e4m3", "nvfp4", "int4"]
SCALES = {"bf16": 1.0, "fp32": 1.0, "fp8_e4m3": 0.05, "nvfp4": 1.5 / (6 * 448), "int4": 1.0}


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_then_gather_equals_codec_roundtrip(fmt: str) -> None:
    pool = make_pool(fmt, num_pages=12, page_size=8, kv_heads=2, head_dim=32)
    ks, vs = SCALES[fmt], SCALES[fmt] * 2
    filled = fill_sequences(pool, [1, 8, 19], k_scale=ks, v_scale=vs)
    for i, n in enumerate([1, 8, 19]):
        ek, ev = expected_kv(pool, filled, i, k_scale=ks, v_scale=vs)
        out_k = torch.full((n + 3, 2, 32), float("nan"))
        out_v = torch.full((n + 3, 2, 32), float("nan"))
        paged_ref.gather_kv(pool.kv(ks, vs), filled.page_table[i, : (n + 7) // 8], n, out_k, out_v)
        assert torch.equal(out_k[:n], ek) and torch.equal(out_v[:n], ev)
        assert out_k[n:].isnan().all() and out_v[n:].isnan().all()  # nothing past num_tokens written


def test_gather_mixed_int2_and_int4_pages_into_bf16_workspace() -> None:
    pool = make_pool("int4", num_pages=6, page_size=8, kv_heads=2, head_dim=64, num_int2_pages=5)
    filled = fill_sequences(pool, [8 * 3 + 5, 16], int2_pages=[3, 2])
    for i, n in enumerate([29, 16]):
        ek, ev = expected_kv(pool, filled, i)
        out_k = torch.empty(n, 2, 64, dtype=torch.bfloat16)
        out_v = torch.empty(n, 2, 64, dtype=torch.bfloat16)
        paged_ref.gather_kv(pool.kv(), filled.page_table[i], n, out_k, out_v)
        assert torch.equal(out_k, ek.bfloat16()) and torch.equal(out_v, ev.bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_equals_dense_attention_on_dequantized_kv(fmt: str) -> None:
    lens = [1, 8, 9, 30]  # one token, exactly one page, one past a page, partial last page
    pool = make_pool(fmt, num_pages=14, page_size=8, kv_heads=2, head_dim=32)
    filled = fill_sequences(pool, lens, k_scale=SCALES[fmt], v_scale=SCALES[fmt])
    q = torch.randn(len(lens), 8, 32, dtype=torch.bfloat16)
    out = paged_ref.decode_attention(q, pool.kv(SCALES[fmt], SCALES[fmt]), filled.page_table, filled.seq_lens, sm_scale=0.2)
    assert out.dtype == torch.bfloat16
    for i in range(len(lens)):
        ek, ev = expected_kv(pool, filled, i, k_scale=SCALES[fmt], v_scale=SCALES[fmt])
        ref = dense_attention(q[i], ek, ev, 0.2)
        assert rel_err(out[i], ref) < 8e-3  # bf16 output rounding only


def test_triaxial_decode_reads_int2_pages_then_int4_pages() -> None:
    lens, n2 = [8 * 2 + 1, 8 * 4, 5], [2, 3, 0]
    pool = make_pool("int4", num_pages=8, page_size=8, kv_heads=2, head_dim=32, num_int2_pages=6)
    filled = fill_sequences(pool, lens, int2_pages=n2)
    q = torch.randn(3, 4, 32)
    out = paged_ops.decode_attention(q, pool.kv(), filled.page_table, filled.seq_lens, sm_scale=0.3, num_int2_pages=filled.num_int2)
    for i in range(3):
        ek, ev = expected_kv(pool, filled, i)
        assert rel_err(out[i], dense_attention(q[i], ek, ev, 0.3)) < 1e-5


def test_zero_length_sequence_decodes_to_zeros() -> None:
    pool = make_pool("bf16", num_pages=4, page_size=4, kv_heads=1, head_dim=32)
    filled = fill_sequences(pool, [3, 0])
    out = paged_ref.decode_attention(torch.randn(2, 2, 32), pool.kv(), filled.page_table, filled.seq_lens, sm_scale=1.0)
    assert torch.equal(out[1], torch.zeros(2, 32))


def test_write_int2_pages_matches_codec_bytes() -> None:
    pool = make_pool("int4", num_pages=1, page_size=32, kv_heads=2, head_dim=32, num_int2_pages=3)
    k, v = torch.randn(2, 32, 2, 32), torch.randn(2, 32, 2, 32)
    ids = torch.tensor([2 | INT2_PAGE_FLAG, 0 | INT2_PAGE_FLAG], dtype=torch.int32)
    paged_ref.write_int2_pages(pool.kv(), k, v, ids)
    top = pool.total_bytes - pool.int2_pages.page_bytes  # INT2 page 0 is the last page of the buffer
    views = pool.int2_pages.views(pool.buffer[top:].view(1, -1))
    codes, scale, zero = quantize_int2_keys(k[1].transpose(0, 1))
    assert torch.equal(views["k"][0], codes) and torch.equal(views["k_scale"][0], scale) and torch.equal(views["k_zero"][0], zero)
    vcodes, _, _ = quantize_groups(v[1].transpose(0, 1), 2)
    assert torch.equal(views["v"][0], vcodes)


def test_bad_inputs_raise_value_errors_naming_the_problem() -> None:
    pool = make_pool("fp8_e4m3", num_pages=4, page_size=4, kv_heads=2, head_dim=32)
    filled = fill_sequences(pool, [5])
    q = torch.randn(1, 4, 32)
    kv = pool.kv()
    with pytest.raises(ValueError, match="int32"):
        paged_ref.decode_attention(q, kv, filled.page_table.long(), filled.seq_lens, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_ref.decode_attention(torch.randn(1, 3, 32), kv, filled.page_table, filled.seq_lens, sm_scale=1.0)
    with pytest.raises(ValueError, match="exceeds max_pages"):
        paged_ref.decode_attention(q, kv, filled.page_table[:, :1], filled.seq_lens, sm_scale=1.0)
    bad = filled.page_table.clone()
    bad[0, 0] = 4
    with pytest.raises(ValueError, match="out of range"):
        paged_ref.decode_attention(q, kv, bad, filled.seq_lens, sm_scale=1.0)
    with pytest.raises(ValueError, match="exactly when the KV is triaxial"):
        paged_ref.decode_attention(q, kv, filled.page_table, filled.seq_lens, sm_scale=1.0, num_int2_pages=filled.seq_lens)
    k = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="same \\(page, slot\\)"):
        paged_ref.write_kv(kv, k, k, torch.tensor([1, 1], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="slots"):
        paged_ref.write_kv(kv, k, k, torch.tensor([1, 1], dtype=torch.int32), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="heads/dim"):
        paged_ref.write_kv(
            kv, torch.randn(2, 2, 64), torch.randn(2, 2, 64), torch.zeros(2, dtype=torch.int32), torch.arange(2, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="does not fit"):
        paged_ref.gather_kv(kv, filled.page_table[0, :2], 9, torch.empty(9, 2, 32), torch.empty(9, 2, 32))
    with pytest.raises(ValueError, match="backend"):
        paged_ops.decode_attention(q, kv, filled.page_table, filled.seq_lens, sm_scale=1.0, backend="cuda")
    with pytest.raises(ValueError, match="needs a triaxial KV"):
        paged_ref.write_int2_pages(
            kv, torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 32), torch.tensor([INT2_PAGE_FLAG], dtype=torch.int32)
        )


def test_paged_kv_checks_itself_and_answers_triaxial() -> None:
    lay = PageLayout.build("int4", page_size=8, kv_heads=1, head_dim=32)
    lay2 = PageLayout.build("int2", page_size=8, kv_heads=1, head_dim=32)
    buf = torch.zeros(4096, dtype=torch.uint8)
    assert not PagedKV(buf, lay).triaxial and PagedKV(buf, lay, int2_layout=lay2).triaxial
    assert PagedKV(buf, lay).total_bytes == 4096 and PagedKV(buf, lay, total_bytes=1000).num_pages == 1000 // lay.page_bytes
    with pytest.raises(ValueError, match="total_bytes=5000"):
        PagedKV(buf, lay, total_bytes=5000)
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        PagedKV(buf.view(2, -1), lay)
    with pytest.raises(ValueError, match="int2 goes in int2_layout"):
        PagedKV(buf, lay2)
    with pytest.raises(ValueError, match="int2_layout needs layout.fmt='int4'"):
        PagedKV(buf, PageLayout.build("nvfp4", page_size=8, kv_heads=1, head_dim=32), int2_layout=lay2)
    with pytest.raises(ValueError, match="share page_size"):
        PagedKV(buf, lay, int2_layout=PageLayout.build("int2", page_size=16, kv_heads=1, head_dim=32))
    with pytest.raises(ValueError, match="k_scale"):
        PagedKV(buf, lay, k_scale=0.0)
    with pytest.raises(ValueError, match="not triaxial"):
        _ = PagedKV(buf, lay).int2


def test_triaxial_page_order_is_checked() -> None:
    pool = make_pool("int4", num_pages=4, page_size=8, kv_heads=1, head_dim=32, num_int2_pages=2)
    filled = fill_sequences(pool, [20], int2_pages=[1])
    swapped = filled.page_table.clone()
    swapped[0, :2] = filled.page_table[0, :2].flip(0)  # INT4 page listed before the INT2 page
    with pytest.raises(ValueError, match="INT2 pages first"):
        paged_ref.decode_attention(torch.randn(1, 1, 32), pool.kv(), swapped, filled.seq_lens, sm_scale=1.0, num_int2_pages=filled.num_int2)
    with pytest.raises(ValueError, match="exactly when the KV is triaxial"):
        paged_ref.decode_attention(torch.randn(1, 1, 32), pool.kv(), filled.page_table, filled.seq_lens, sm_scale=1.0)
    with pytest.raises(ValueError, match="INT2_PAGE_FLAG"):
        paged_ref.write_int2_pages(pool.kv(), torch.randn(1, 8, 1, 32), torch.randn(1, 8, 1, 32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="INT2_PAGE_FLAG"):  # write_kv writes INT4 pages only
        paged_ref.write_kv(
            pool.kv(),
            torch.randn(1, 1, 32),
            torch.randn(1, 1, 32),
            torch.tensor([INT2_PAGE_FLAG], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
        )

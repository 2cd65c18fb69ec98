"""The worker's KVStorage as a client of the kernels API: one PagedKV per layer, options read once.

(The storage's role in the engine is tested in tests/worker; here: that what
it hands ``paged_ops`` is the layer's buffer, layouts and current scales, and
that the environment is read when the storage is built, not per call.)
"""

from __future__ import annotations

import pytest
import torch
from test_paged_ref import rel_err

from kvserving.kernels import paged_ref
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.page_ids import make_page_id
from kvserving.kernels.paged_kv import PagedKV
from kvserving.worker.kv.storage import KVShape, KVStorage

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=64)


def _storage(dtype: str, **kw: object) -> KVStorage:
    return KVStorage(dtype, SHAPE, page_size=32 if dtype == "triaxial" else 8, budget_bytes=3 * 40_000, **kw)  # type: ignore[arg-type]


def test_each_layer_is_one_paged_kv_over_its_buffer() -> None:
    st = _storage("triaxial")
    assert st.triaxial and not _storage("fp8_e4m3").triaxial
    for i in range(SHAPE.num_layers):
        kv = st.layer(i)
        assert isinstance(kv, PagedKV) and kv.triaxial
        assert kv.buffer.data_ptr() == st.buffers[i].data_ptr() and kv.total_bytes == st.total_bytes
        assert kv.layout == st.layout and kv.int2_layout == st.int2_layout
    # INT2 page 0 is the last page of the layer's bytes
    assert st.layer(0).page_offset(make_page_id(0, bits=2)) == st.total_bytes - st.int2_layout.page_bytes  # type: ignore[union-attr]


def test_new_scales_reach_the_ops() -> None:
    st = _storage("fp8_e4m3", options=KernelOptions())
    st.k_scales = [0.5, 0.05, 2.0]
    st.v_scales = [0.25, 0.1, 1.0]
    assert [st.layer(i).k_scale for i in range(3)] == [0.5, 0.05, 2.0] and st.layer(1).v_scale == 0.1
    k, v = torch.randn(8, 2, 64) * 3, torch.randn(8, 2, 64)
    ids, slots = torch.full((8,), 2, dtype=torch.int32), torch.arange(8, dtype=torch.int32)
    st.write(1, k, v, ids, slots)
    ref = torch.zeros_like(st.buffers[1])
    paged_ref.write_kv(PagedKV(ref, st.layout, 0.05, 0.1), k, v, ids, slots)
    assert torch.equal(st.buffers[1], ref)
    with pytest.raises(ValueError, match="k_scales needs one scale per layer"):
        st.k_scales = [1.0]


def test_options_are_read_once_when_the_storage_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVING_PAGED_BACKEND", "triton")
    tri = _storage("bf16")
    monkeypatch.setenv("KVSERVING_PAGED_BACKEND", "reference")
    ref = _storage("bf16")
    assert tri.options.backend == "triton" and ref.options.backend == "reference"
    k, v = torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    ids, slots = (torch.arange(20) // 8).int(), (torch.arange(20) % 8).int()
    for st in (tri, ref):
        st.write(0, k, v, ids, slots)
    q = torch.randn(1, 4, 64)
    table, lens = torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    # the env now says reference; the storage built under "triton" still runs the tl kernel (not bit-equal to the reference)
    out_tri = tri.decode(0, q, table, lens, sm_scale=0.125)
    out_ref = ref.decode(0, q, table, lens, sm_scale=0.125, num_int2_pages=lens)  # not triaxial: num_int2_pages is ignored
    assert not torch.equal(out_tri, out_ref) and rel_err(out_tri, out_ref) < 1e-2


@pytest.mark.parametrize("dtype", ["bf16", "nvfp4", "triaxial"])
def test_page_major_storage_holds_each_layers_pages_where_layer_major_does_in_one_region(dtype: str) -> None:
    """The same writes into both layouts: every page of every layer has the same bytes, each layer's decode the same
    output; the page-major storage is one region whose pages hold all layers (a run of pages is one span)."""
    lm, pm = _storage(dtype), _storage(dtype, page_major=True)
    n = SHAPE.num_layers
    assert lm.buffers.shape == (n, lm.total_bytes) and pm.buffers.shape == (1, n * pm.total_bytes)
    pb = lm.layout.page_bytes
    two = lm.int2_layout.page_bytes if lm.int2_layout is not None else 0
    assert lm.region_geometry() == (pb, two, lm.total_bytes)
    assert pm.region_geometry() == (n * pb, n * two, n * pm.total_bytes)
    p = lm.page_size
    g = torch.Generator().manual_seed(0)
    ids = [0, 1, 3]  # a run, then a gap
    int2 = [make_page_id(0, bits=2), make_page_id(1, bits=2)] if lm.triaxial else []
    for st in (lm, pm):
        g.manual_seed(0)
        for layer in range(n):
            k, v = torch.randn(3 * p, 2, 64, generator=g), torch.randn(3 * p, 2, 64, generator=g)
            st.write(layer, k, v, torch.tensor(ids, dtype=torch.int32).repeat_interleave(p), torch.arange(p, dtype=torch.int32).repeat(3))
            if int2:
                k2, v2 = torch.randn(2, p, 2, 64, generator=g), torch.randn(2, p, 2, 64, generator=g)
                st.write_int2_pages(layer, k2, v2, torch.tensor(int2, dtype=torch.int32))
    for layer in range(n):
        a, b = lm.layer(layer), pm.layer(layer)
        for pid in ids + int2:
            size = two if pid in int2 else pb
            lo, po = a.page_offset(pid), b.page_offset(pid)
            assert torch.equal(a.buffer[lo : lo + size], b.buffer[po : po + size]), (layer, pid)
        table = torch.tensor([int2 + ids], dtype=torch.int32)
        q = torch.randn(1, 4, 64, generator=g)
        lens, n2 = torch.tensor([table.shape[1] * p], dtype=torch.int32), torch.tensor([len(int2)], dtype=torch.int32)
        assert torch.equal(lm.decode(layer, q, table, lens, sm_scale=0.125, num_int2_pages=n2),
                           pm.decode(layer, q, table, lens, sm_scale=0.125, num_int2_pages=n2))  # fmt: skip
    # pages 0 and 1 of every layer: one span of the buffer
    spans = sorted(pm.layer(layer).page_offset(pid) for layer in range(n) for pid in (0, 1))
    assert spans == [i * pb for i in range(2 * n)]

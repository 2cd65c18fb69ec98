"""The one dispatch point for paged-KV ops: torch reference on CPU, Triton kernels on CUDA.

The engine calls only these four functions. Each validates its arguments
(paged_ref.check_*) and then runs one backend:

- ``backend=None`` (default): ``$KVSERVING_PAGED_BACKEND`` if set, else
  ``"triton"`` when the buffer is on CUDA and ``"reference"`` otherwise;
- ``backend="reference"`` or ``"triton"`` forces one (Triton on CPU tensors
  runs under ``TRITON_INTERPRET=1``, which is how CI tests the kernels).

Value checks (page ids in range, lengths that fit the page table) read the
index tensors on the host. On CUDA that is a device sync per call, which a
decode loop (and CUDA graph capture) cannot afford, so they run only on CPU
tensors unless ``check_values=True`` or ``KVSERVING_CHECK_VALUES=1``. Shape,
dtype and device checks always run.
"""

from __future__ import annotations

import os
from types import ModuleType

from torch import Tensor

from . import paged_ref
from .layout import PageLayout

BACKENDS = ("reference", "triton")


def _backend(buffer: Tensor, backend: str | None, layout: PageLayout) -> str:
    name = backend or os.environ.get("KVSERVING_PAGED_BACKEND") or ("triton" if buffer.is_cuda else "reference")
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}; expected one of {BACKENDS}")
    if layout.fmt == "fp32":
        return "reference"  # fp32 pages exist for fp32 models on CPU; the reference runs on any device
    return name


def _values(buffer: Tensor, check_values: bool | None) -> bool:
    if check_values is not None:
        return check_values
    return not buffer.is_cuda or os.environ.get("KVSERVING_CHECK_VALUES") == "1"


def _triton() -> ModuleType:
    # imported on first use so CPU engines never load Triton
    from . import triton_paged

    return triton_paged


def write_kv(
    buffer: Tensor,
    layout: PageLayout,
    k: Tensor,
    v: Tensor,
    page_ids: Tensor,
    slots: Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: str | None = None,
    check_values: bool | None = None,
) -> None:
    """Quantize-on-write of T tokens ``k, v: [T, H, D]`` into ``(page_ids[t], slots[t])`` (bf16/fp8_e4m3/nvfp4/int4)."""
    if _backend(buffer, backend, layout) == "reference":
        paged_ref.write_kv(buffer, layout, k, v, page_ids, slots, k_scale=k_scale, v_scale=v_scale)
        return
    paged_ref.check_write_kv(buffer, layout, k, v, page_ids, slots, values=_values(buffer, check_values))
    _triton().write_kv(buffer, layout, k, v, page_ids, slots, k_scale=k_scale, v_scale=v_scale)


def write_int2_pages(
    buffer: Tensor,
    layout: PageLayout,
    k: Tensor,
    v: Tensor,
    page_ids: Tensor,
    *,
    total_bytes: int,
    backend: str | None = None,
    check_values: bool | None = None,
) -> None:
    """Write N whole INT2 pages ``k, v: [N, P, H, D]`` to ids carrying INT2_PAGE_FLAG."""
    if _backend(buffer, backend, layout) == "reference":
        paged_ref.write_int2_pages(buffer, layout, k, v, page_ids, total_bytes=total_bytes)
        return
    paged_ref.check_write_int2_pages(buffer, layout, k, v, page_ids, total_bytes=total_bytes, values=_values(buffer, check_values))
    _triton().write_int2_pages(buffer, layout, k, v, page_ids, total_bytes=total_bytes)


def decode_attention(
    q: Tensor,
    buffer: Tensor,
    layout: PageLayout,
    page_table: Tensor,
    seq_lens: Tensor,
    *,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    int2_layout: PageLayout | None = None,
    num_int2_pages: Tensor | None = None,
    total_bytes: int | None = None,
    backend: str | None = None,
    check_values: bool | None = None,
) -> Tensor:
    """Decode attention of ``q: [B, Hq, D]`` over each sequence's pages -> [B, Hq, D] in q.dtype."""
    kw = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, int2_layout=int2_layout, num_int2_pages=num_int2_pages, total_bytes=total_bytes)
    if _backend(buffer, backend, layout) == "reference":
        return paged_ref.decode_attention(q, buffer, layout, page_table, seq_lens, **kw)  # type: ignore[arg-type]
    total = paged_ref.check_decode(
        q, buffer, layout, page_table, seq_lens,
        int2_layout=int2_layout, num_int2_pages=num_int2_pages, total_bytes=total_bytes,
        values=_values(buffer, check_values),
    )  # fmt: skip
    kw["total_bytes"] = total
    return _triton().decode_attention(q, buffer, layout, page_table, seq_lens, **kw)  # type: ignore[no-any-return]


def gather_kv(
    buffer: Tensor,
    layout: PageLayout,
    page_ids: Tensor,
    num_tokens: int,
    out_k: Tensor,
    out_v: Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    int2_layout: PageLayout | None = None,
    total_bytes: int | None = None,
    backend: str | None = None,
    check_values: bool | None = None,
) -> None:
    """Extend path: dequantize the first ``num_tokens`` tokens of ``page_ids`` into the workspace ``out_k/out_v``."""
    kw = dict(k_scale=k_scale, v_scale=v_scale, int2_layout=int2_layout, total_bytes=total_bytes)
    if _backend(buffer, backend, layout) == "reference":
        paged_ref.gather_kv(buffer, layout, page_ids, num_tokens, out_k, out_v, **kw)  # type: ignore[arg-type]
        return
    total = paged_ref.check_gather(
        buffer, layout, page_ids, num_tokens, out_k, out_v,
        int2_layout=int2_layout, total_bytes=total_bytes, values=_values(buffer, check_values),
    )  # fmt: skip
    kw["total_bytes"] = total
    _triton().gather_kv(buffer, layout, page_ids, num_tokens, out_k, out_v, **kw)

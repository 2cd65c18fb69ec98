"""One layer's paged KV as every op sees it: the byte buffer, its page layout(s) and the layer's global scales.

The ops of ``paged_ops`` (and the backends behind it) take one ``PagedKV``
instead of a buffer, a layout and optional keyword arguments; whether the
KV is triaxial (INT4 pages from the bottom, INT2 pages from the top of one
buffer, layout.py) is ``PagedKV.triaxial``, answered here only::

    plain:     buffer[0 : total_bytes] = page 0 | page 1 | ...           (layout)
    triaxial:  buffer[0 : total_bytes] = int4 pages ... | ... int2 pages  (layout, int2_layout)

The value checks itself once when built (the worker builds one per layer and
keeps it), so the per-call checks only look at the call's own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import PageLayout
from .page_ids import page_byte_offset, page_byte_offsets

# page formats a PagedKV's (first) layout may have; INT2 pages come only with a triaxial int4 layout
PLAIN_FORMATS = ("bf16", "fp32", "fp8_e4m3", "nvfp4", "int4")


@dataclass(frozen=True, slots=True)
class PagedKV:
    """The KV pages of one layer: ``buffer`` uint8 [>= total_bytes], pages in ``layout`` (and ``int2_layout``)."""

    buffer: Tensor
    layout: PageLayout
    k_scale: float = 1.0  # global K scale (fp8: tensor scale; nvfp4: FP32 global scale g); 1.0 otherwise
    v_scale: float = 1.0
    int2_layout: PageLayout | None = None  # triaxial: INT2 pages counted down from total_bytes
    total_bytes: int = 0  # bytes of the buffer the pages use; 0: the whole buffer

    def __post_init__(self) -> None:
        b = self.buffer
        if b.dtype != torch.uint8 or b.dim() != 1 or not b.is_contiguous():
            raise ValueError(f"buffer must be a flat contiguous uint8 tensor, got {b.dtype} {list(b.shape)}")
        if self.total_bytes == 0:
            object.__setattr__(self, "total_bytes", b.numel())
        if not 0 < self.total_bytes <= b.numel():
            raise ValueError(f"total_bytes={self.total_bytes} must be in 1..{b.numel()} (the buffer's size)")
        lay, lay2 = self.layout, self.int2_layout
        if lay.fmt not in PLAIN_FORMATS:
            raise ValueError(f"layout.fmt={lay.fmt!r}: expected one of {PLAIN_FORMATS} (int2 goes in int2_layout)")
        if lay2 is not None:
            if lay.fmt != "int4" or lay2.fmt != "int2":
                raise ValueError(f"int2_layout needs layout.fmt='int4' and int2_layout.fmt='int2', got {lay.fmt!r}, {lay2.fmt!r}")
            if (lay.page_size, lay.kv_heads, lay.head_dim) != (lay2.page_size, lay2.kv_heads, lay2.head_dim):
                raise ValueError("int4 and int2 layouts must share page_size, kv_heads and head_dim")
        for name in ("k_scale", "v_scale"):
            s = getattr(self, name)
            if not (isinstance(s, (int, float)) and s > 0 and s != float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {s!r}")

    @property
    def triaxial(self) -> bool:
        """INT4 and INT2 pages in one buffer (page ids with INT2_PAGE_FLAG are INT2 pages)."""
        return self.int2_layout is not None

    @property
    def int2(self) -> PageLayout:
        """The INT2 page layout of a triaxial KV."""
        if self.int2_layout is None:
            raise ValueError(f"this {self.layout.fmt} KV has no INT2 pages (not triaxial)")
        return self.int2_layout

    @property
    def num_pages(self) -> int:
        """Pages of ``layout`` that fit (triaxial: with no INT2 page)."""
        return self.total_bytes // self.layout.page_bytes

    @property
    def num_int2_pages(self) -> int:
        """INT2 pages that fit with no INT4 page (0 unless triaxial)."""
        return self.total_bytes // self.int2_layout.page_bytes if self.int2_layout is not None else 0

    def page_offset(self, page_id: int) -> int:
        """Byte offset of one page in the buffer (page_ids.page_byte_offset)."""
        return page_byte_offset(page_id, **self._offset_args())

    def page_offsets(self, page_ids: Tensor) -> Tensor:
        """Byte offsets (int64, same shape) of a tensor of ids (page_ids.page_byte_offsets)."""
        return page_byte_offsets(page_ids.long(), **self._offset_args())

    def _offset_args(self) -> dict[str, int]:
        two = self.int2_layout.page_bytes if self.int2_layout is not None else 0
        return {"page_bytes": self.layout.page_bytes, "int2_page_bytes": two, "total_bytes": self.total_bytes}

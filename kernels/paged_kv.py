"""One layer's paged KV as every op sees it: the byte buffer, its page layout(s) and the layer's global scales.

The ops of ``paged_ops`` (and the backends behind it) take one ``PagedKV``
instead of a buffer, a layout and optional keyword arguments; whether the
KV is triaxial (INT4 pages from the bottom, INT2 pages from the top of one
buffer, layout.py) is ``PagedKV.triaxial``, answered here only::

    plain:     buffer[0 : total_bytes] = page 0 | page 1 | ...           (layout)
    triaxial:  buffer[0 : total_bytes] = int4 pages ... | ... int2 pages  (layout, int2_layout)

A buffer may hold ``layers`` layers page-major (``page_ids``: a slot's pages
of every layer lie together, so a run of slots is one NIXL region for the
whole model); this value is then layer ``layer`` of it. The kernels address
a page as ``base + id * page_stride`` (INT2: ``base + int2_top - (index + 1) *
int2_stride``): with one layer, ``base`` is the buffer, the strides are the
page sizes and ``int2_top`` is ``total_bytes``.

The value checks itself once when built (the worker builds one per layer and
keeps it), so the per-call checks only look at the call's own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    total_bytes: int = 0  # bytes of the buffer the pages use (every layer's); 0: the whole buffer
    layers: int = 1  # layers the buffer holds page-major (1: a buffer of this layer alone)
    layer: int = 0  # which of them this is
    base: Tensor = field(init=False, repr=False, compare=False)  # buffer from this layer's first page on

    def __post_init__(self) -> None:
        b = self.buffer
        if b.dtype != torch.uint8 or b.dim() != 1 or not b.is_contiguous():
            raise ValueError(f"buffer must be a flat contiguous uint8 tensor, got {b.dtype} {list(b.shape)}")
        if self.total_bytes == 0:
            object.__setattr__(self, "total_bytes", b.numel())
        if not 0 < self.total_bytes <= b.numel():
            raise ValueError(f"total_bytes={self.total_bytes} must be in 1..{b.numel()} (the buffer's size)")
        if not (isinstance(self.layers, int) and self.layers >= 1 and isinstance(self.layer, int) and 0 <= self.layer < self.layers):
            raise ValueError(f"layers={self.layers!r}, layer={self.layer!r}: need layers >= 1 and 0 <= layer < layers")
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
        object.__setattr__(self, "base", b[self.layer * lay.page_bytes :] if self.layer else b)

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
    def page_stride(self) -> int:
        """Bytes from one page of this layer to the next id's (``layout``'s pages)."""
        return self.layers * self.layout.page_bytes

    @property
    def int2_stride(self) -> int:
        """Bytes from one INT2 page of this layer to the next index's (0 unless triaxial)."""
        return self.layers * self.int2_layout.page_bytes if self.int2_layout is not None else 0

    @property
    def int2_top(self) -> int:
        """Where INT2 index -1 of this layer would start, counted from ``base``: INT2 index j starts at
        ``int2_top - (j + 1) * int2_stride`` (``total_bytes`` for a one-layer buffer)."""
        two = self.int2_layout.page_bytes if self.int2_layout is not None else 0
        return self.total_bytes + self.layer * (two - self.layout.page_bytes)

    @property
    def num_pages(self) -> int:
        """Pages of ``layout`` that fit (triaxial: with no INT2 page)."""
        return self.total_bytes // self.page_stride

    @property
    def num_int2_pages(self) -> int:
        """INT2 pages that fit with no INT4 page (0 unless triaxial)."""
        return self.total_bytes // self.int2_stride if self.int2_layout is not None else 0

    def page_offset(self, page_id: int) -> int:
        """Byte offset of one page in the buffer (page_ids.page_byte_offset)."""
        return page_byte_offset(page_id, **self._offset_args())

    def page_offsets(self, page_ids: Tensor) -> Tensor:
        """Byte offsets (int64, same shape) of a tensor of ids (page_ids.page_byte_offsets)."""
        return page_byte_offsets(page_ids.long(), **self._offset_args())

    def _offset_args(self) -> dict[str, int]:
        two = self.int2_layout.page_bytes if self.int2_layout is not None else 0
        return {"page_bytes": self.layout.page_bytes, "int2_page_bytes": two, "total_bytes": self.total_bytes,
                "layers": self.layers, "layer": self.layer}  # fmt: skip

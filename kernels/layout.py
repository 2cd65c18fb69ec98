"""Byte layout of one KV page per layer, for every format: the contract between
the pool, the reference ops, the Triton kernels and NIXL transfers.

Every layer's KV lives in one flat ``uint8`` buffer. A page is one contiguous
run of ``page_bytes`` bytes holding K and V of ``page_size`` tokens for all KV
heads *with their scales and zeros*, so one (offset, length) descriptor moves a
page completely (a page never travels without its scales).

Fields of a page, in order, each starting on a 16-byte boundary so kernels can
load 16-byte vectors (H = kv heads, P = page size, D = head dim)::

    bf16      k[H,P,D] bf16 | v[H,P,D] bf16      (fp32: the same in float32, for fp32 models)
    fp8_e4m3  k[H,P,D] u8 (E4M3 bits) | v[H,P,D] u8
    nvfp4     k[H,P,D/2] u8 | k_scale[H,P,D/16] u8 (E4M3 bits) | v[H,P,D/2] | v_scale[H,P,D/16]
    int4      k[H,P,D/2] u8 | k_scale[H,P,D/32] f16 | k_zero[H,P,D/32] f16
              v[H,P,D/2] u8 | v_scale[H,D/32,P] f16 | v_zero[H,D/32,P] f16
    int2      k[H,P,D/4] u8 | k_scale[H,D] f16 | k_zero[H,D] f16        (keys: per channel over the page)
              v[H,P,D/4] u8 | v_scale[H,D/32,P] f16 | v_zero[H,D/32,P] f16  (values: per token group)

Value scales and zeros of int4 / int2 pages are stored token-minor ([H, D/32, P]): a decode
thread that holds two adjacent tokens' value bytes loads both tokens' scale (and zero) as one
32-bit word. ``PageLayout.views`` still shows them as [H, P, D/32] (a permuted view).

Heads-major inside a page (HND): a decode kernel reads one head's page as one
contiguous [P, D] tile.

Triaxial keeps INT4 and INT2 pages in the same buffer, INT4 indices counting
up from byte 0 and INT2 indices down from the top (no fixed split); the pool
cuts it into slabs of ``lcm(int4, int2 page bytes)``, each holding pages of one
precision (page_ids.Slabs)::

    byte 0                                                                  total
    | int4 page 0 | int4 page 1 | int4 page 2 | ... | int2 page 1 | int2 page 0 |
     '---------------- slab 0 ----------------'      '----- top of slab N-1 ----'

A page id is an index with ``INT2_PAGE_FLAG`` set for INT2 pages; the flag is
bit 30 so page tables stay non-negative int32. Ids and their byte offsets are
defined once, in page_ids.py (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .page_ids import INT2_PAGE_FLAG as INT2_PAGE_FLAG
from .page_ids import page_byte_offset as page_byte_offset

PAGE_FORMATS = ("bf16", "fp32", "fp8_e4m3", "nvfp4", "int4", "int2")
ALIGN = 16
TRIAXIAL_GROUP = 32
NVFP4_BLOCK = 16


@dataclass(frozen=True, slots=True)
class PageField:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # logical shape ([H, P, ...] for per-token fields)
    offset: int  # bytes from the start of the page
    storage: tuple[int, ...] | None = None  # order of the logical dims in memory (None: as listed)

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


TOKEN_MINOR = (0, 2, 1)  # [H, P, G] fields stored as [H, G, P]


def _field_specs(fmt: str, h: int, p: int, d: int) -> list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...] | None]]:
    if fmt in ("bf16", "fp32"):
        # fp32: unquantized KV for models run in fp32 (CPU tests against transformers)
        t = torch.bfloat16 if fmt == "bf16" else torch.float32
        return [("k", t, (h, p, d), None), ("v", t, (h, p, d), None)]
    if fmt == "fp8_e4m3":
        return [("k", torch.uint8, (h, p, d), None), ("v", torch.uint8, (h, p, d), None)]
    if fmt == "nvfp4":
        return [
            ("k", torch.uint8, (h, p, d // 2), None),
            ("k_scale", torch.uint8, (h, p, d // NVFP4_BLOCK), None),
            ("v", torch.uint8, (h, p, d // 2), None),
            ("v_scale", torch.uint8, (h, p, d // NVFP4_BLOCK), None),
        ]
    g = d // TRIAXIAL_GROUP
    f16 = torch.float16
    values_meta = [("v_scale", f16, (h, p, g), TOKEN_MINOR), ("v_zero", f16, (h, p, g), TOKEN_MINOR)]
    if fmt == "int4":
        return [
            ("k", torch.uint8, (h, p, d // 2), None),
            ("k_scale", f16, (h, p, g), None),
            ("k_zero", f16, (h, p, g), None),
            ("v", torch.uint8, (h, p, d // 2), None),
            *values_meta,
        ]
    if fmt == "int2":
        return [
            ("k", torch.uint8, (h, p, d // 4), None),
            ("k_scale", f16, (h, d), None),
            ("k_zero", f16, (h, d), None),
            ("v", torch.uint8, (h, p, d // 4), None),
            *values_meta,
        ]
    raise ValueError(f"unknown page format {fmt!r}; expected one of {PAGE_FORMATS}")


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Fields and size of one page of one layer in one format."""

    fmt: str
    page_size: int
    kv_heads: int
    head_dim: int
    fields: tuple[PageField, ...]
    page_bytes: int

    @classmethod
    def build(cls, fmt: str, *, page_size: int, kv_heads: int, head_dim: int) -> PageLayout:
        if page_size < 1 or kv_heads < 1:
            raise ValueError(f"page_size and kv_heads must be >= 1, got {page_size}, {kv_heads}")
        if fmt == "nvfp4" and head_dim % NVFP4_BLOCK:
            raise ValueError(f"head_dim must be a multiple of {NVFP4_BLOCK} for nvfp4, got {head_dim}")
        if fmt in ("int4", "int2") and head_dim % TRIAXIAL_GROUP:
            raise ValueError(f"head_dim must be a multiple of {TRIAXIAL_GROUP} for {fmt}, got {head_dim}")
        fields: list[PageField] = []
        offset = 0
        for name, dtype, shape, storage in _field_specs(fmt, kv_heads, page_size, head_dim):
            f = PageField(name, dtype, shape, offset, storage)
            fields.append(f)
            offset = _align(offset + f.nbytes)
        return cls(fmt, page_size, kv_heads, head_dim, tuple(fields), offset)

    def field(self, name: str) -> PageField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.fmt} pages have no field {name!r}")

    def views(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of ``pages``: uint8 [N, page_bytes] -> {field: [N, *shape]} (no copy)."""
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != self.page_bytes:
            raise ValueError(f"pages must be uint8 [N, {self.page_bytes}], got {pages.dtype} {list(pages.shape)}")
        out = {}
        for f in self.fields:
            raw = pages[:, f.offset : f.offset + f.nbytes].view(f.dtype)
            if f.storage is None:
                out[f.name] = raw.view(pages.shape[0], *f.shape)
            else:  # stored in a permuted order: a strided view in the logical one
                stored = raw.view(pages.shape[0], *(f.shape[i] for i in f.storage))
                out[f.name] = stored.permute(0, *(1 + f.storage.index(i) for i in range(len(f.shape))))
        return out

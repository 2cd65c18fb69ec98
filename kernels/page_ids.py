"""Page ids and where their bytes live: the one definition the pools, the
storage, the NIXL descriptors and the kernels share (pure Python, no torch).

A page id is an index; INT2 pages (triaxial) carry ``INT2_PAGE_FLAG`` (bit 30,
so page tables stay non-negative int32). In a layer buffer of ``total_bytes``,
INT4 (or the format's only) pages grow from the bottom and INT2 pages from
the top::

    byte 0                                                               total
    | page 0 | page 1 | ... |      free space      | int2 page 1 | int2 page 0 |
    '--- i * page_bytes ---'                        '- total - (j+1) * int2_bytes

Kernels written in Triton repeat the offset formula inside the kernel (they
cannot call Python); ``tests/kernels`` hold them to ``page_byte_offset``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

INT2_PAGE_FLAG = 1 << 30
_FLAG_BIT = 30
_INDEX_MASK = INT2_PAGE_FLAG - 1

# an int, or an int64 tensor of ids (torch): the offset formula below is elementwise
Ids = TypeVar("Ids", int, "Tensor")


def is_int2(page_id: int) -> bool:
    """True for an INT2 page id."""
    return bool(page_id & INT2_PAGE_FLAG)


def page_id_bits(page_id: int) -> int:
    """Stored precision of a page id: 2 for INT2, 4 for every other page."""
    return 2 if page_id & INT2_PAGE_FLAG else 4


def page_index(page_id: int) -> int:
    """The page's slot counted from its own end of the buffer."""
    return page_id & _INDEX_MASK


def make_page_id(index: int, *, bits: int) -> int:
    """The id of slot ``index`` at ``bits`` precision (2 sets the INT2 flag)."""
    if not 0 <= index < INT2_PAGE_FLAG:
        raise ValueError(f"page index must be in 0..{INT2_PAGE_FLAG - 1}, got {index}")
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    return index | INT2_PAGE_FLAG if bits == 2 else index


def page_byte_offset(page_id: int, *, page_bytes: int, int2_page_bytes: int = 0, total_bytes: int = 0) -> int:
    """Byte offset of a page in its layer buffer (INT2 pages count down from the top)."""
    if page_id & INT2_PAGE_FLAG and (int2_page_bytes <= 0 or total_bytes <= 0):
        raise ValueError(f"page id {page_id} is an INT2 page but the buffer has no INT2 layout")
    return page_byte_offsets(page_id, page_bytes=page_bytes, int2_page_bytes=int2_page_bytes, total_bytes=total_bytes)


def page_byte_offsets(page_ids: Ids, *, page_bytes: int, int2_page_bytes: int = 0, total_bytes: int = 0) -> Ids:
    """``page_byte_offset`` of an id or, elementwise, of an int64 tensor of ids (no branch, so no check:
    callers of the tensor form have refused INT2 ids without an INT2 layout)."""
    int2 = (page_ids >> _FLAG_BIT) & 1  # 1 for INT2 ids
    index = page_ids & _INDEX_MASK
    # plain: index * page_bytes; INT2: total_bytes - (index + 1) * int2_page_bytes
    return index * page_bytes + int2 * (total_bytes - (index + 1) * int2_page_bytes - index * page_bytes)
